"""LayerArrays: weight-gradient parts from a profile, the zero-bubble schedules' slower split backward, and times
interpolated between measured batch sizes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.costs.layer_arrays import ASSUMED_WEIGHT_SHARE, LayerArrays, batch_scaling_note, interpolate_ms
from planner.files.profile import LayerProfile, Profile, SizeTimes, load_profile
from tests.conftest import PROFILES_V1

REPO = Path(__file__).resolve().parents[3]


def test_weight_parts_come_from_measured_input_gradients_or_the_assumed_share() -> None:
    profile = load_profile(PROFILES_V1 / "mlp.json")
    assumed = LayerArrays.from_profile(profile)
    assert not assumed.weight_measured
    backward = np.array([layer.bwd_ms for layer in profile.layers]) / 1000.0
    assert np.diff(assumed.weight_s) == pytest.approx(ASSUMED_WEIGHT_SHARE * backward)
    inputs = [0.25 * layer.bwd_ms for layer in profile.layers]
    measured = dataclasses.replace(profile, layers=tuple(dataclasses.replace(layer, bwd_input_ms=ms)
                                                        for layer, ms in zip(profile.layers, inputs)))
    arrays = LayerArrays.from_profile(measured)
    assert arrays.weight_measured
    assert np.diff(arrays.weight_s) == pytest.approx(0.75 * backward)


def test_zero_bubble_schedules_scale_every_backward_by_the_split_ratio() -> None:
    profile = load_profile(PROFILES_V1 / "mlp.json")
    arrays = dataclasses.replace(LayerArrays.from_profile(profile), split_backward_ratio=1.25)
    assert arrays.for_schedule("1f1b") is arrays and arrays.for_schedule("gpipe") is arrays
    split = arrays.for_schedule("zb-h1")
    assert split.fwd_s == pytest.approx(arrays.fwd_s)
    assert split.compute_s - split.fwd_s == pytest.approx(1.25 * (arrays.compute_s - arrays.fwd_s))
    assert split.weight_s == pytest.approx(1.25 * arrays.weight_s)
    back = split.for_schedule("1f1b")  # a whole backward again (data parallelism, one device)
    assert back.compute_s == pytest.approx(arrays.compute_s) and back.weight_s == pytest.approx(arrays.weight_s)
    assert split.for_schedule("zb-h1") is split
    unmeasured = LayerArrays.from_profile(profile)  # no ratio in the profile: 1, the same arrays
    assert unmeasured.split_backward_ratio == 1.0 and unmeasured.for_schedule("zb-h1") is unmeasured
    noisy = LayerArrays.from_profile(dataclasses.replace(profile, split_backward_ratio=0.97))
    assert noisy.split_backward_ratio == 1.0  # a split cannot cost less than a whole backward: noise


def _two_layers() -> Profile:
    """Two layers measured at batch size 8 and, for their times, at 2 and 4 (input gradients at every size)."""
    layers = tuple(LayerProfile(name=f"l{i}", kind="Linear", fwd_ms=fwd, bwd_ms=bwd, output_bytes=64, cut_bytes=64 * (1 - i),
                                param_bytes=1024, saved_bytes=512, bwd_input_ms=bwd / 2)
                   for i, (fwd, bwd) in enumerate([(4.0, 8.0), (8.0, 16.0)]))
    return Profile(
        model_name="two", source="two.py", device="cpu", device_name="CPU", torch_version="2.13.0", dtype="float32",
        batch_size=8, threads=1, created="2026-01-01T00:00:00+00:00", layers=layers, step_ms=36.0,
        peak_memory_bytes=1 << 20, peak_memory_method="live-tensors", input_bytes=256,
        size_times=(SizeTimes(batch_size=4, fwd_ms=(3.0, 5.0), bwd_ms=(5.0, 9.0), bwd_input_ms=(1.0, 2.0)),
                    SizeTimes(batch_size=2, fwd_ms=(2.0, 2.0), bwd_ms=(3.0, 4.0), bwd_input_ms=(0.5, 1.0))),
    )


def _times_ms(profile: Profile, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer (forward, backward, weight-gradient) ms the cost model uses at `size` samples: the
    `at_batch_size` arrays scaled by sigma = size / batch_size."""
    arrays = LayerArrays.at_batch_size(profile, size)
    sigma = 1000.0 * size / (profile.batch_size or 1)
    fwd = np.diff(arrays.fwd_s) * sigma
    return fwd, np.diff(arrays.compute_s) * sigma - fwd, np.diff(arrays.weight_s) * sigma


@pytest.mark.parametrize(("size", "fwd", "bwd", "bwd_input"), [
    (3, [2.5, 3.5], [4.0, 6.5], [0.75, 1.5]),  # halfway between 2 and 4
    (6, [3.5, 6.5], [6.5, 12.5], [2.5, 5.0]),  # halfway between 4 and 8
    (7, [3.75, 7.25], [7.25, 14.25], [3.25, 6.5]),  # 3/4 of the way from 4 to 8
    (4, [3.0, 5.0], [5.0, 9.0], [1.0, 2.0]),  # measured
    (1, [1.0, 1.0], [1.5, 2.0], [0.25, 0.5]),  # below the smallest: 2's times, halved
    (16, [8.0, 16.0], [16.0, 32.0], [8.0, 16.0]),  # beyond the largest: 8's times, doubled
])
def test_times_are_interpolated_between_measured_sizes_and_scaled_beyond_them(
    size: int, fwd: list[float], bwd: list[float], bwd_input: list[float],
) -> None:
    got_fwd, got_bwd, got_weight = _times_ms(_two_layers(), size)
    assert got_fwd == pytest.approx(fwd, rel=1e-12) and got_bwd == pytest.approx(bwd, rel=1e-12)
    assert got_weight == pytest.approx(np.array(bwd) - bwd_input, rel=1e-12)
    arrays, profiled = LayerArrays.at_batch_size(_two_layers(), size), LayerArrays.from_profile(_two_layers())
    for name in ("param_bytes", "cut_bytes", "saved_bytes", "workspace_bytes", "deferred_bytes"):  # bytes: linear
        assert np.array_equal(getattr(arrays, name), getattr(profiled, name))


def test_without_input_gradients_at_every_size_the_backward_keeps_the_profiled_share() -> None:
    profile = _two_layers()
    profile = dataclasses.replace(profile, size_times=(dataclasses.replace(profile.size_times[0], bwd_input_ms=()),
                                                       profile.size_times[1]))
    _, bwd, weight = _times_ms(profile, 3)
    assert weight == pytest.approx(0.5 * bwd, rel=1e-12)  # bwd_input_ms is half of bwd_ms at 8


def test_one_measured_size_gives_exactly_the_arrays_of_before() -> None:
    profile = load_profile(PROFILES_V1 / "mlp.json")
    several = _two_layers()
    for size in (1, 3, 8, 64):
        _assert_same_arrays(LayerArrays.at_batch_size(profile, size), LayerArrays.from_profile(profile))
    for size in (8, 16):  # at and beyond the profiled (largest) batch: its times, scaled linearly as before
        _assert_same_arrays(LayerArrays.at_batch_size(several, size), LayerArrays.from_profile(several))


def _assert_same_arrays(found: LayerArrays, expected: LayerArrays) -> None:
    for field in dataclasses.fields(LayerArrays):
        value, wanted = getattr(found, field.name), getattr(expected, field.name)
        assert np.array_equal(value, wanted) if isinstance(wanted, np.ndarray) else value == wanted, field.name


@st.composite
def _measurements(draw: st.DrawFn) -> tuple[list[int], np.ndarray]:
    """2-4 distinct sizes ascending, and per size the times of 1-3 layers, ms."""
    sizes = sorted(draw(st.sets(st.integers(1, 64), min_size=2, max_size=4)))
    layers = draw(st.integers(1, 3))
    times = draw(st.lists(st.lists(st.floats(0.0, 1e3), min_size=layers, max_size=layers),
                          min_size=len(sizes), max_size=len(sizes)))
    return sizes, np.array(times)


@given(_measurements(), st.data())
def test_at_a_measured_size_the_measured_time_and_between_two_a_monotone_one(
    measured: tuple[list[int], np.ndarray], data: st.DataObject,
) -> None:
    sizes, times = measured
    k = data.draw(st.integers(0, len(sizes) - 1))
    assert np.array_equal(interpolate_ms(sizes, times, sizes[k]), times[k])
    if k + 1 < len(sizes):
        between = [interpolate_ms(sizes, times, size) for size in range(sizes[k], sizes[k + 1] + 1)]
        low, high = np.minimum(times[k], times[k + 1]), np.maximum(times[k], times[k + 1])
        steps = np.diff(between, axis=0)
        rising = times[k + 1] >= times[k]
        assert np.all(np.where(rising, steps >= 0, steps <= 0))
        assert all(np.all((low - 1e-9 <= t) & (t <= high + 1e-9)) for t in between)


def test_the_cost_model_gets_back_the_measured_times_at_each_measured_size() -> None:
    profile = _two_layers()
    for sized in profile.size_times:
        fwd, bwd, _ = _times_ms(profile, sized.batch_size)
        assert fwd == pytest.approx(sized.fwd_ms, rel=1e-12) and bwd == pytest.approx(sized.bwd_ms, rel=1e-12)


@pytest.mark.parametrize(("size", "note"), [
    (3, "times interpolated between measured batch sizes 2 and 4 for 3 (measured: 2, 4, 8)"),
    (4, "times as measured at batch size 4 (measured: 2, 4, 8)"),
    (16, "times extrapolated linearly beyond the measured batch sizes: scaled from 8 to 16 (measured: 2, 4, 8)"),
    (1, "times extrapolated linearly below the measured batch sizes: scaled from 2 to 1 (measured: 2, 4, 8)"),
])
def test_the_note_says_how_the_times_were_taken(size: int, note: str) -> None:
    assert batch_scaling_note(_two_layers(), size) == note
    one = dataclasses.replace(_two_layers(), size_times=())
    assert batch_scaling_note(one, size) == f"times scaled linearly from the profiled batch of 8 to {size}"


def test_shared_bytes_beyond_their_first_layers_parameters_are_refused() -> None:
    """Every stage's bytes subtract a shared parameter from its first layer's own (`unshared_param_bytes`): more
    shared bytes than that layer holds would price some stages negative, so they are refused, naming the layer."""
    params = np.array([0.0, 100.0, 150.0, 250.0])
    arrays = LayerArrays(compute_s=np.zeros(4), param_bytes=params, cut_bytes=np.zeros(3), shared=((1, (2,), 50.0),))
    assert list(np.diff(arrays.unshared_param_bytes())) == [100.0, 0.0, 100.0]
    with pytest.raises(ValueError, match="layer 1 outweigh its param_bytes by 10"):
        LayerArrays(compute_s=np.zeros(4), param_bytes=params, cut_bytes=np.zeros(3), shared=((1, (2,), 60.0),))
    with pytest.raises(ValueError, match="layer 1 outweigh its frozen_bytes by 10"):  # frozen ones alike
        LayerArrays(compute_s=np.zeros(4), param_bytes=np.zeros(4), cut_bytes=np.zeros(3), frozen_bytes=params,
                    frozen_shared=((1, (2,), 60.0),))


@given(data=st.data())
def test_one_stages_bytes_and_tensors_are_those_of_many_stages_at_once(data: st.DataObject) -> None:
    """A single stage's weight, replicated, frozen and tied bytes and tensor count (computed without arrays) equal its
    row among every stage's (the element-wise path), with shared parameters of several users anywhere."""
    layers = data.draw(st.integers(2, 7))
    params = np.concatenate([[0.0], np.cumsum(np.full(layers, 100.0))])
    users = st.lists(st.integers(0, layers - 1), min_size=2, max_size=3, unique=True).map(sorted)
    shared = tuple((first, tuple(others), 10.0 * (index + 1))
                   for index, (first, *others) in enumerate(data.draw(st.lists(users, max_size=3))))
    arrays = LayerArrays(compute_s=np.zeros(layers + 1), param_bytes=params, cut_bytes=np.zeros(layers),
                         param_tensors=np.arange(layers + 1, dtype=float), shared=shared,
                         frozen_bytes=params / 4, frozen_shared=shared[:1])
    starts, stops = np.array([a for a in range(layers) for b in range(a + 1, layers + 1)]), \
        np.array([b for a in range(layers) for b in range(a + 1, layers + 1)])
    for method in ("pair_weight_bytes", "pair_replicated_bytes", "pair_frozen_bytes", "pair_tensor_counts",
                   "pair_tied_bytes"):
        together = getattr(arrays, method)(starts, stops)
        alone = [float(getattr(arrays, method)(starts[k:k + 1], stops[k:k + 1])[0]) for k in range(len(starts))]
        assert alone == pytest.approx(list(together), abs=1e-9), method
