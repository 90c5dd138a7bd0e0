"""The suite's machine lock: an exclusive hold waits for shared ones and keeps new ones out until it ends."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.machine_lock import MachineLock


def test_a_shared_hold_waits_for_an_exclusive_one(tmp_path: Path) -> None:
    timer, worker = MachineLock(tmp_path / "run"), MachineLock(tmp_path / "run")  # two processes' views
    events: list[str] = []

    def test_of_the_other_worker() -> None:
        with worker.shared():
            events.append("shared")

    with timer.exclusive():
        other = threading.Thread(target=test_of_the_other_worker)
        other.start()
        time.sleep(0.3)  # the other hold has had time to be taken, were it not kept out
        events.append("exclusive ends")
    other.join(timeout=10)
    assert events == ["exclusive ends", "shared"]


def test_an_exclusive_hold_waits_for_a_shared_one_and_closes_the_gate(tmp_path: Path) -> None:
    first, timer, late = (MachineLock(tmp_path / "run") for _ in range(3))
    events: list[str] = []

    def timing() -> None:
        with timer.exclusive():
            events.append("exclusive")

    def late_test() -> None:
        with late.shared():
            events.append("late shared")

    with first.shared():
        holder = threading.Thread(target=timing)
        holder.start()
        time.sleep(0.3)  # the exclusive hold now waits for this one, with the gate closed
        newcomer = threading.Thread(target=late_test)
        newcomer.start()
        time.sleep(0.3)
        events.append("first shared ends")
    holder.join(timeout=10)
    newcomer.join(timeout=10)
    assert events == ["first shared ends", "exclusive", "late shared"]


def test_holds_nest_in_one_process_and_no_stem_locks_nothing(tmp_path: Path) -> None:
    lock = MachineLock(tmp_path / "run")
    with lock.exclusive(), lock.shared(), lock.exclusive():  # a test inside the timing fixture's hold
        assert lock.exclusive_depth == 2
    assert lock.exclusive_depth == 0
    with MachineLock(None).exclusive(), MachineLock(None).shared():  # no xdist: nothing to wait for
        pass


def test_a_run_s_lock_files_are_in_the_temporary_folder_until_removed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`of_run` names the files by the xdist run; a hold creates them, `remove` (xdist's controller, at its end)
    deletes them, and removing twice or without a stem does nothing."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    lock = MachineLock.of_run("abc")
    with lock.shared():
        pass
    assert sorted(path.name for path in tmp_path.iterdir()) == ["planner-tests-abc.gate", "planner-tests-abc.lock"]
    lock.remove()
    lock.remove()
    MachineLock(None).remove()
    assert list(tmp_path.iterdir()) == []
