"""The profile file: exact round trip, table columns, older versions, and refusal of other formats
and newer versions."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from planner.errors import FileFormatError, PlannerError
from planner.files.plan import profile_digest
from planner.display.tables import profile_summary, profile_table
from planner.files.profile import (
    LAYER_COLUMNS,
    BatchCoupling,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    LayerProfile,
    Profile,
    SharedParam,
    SizeTimes,
    load_profile,
)
from tests.conftest import PROFILES_V1


def _profile() -> Profile:
    layers = tuple(
        LayerProfile(name=f"h.{i}", kind="Block", fwd_ms=0.1 * (i + 1) + 1e-9, bwd_ms=1 / 3, output_bytes=1024,
                     cut_bytes=1024 if i < 2 else 0, param_bytes=4096 * i, saved_bytes=777)
        for i in range(3)
    )
    return Profile(
        model_name="toy", source="examples/toy.py", device="cpu", device_name="Some CPU", torch_version="2.13.0",
        dtype="float32", batch_size=8, threads=2, created="2026-11-20T10:00:00+00:00", layers=layers,
        step_ms=1.2345678901234567, peak_memory_bytes=123456789, peak_memory_method="live-tensors",
        input_bytes=256, shared_params=(SharedParam(names=("a.weight", "b.weight"), nbytes=4096, layers=(1, 2)),),
        settings={"warmup": 1, "iters": 2, "depth": None, "split_points": []},
    )


def test_save_and_load_round_trip_exactly(tmp_path: Path) -> None:
    profile = _profile()
    path = profile.save(tmp_path / "sub" / "toy.json")
    assert load_profile(path) == profile
    document = json.loads(path.read_text())
    assert document["format"] == PROFILE_FORMAT and document["version"] == PROFILE_VERSION == 3
    assert "planner_version" in document


def test_workspace_round_trips_and_a_count_other_than_the_layers_is_refused(tmp_path: Path) -> None:
    profile = dataclasses.replace(_profile(), workspace_bytes=(10, 20, 30), param_tensors=(1, 2, 0),
                                  optimizer_step_per_tensor_ms={"adam": 0.02})
    assert load_profile(profile.save(tmp_path / "w.json")) == profile
    path = _rewrite(tmp_path, workspace_bytes=[10, 20])
    with pytest.raises(FileFormatError, match="2 workspace_bytes for 3 layers"):
        load_profile(path)


def test_the_workspace_enters_the_digest_only_where_it_was_measured() -> None:
    older = _profile()
    assert profile_digest(dataclasses.replace(older, workspace_bytes=())) == profile_digest(older)
    assert profile_digest(dataclasses.replace(older, workspace_bytes=(1, 2, 3))) != profile_digest(older)


def test_the_split_backward_and_other_batch_sizes_enter_the_digest_where_measured() -> None:
    """A plan priced with a split's cost, deferred bytes or times at other sizes belongs to those measurements."""
    older = _profile()
    for changed in (dict(split_backward_ratio=1.2), dict(deferred_bytes=(0, 5, 7)),
                    dict(size_times=_sized().size_times)):
        assert profile_digest(dataclasses.replace(older, **changed)) != profile_digest(older)


def test_the_split_backward_ratio_round_trips_and_is_left_out_where_not_measured(tmp_path: Path) -> None:
    profile = dataclasses.replace(_profile(), split_backward_ratio=1.2345678901234567)
    path = profile.save(tmp_path / "s.json")
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["split_backward_ratio"] == profile.split_backward_ratio
    document = json.loads(_profile().save(tmp_path / "none.json").read_text())
    assert "split_backward_ratio" not in document  # an unmeasured one keeps the body, and the digest, of before
    assert _profile().split_backward_ratio is None and "split_backward_ratio" not in _profile().to_dict()


def test_deferred_bytes_round_trip_and_are_left_out_where_not_measured(tmp_path: Path) -> None:
    profile = dataclasses.replace(_profile(), deferred_bytes=tuple(range(7, 7 + _profile().num_layers)))
    path = profile.save(tmp_path / "d.json")
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["deferred_bytes"] == list(profile.deferred_bytes)
    assert "deferred_bytes" not in _profile().to_dict()  # an unmeasured one keeps the digest of before
    with pytest.raises(ValueError, match="deferred_bytes"):
        dataclasses.replace(_profile(), deferred_bytes=(1,) * (_profile().num_layers + 1))


def test_the_steps_per_call_cost_round_trips_and_is_left_out_where_not_measured(tmp_path: Path) -> None:
    profile = dataclasses.replace(_profile(), optimizer_step_per_call_ms={"adam": 0.42, "sgd": 0.3})
    path = profile.save(tmp_path / "c.json")
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["optimizer_step_per_call_ms"] == {"adam": 0.42, "sgd": 0.3}
    assert "optimizer_step_per_call_ms" not in _profile().to_dict()  # an unmeasured one keeps the digest of before
    assert profile_digest(profile) != profile_digest(_profile())


def test_what_a_split_backward_holds_round_trips_and_is_left_out_where_not_measured(tmp_path: Path) -> None:
    layers = len(_profile().layers)
    profile = dataclasses.replace(_profile(), input_workspace_bytes=tuple(range(layers)),
                                  largest_param_bytes=tuple(range(10, 10 + layers)))
    path = profile.save(tmp_path / "s.json")
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["largest_param_bytes"] == list(range(10, 10 + layers))
    body = _profile().to_dict()
    assert "input_workspace_bytes" not in body and "largest_param_bytes" not in body  # the digest of before
    assert profile_digest(profile) != profile_digest(_profile())
    with pytest.raises(ValueError, match="1 input_workspace_bytes for"):
        dataclasses.replace(_profile(), input_workspace_bytes=(5,))


def test_a_version_2_file_without_the_split_backward_ratio_loads_with_none(tmp_path: Path) -> None:
    body = dataclasses.asdict(_measured())  # what version 2 wrote before the ratio was measured
    del body["split_backward_ratio"], body["deferred_bytes"], body["size_times"], body["library_bytes"]
    del body["batch_coupling"], body["frozen_param_bytes"], body["forward_workspace_bytes"]
    del body["optimizer_step_per_call_ms"], body["input_workspace_bytes"], body["largest_param_bytes"]
    del body["input_saved_bytes"], body["freed_by_b_bytes"], body["weight_workspace_bytes"]
    for shared in body["shared_params"]:
        del shared["frozen"]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 2, "planner_version": "0.1.0", **body}))
    profile = load_profile(path)
    assert profile == _measured() and profile.split_backward_ratio is None and profile.size_times == ()
    assert profile.to_dict() == body and profile.batch_sizes == (8,)


def test_frozen_parameters_and_forward_workspace_round_trip_and_are_left_out_where_there_are_none(
        tmp_path: Path) -> None:
    layers = _profile().num_layers
    held = dataclasses.replace(_profile(), frozen_param_bytes=(0,) + (3,) * (layers - 1),
                               forward_workspace_bytes=(5,) * layers,
                               shared_params=(SharedParam(names=("a", "b"), nbytes=3, layers=(1, 2), frozen=True),))
    path = held.save(tmp_path / "frozen.json")
    assert load_profile(path) == held and json.loads(path.read_text())["shared_params"][0]["frozen"] is True
    assert held.trainable_param_bytes == held.total_param_bytes - 3 * (layers - 1)
    plain = _profile().to_dict()
    assert "frozen_param_bytes" not in plain and "forward_workspace_bytes" not in plain
    assert all("frozen" not in shared for shared in plain["shared_params"])  # the digest of before
    with pytest.raises(ValueError, match="frozen_param_bytes"):
        dataclasses.replace(_profile(), frozen_param_bytes=(1,) * (layers + 1))


def test_library_bytes_are_kept_and_a_file_without_them_has_none(tmp_path: Path) -> None:
    """A GPU profile's library bytes survive the file and name another profile to the plans made of it; a CPU
    profile's 0 is left out of it (same digest as before they were measured); a negative count is refused with
    the file's name."""
    held = dataclasses.replace(_measured(), library_bytes=64 << 20)
    assert load_profile(held.save(tmp_path / "gpu.json")).library_bytes == 64 << 20
    assert profile_digest(held) != profile_digest(_measured())
    assert "library_bytes" not in _measured().to_dict()
    body = {"format": PROFILE_FORMAT, "version": 3, "planner_version": "0.1.0", **held.to_dict(),
            "library_bytes": -1}
    (tmp_path / "bad.json").write_text(json.dumps(body))
    with pytest.raises(PlannerError, match=r"bad\.json.*library_bytes -1 is negative"):
        load_profile(tmp_path / "bad.json")


def test_batch_coupling_round_trips_and_a_file_without_it_has_none(tmp_path: Path) -> None:
    """What couples a batch's samples survives the file; a profile that did not check it keeps the body of before,
    and the digest leaves it out (plans take notes from it, not times); a malformed entry is refused with the file's
    name."""
    coupled = dataclasses.replace(_measured(), batch_coupling=BatchCoupling(("bn1", "layer1.bn2"), "the loss differs",
                                                                            "the forward draws random numbers"))
    assert load_profile(coupled.save(tmp_path / "coupled.json")) == coupled
    checked = dataclasses.replace(_measured(), batch_coupling=BatchCoupling())
    assert load_profile(checked.save(tmp_path / "checked.json")).batch_coupling == BatchCoupling()
    assert "batch_coupling" not in _measured().to_dict() and _measured().batch_coupling is None
    assert profile_digest(coupled) == profile_digest(_measured())
    body = {"format": PROFILE_FORMAT, "version": 3, "planner_version": "0.1.0", **_measured().to_dict(),
            "batch_coupling": {"batch_norm": "bn1"}}
    (tmp_path / "bad.json").write_text(json.dumps(body))
    with pytest.raises(PlannerError, match=r"bad\.json.*batch_coupling must be"):
        load_profile(tmp_path / "bad.json")


def test_the_table_says_what_couples_a_batch() -> None:
    coupled = dataclasses.replace(_measured(), batch_coupling=BatchCoupling(("bn1",), None))
    assert ("note: batch norm (1 module: bn1) normalises each microbatch with that microbatch's statistics"
            in " ".join(profile_summary(coupled).split()))
    assert "note:" not in profile_summary(dataclasses.replace(_measured(), batch_coupling=BatchCoupling()))


def _sized() -> Profile:
    """`_measured()` with the layers' times at batch sizes 2 (input gradients measured) and 4 (not)."""
    return dataclasses.replace(_measured(), size_times=(
        SizeTimes(batch_size=2, fwd_ms=(0.05, 0.0625, 0.1), bwd_ms=(0.125, 0.25, 1 / 7), bwd_input_ms=(0.0, 0.1, 0.1),
                  step_ms=0.75),
        SizeTimes(batch_size=4, fwd_ms=(0.075, 0.125, 0.2), bwd_ms=(0.25, 0.5, 2 / 7)),
    ))


def test_times_at_more_batch_sizes_round_trip_and_are_left_out_where_not_measured(tmp_path: Path) -> None:
    profile = _sized()
    path = profile.save(tmp_path / "sized.json")
    assert load_profile(path) == profile and profile.batch_sizes == (2, 4, 8)
    document = json.loads(path.read_text())
    assert document["version"] == 3 and [row["batch_size"] for row in document["size_times"]] == [2, 4]
    assert document["size_times"][0]["bwd_input_ms"] == [0.0, 0.1, 0.1] and "bwd_input_ms" not in document["size_times"][1]
    assert "size_times" not in _measured().to_dict()  # one size: the body, and the digest, of before
    assert profile_digest(dataclasses.replace(profile, size_times=())) == profile_digest(_measured())


@pytest.mark.parametrize(("size_times", "fragment"), [
    ([{"batch_size": 2, "fwd_ms": [1.0, 2.0], "bwd_ms": [1.0, 2.0, 3.0]}], "size_times[0] has 2 fwd_ms for 3 layers"),
    ([{"batch_size": 2, "fwd_ms": [1.0] * 3, "bwd_ms": [1.0] * 3, "bwd_input_ms": [0.5]}],
     "size_times[0] has 1 bwd_input_ms for 3 layers"),
    ([{"batch_size": 8, "fwd_ms": [1.0] * 3, "bwd_ms": [1.0] * 3}], "size_times[0].batch_size 8 is measured twice"),
    ([{"batch_size": 2, "fwd_ms": [1.0] * 3, "bwd_ms": [1.0] * 3}] * 2, "size_times[1].batch_size 2 is measured twice"),
    ([{"batch_size": 0, "fwd_ms": [1.0] * 3, "bwd_ms": [1.0] * 3}], "size_times[0].batch_size 0 is below 1"),
    ([{"batch_size": 2, "fwd_ms": [1.0] * 3}], "size_times[0] is missing the field 'bwd_ms'"),
    (["2"], "size_times[0] is malformed"),
    ([{"batch_size": 2, "fwd_ms": ["fast"] * 3, "bwd_ms": [1.0] * 3}], "size_times[0] is malformed"),
])
def test_malformed_times_at_more_batch_sizes_are_refused_naming_the_entry(
    tmp_path: Path, size_times: list[object], fragment: str,
) -> None:
    with pytest.raises(FileFormatError, match=re.escape(fragment)):
        load_profile(_rewrite(tmp_path, size_times=size_times))


def test_dataframe_has_the_layer_columns_in_execution_order() -> None:
    frame = _measured().to_dataframe()
    assert list(frame.columns) == list(LAYER_COLUMNS) and "bwd_input_ms" in LAYER_COLUMNS
    assert list(frame["name"]) == ["h.0", "h.1", "h.2"]
    assert frame["param_bytes"].tolist() == [0, 4096, 8192]
    assert frame["bwd_input_ms"].tolist() == [0.0, 0.125, 0.25]


def _measured() -> Profile:
    """`_profile()` with each layer's input-gradient time measured."""
    profile = _profile()
    layers = tuple(dataclasses.replace(layer, bwd_input_ms=share * layer.bwd_ms)
                   for layer, share in zip(profile.layers, (0.0, 0.375, 0.75)))
    return dataclasses.replace(profile, layers=layers)


def test_input_gradient_times_round_trip_and_give_the_weights_part(tmp_path: Path) -> None:
    profile = _measured()
    assert load_profile(profile.save(tmp_path / "m.json")) == profile
    layer = profile.layers[2]
    assert layer.bwd_input_ms == pytest.approx(0.25) and layer.bwd_weight_ms == pytest.approx(1 / 3 - 0.25)
    assert profile.total_bwd_input_ms == pytest.approx(0.375)
    assert _profile().layers[0].bwd_weight_ms is None and _profile().total_bwd_input_ms is None
    assert profile_digest(profile) != profile_digest(_profile())


def test_a_version_1_file_loads_without_input_gradient_times(tmp_path: Path) -> None:
    body = dataclasses.asdict(_profile())  # what version 1 wrote: layers without bwd_input_ms
    for row in body["layers"]:
        del row["bwd_input_ms"]
    del body["split_backward_ratio"], body["size_times"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "planner_version": "0.1.0", **body}))
    profile = load_profile(path)
    assert profile == _profile() and all(layer.bwd_input_ms is None for layer in profile.layers)
    assert profile.split_backward_ratio is None
    # saved again as the current version, its layers stay as they were: plans made with it keep their digest
    document = json.loads(profile.save(tmp_path / "again.json").read_text())
    assert document["version"] == PROFILE_VERSION and document["layers"] == list(body["layers"])


@pytest.mark.parametrize("path", sorted(PROFILES_V1.glob("*.json")), ids=lambda path: path.name)
def test_the_first_shipped_profiles_still_load(path: Path) -> None:
    profile = load_profile(path)
    assert json.loads(path.read_text())["version"] == 1
    assert profile.num_layers > 0 and all(layer.bwd_input_ms is None for layer in profile.layers)
    assert profile.split_backward_ratio is None and profile.size_times == ()


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[3] / "profiles").glob("*.json")),
                         ids=lambda path: path.name)
def test_the_shipped_profiles_measure_what_the_planner_uses(path: Path, tmp_path: Path) -> None:
    """The split backward (zero-bubble schedules), what it keeps, and several batch sizes (the microbatch size), in
    the profile as committed: `./dev.sh demo` replaces profiles/gpt.json with this machine's (the README says so)."""
    committed = subprocess.run(["git", "show", f"HEAD:profiles/{path.name}"], cwd=path.parent, capture_output=True,
                               text=True)
    if committed.returncode == 0:  # (a checkout without git history: the file as it is)
        path = tmp_path / path.name
        path.write_text(committed.stdout)
    profile = load_profile(path)
    assert json.loads(path.read_text())["version"] == PROFILE_VERSION
    assert all(layer.bwd_input_ms is not None for layer in profile.layers)
    assert profile.split_backward_ratio is not None and profile.deferred_bytes
    assert [times.batch_size for times in profile.size_times] == [1, 2, 4] and profile.batch_size == 8


def test_tables_show_the_input_gradient_share_only_where_measured() -> None:
    columns = [column.header for column in profile_table(_measured()).columns]
    assert columns[columns.index("bwd ms") + 1] == "in-grad"
    assert "in-grad" not in [column.header for column in profile_table(_profile()).columns]
    assert "bwd_input_ms" in _measured()._repr_html_() and "bwd_input_ms" not in _profile()._repr_html_()


def _rewrite(tmp_path: Path, **changes: object) -> Path:
    path = _profile().save(tmp_path / "p.json")
    document = json.loads(path.read_text())
    document.update(changes)
    path.write_text(json.dumps(document))
    return path


def test_another_format_is_refused_with_what_was_found(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, format="pipeline-planner/plan")
    with pytest.raises(FileFormatError, match=r"p\.json: format is 'pipeline-planner/plan', expected"):
        load_profile(path)


def test_a_pipedream_graph_passed_as_a_profile_names_the_command_that_converts_it(tmp_path: Path) -> None:
    graph = tmp_path / "graph.txt"
    graph.write_text("node1 -- Conv2d(3, 8, kernel_size=(3, 3)) -- forward_compute_time=1.0, "
                     "backward_compute_time=2.0, activation_size=100.0, parameter_size=20.0\n")
    with pytest.raises(FileFormatError, match=r"graph\.txt: a PipeDream profile \(graph\.txt\), not a planner profile; "
                                              r"convert it first: planner import-pipedream .*graph\.txt --out"):
        load_profile(graph)
    other = tmp_path / "notes.txt"
    other.write_text("node1 is where it starts\n")
    with pytest.raises(FileFormatError, match="not valid JSON"):
        load_profile(other)


def test_a_newer_version_is_refused_with_what_is_supported(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, version=7)
    with pytest.raises(FileFormatError, match=r"version 7 is newer than this planner supports \(1\.\.3\)"):
        load_profile(path)


def test_a_missing_field_names_it(tmp_path: Path) -> None:
    path = _profile().save(tmp_path / "p.json")
    document = json.loads(path.read_text())
    del document["layers"][1]["cut_bytes"]
    path.write_text(json.dumps(document))
    with pytest.raises(FileFormatError, match="cut_bytes"):
        load_profile(path)


def test_saving_over_a_file_replaces_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("old content")
    _profile().save(path)
    assert load_profile(path) == _profile()
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left behind


def test_a_new_file_is_readable_by_others(tmp_path: Path) -> None:
    path = _profile().save(tmp_path / "p.json")
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("shared, frozen, fragment", [
    (SharedParam(("a", "b"), 8192, (1, 2)), (), "count 8192 trainable bytes first used by layer 1 (h.1), which "
                                                "holds 4096"),
    (SharedParam(("a", "b"), 4096, (1, 2), frozen=True), (0, 1024, 0), "count 4096 frozen bytes first used by "
                                                                       "layer 1 (h.1), which holds 1024"),
    (SharedParam(("a", "b"), 4096, (2, 1)), (), "shared_params[0].layers [2, 1] are not ascending"),
    (SharedParam(("a", "b"), 4096, (1, 3)), (), "shared_params[0].layers [1, 3] are not ascending, distinct layer "
                                                "indices in 0..2"),
    (SharedParam(("a", "b"), -1, (1, 2)), (), "shared_params[0].nbytes -1 is negative"),
    (SharedParam(("a", "b"), 1, (1, 2)), (0, 4097, 0), "frozen_param_bytes[1] 4097 is not within layer 1's "
                                                       "param_bytes (4096)"),
])
def test_shared_parameters_that_do_not_fit_their_first_layer_are_refused_with_the_file(
        tmp_path: Path, shared: SharedParam, frozen: tuple[int, ...], fragment: str) -> None:
    """A shared parameter is counted once, in its first layer's parameter bytes: a file whose shared parameters
    outweigh that layer's bytes (the planner would count negative bytes elsewhere) or name no layers in order is
    refused with its name and what is wrong."""
    body = {"format": PROFILE_FORMAT, "version": 3, "planner_version": "0.1.0", **_profile().to_dict(),
            "shared_params": [dataclasses.asdict(shared)], "frozen_param_bytes": list(frozen)}
    (tmp_path / "bad.json").write_text(json.dumps(body))
    with pytest.raises(FileFormatError, match=r"bad\.json: .*" + re.escape(fragment)):
        load_profile(tmp_path / "bad.json")
