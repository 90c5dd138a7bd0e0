"""Tests of planner/planning/solve_ahead.py: solves in child processes are optimize's own, and partition's plan
does not change when its memory-limited solves run ahead."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import planner.planning.partition as partition_module
from planner.costs.layer_arrays import LayerArrays
from planner.costs.schedule_cost import CostInputs
from planner.files.cluster import make_cluster
from planner.files.profile import load_profile
from planner.planning.optimizer import optimize
from planner.planning.partition import partition
import planner.planning.solve_ahead as solve_ahead_module
from planner.planning.solve_ahead import SolvesAhead

REPO = Path(__file__).resolve().parents[3]
GPT = REPO / "profiles" / "gpt.json"


def gpt_inputs(schedule: str, microbatches: int, memory_bytes: float | None) -> CostInputs:
    profile = load_profile(GPT)
    arrays = LayerArrays.from_profile(profile).for_schedule(schedule)
    return CostInputs(arrays, make_cluster(4), schedule, microbatches, 1.0, float(profile.input_bytes),
                      memory_bytes=memory_bytes)


def test_a_child_gives_optimizes_own_plan_and_none_where_no_plan_fits() -> None:
    fits, tight = gpt_inputs("1f1b", 4, 1e9), gpt_inputs("gpipe", 8, 1e6)
    solves = SolvesAhead(2)
    try:
        solves.submit("fits", fits, False, True)
        solves.submit("tight", tight, False, True)
        while not all(future.running() or future.done() for future in solves._pending.values()):
            time.sleep(0.01)  # both begun: neither is taken back from the queue
        assert "fits" in solves and "other" not in solves
        assert solves.result("fits") == optimize(fits, False, True)
        assert solves.result("tight") is None  # 1 MB fits nothing: the caller meets the error itself
    finally:
        solves.close()


def test_a_solve_no_child_has_begun_is_given_back_and_close_ends_the_rest() -> None:
    slow = gpt_inputs("1f1b", 4, 1e9)
    solves = SolvesAhead(1)
    solves.submit("first", slow, False, True)
    solves.submit("second", replace(slow, microbatches=8), False, True)
    assert solves.result("second") is None  # queued behind the first: the caller solves it
    solves.submit("third", replace(slow, microbatches=2), False, True)
    solves.forget("third")  # not needed after all: never begun
    assert "third" not in solves
    started = time.monotonic()
    solves.close()  # the first's child, if still running, is killed
    assert time.monotonic() - started < 30
    assert not solves._children


def answers_from_children(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each `SolvesAhead.result` partition takes, from now on, was a child's plan (False: None, left to the
    caller); each waits until a child has begun its key (these solves are quick: none is given back unbegun)."""
    taken: list[bool] = []
    result = SolvesAhead.result

    def counted(self: SolvesAhead, key: object) -> object:
        while not (self._pending[key].running() or self._pending[key].done()):
            time.sleep(0.01)
        found = result(self, key)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(partition_module, "SOLVE_AHEAD_AFTER_S", 0.0)  # every memory-limited search solves ahead
    monkeypatch.setattr(SolvesAhead, "result", counted)
    return taken


def test_partition_makes_the_same_plan_with_its_solves_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    gpt = load_profile(GPT)
    cluster = make_cluster(4, memory="1GB")
    alone = partition(gpt, cluster, workers=1)
    taken = answers_from_children(monkeypatch)
    assert partition(gpt, cluster, workers=2) == alone
    assert any(taken), taken  # solves came from children (None: no plan fits there, solved here for the error)


def test_a_script_without_a_main_guard_plans_with_solves_ahead(tmp_path: Path) -> None:
    """Children are started afresh, not with multiprocessing's spawn, which would import the script again."""
    script = tmp_path / "plan.py"
    script.write_text(
        "import planner.planning.partition as partition_module\n"
        "from planner.files.cluster import make_cluster\n"
        "from planner.files.profile import load_profile\n"
        "partition_module.SOLVE_AHEAD_AFTER_S = 0.0\n"
        f"plan = partition_module.partition(load_profile({str(GPT)!r}), make_cluster(4, memory='1GB'), workers=2)\n"
        "print('planned', plan.schedule)\n")
    finished = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.count("planned") == 1, finished.stdout


def test_children_that_fail_leave_the_solves_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    gpt = load_profile(GPT)
    cluster = make_cluster(4, memory="1GB")
    alone = partition(gpt, cluster, workers=1)
    solves = SolvesAhead(1)
    monkeypatch.setattr(solve_ahead_module.sys, "executable", "/bin/false")  # every child exits 1 at once
    try:
        solves.submit("fails", gpt_inputs("1f1b", 4, 1e9), False, True)
        while not solves._pending["fails"].done():
            time.sleep(0.01)
        assert solves.result("fails") is None
    finally:
        solves.close()
    taken = answers_from_children(monkeypatch)
    assert partition(gpt, cluster, workers=2) == alone
    assert taken and not any(taken), taken  # every solve went to a child that failed, then to the caller


def test_children_import_the_callers_planner_not_one_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` puts the working directory first on a child's path: a checkout of another version there would
    otherwise answer."""
    shadow = tmp_path / "planner" / "planning"
    shadow.mkdir(parents=True)
    for package in (tmp_path / "planner", shadow):
        (package / "__init__.py").write_text("")
    (shadow / "solve_ahead.py").write_text("import pickle, sys\npickle.dump('SHADOW', sys.stdout.buffer)\n")
    monkeypatch.chdir(tmp_path)
    inputs = gpt_inputs("1f1b", 4, 1e9)
    solves = SolvesAhead(1)
    try:
        solves.submit("here", inputs, False, True)
        while not solves._pending["here"].done():
            time.sleep(0.01)
        assert solves.result("here") == optimize(inputs, False, True)
    finally:
        solves.close()
