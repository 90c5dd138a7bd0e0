"""read_versioned_json: a file of the wrong kind is refused with what to run first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.errors import FileFormatError
from planner.files.fileformat import read_versioned_json
from planner.files.plan import PLAN_FORMAT
from planner.files.profile import PROFILE_FORMAT


def refusal(path: Path, expected: str) -> str:
    with pytest.raises(FileFormatError) as caught:
        read_versioned_json(path, expected, 1)
    return str(caught.value)


def test_a_model_file_where_a_profile_or_plan_is_expected_says_to_profile_it(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text("def build_model(): ...\n")
    found = refusal(model, PROFILE_FORMAT)
    assert f"a Python file, not a {PROFILE_FORMAT} file" in found and f"`planner profile {model}`" in found
    found = refusal(model, PLAN_FORMAT)
    assert f"`planner profile {model}`" in found and "`planner partition PROFILE --gpus N`" in found


@pytest.mark.parametrize("found_format, expected, hint", [
    (PROFILE_FORMAT, PLAN_FORMAT, "this is a profile: make a plan of it first (`planner partition {path} --gpus N`)"),
    (PLAN_FORMAT, PROFILE_FORMAT, "this is a plan: pass the profile it was made from"),
    ("pipeline-planner/run-report", PLAN_FORMAT, "pass a file of the expected kind"),
    (["a", "list"], PLAN_FORMAT, "pass a file of the expected kind"),  # any JSON value, named as it is
])
def test_a_file_of_another_kind_names_both_kinds_and_the_next_step(tmp_path: Path, found_format: object, expected: str,
                                                                   hint: str) -> None:
    path = tmp_path / "file.json"
    path.write_text(json.dumps({"format": found_format, "version": 1}))
    found = refusal(path, expected)
    assert f"format is {found_format!r}, expected {expected!r}" in found
    assert hint.format(path=path) in found
