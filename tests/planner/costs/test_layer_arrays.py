"""LayerArrays: weight-gradient parts from a profile, and the zero-bubble schedules' slower split backward."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from planner.costs.layer_arrays import ASSUMED_WEIGHT_SHARE, LayerArrays
from planner.files.profile import load_profile

REPO = Path(__file__).resolve().parents[3]


def test_weight_parts_come_from_measured_input_gradients_or_the_assumed_share() -> None:
    profile = load_profile(REPO / "profiles" / "mlp.json")
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
    profile = load_profile(REPO / "profiles" / "mlp.json")
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
