"""The profile file: exact round trip, table columns, and refusal of other formats and versions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner.errors import FileFormatError
from planner.files.plan import profile_digest
from planner.files.profile import (
    LAYER_COLUMNS,
    PROFILE_FORMAT,
    LayerProfile,
    Profile,
    SharedParam,
    load_profile,
)


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
        input_bytes=256, shared_params=(SharedParam(names=("a.weight", "b.weight"), nbytes=4096, layers=(0, 2)),),
        settings={"warmup": 1, "iters": 2, "depth": None, "split_points": []},
    )


def test_save_and_load_round_trip_exactly(tmp_path: Path) -> None:
    profile = _profile()
    path = profile.save(tmp_path / "sub" / "toy.json")
    assert load_profile(path) == profile
    document = json.loads(path.read_text())
    assert document["format"] == PROFILE_FORMAT and document["version"] == 1 and "planner_version" in document


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


def test_dataframe_has_the_layer_columns_in_execution_order() -> None:
    frame = _profile().to_dataframe()
    assert list(frame.columns) == list(LAYER_COLUMNS)
    assert list(frame["name"]) == ["h.0", "h.1", "h.2"]
    assert frame["param_bytes"].tolist() == [0, 4096, 8192]


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


def test_a_newer_version_is_refused_with_what_is_supported(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, version=7)
    with pytest.raises(FileFormatError, match=r"version 7 is newer than this planner supports \(1\.\.1\)"):
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
