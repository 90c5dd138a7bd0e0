"""A lock the suite's worker processes share, so that a timing measurement can have the machine to itself.

Under `pytest -n 2` the other worker's torchrun jobs (two or three processes) share the two cores with
a profile being timed: its steps then run 3-5x slower than alone and its paired plain and instrumented
steps read 0.55-1.8x each other, so a median of 30 pairs moves by several percent from run to run. Every
test holds the lock shared from its fixtures' setup to their teardown (conftest's `pytest_runtest_protocol`);
a fixture that times something holds it exclusively while it does: it waits for the other worker's running
test to end, and that worker's next test waits for it.

Two files make a writer-first lock from `flock` (which alone lets a stream of shared holders starve an
exclusive one): a holder takes the gate, shared to pass it or exclusive to close it, then the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


OWNER_VARIABLE = "PLANNER_TEST_LOCK_OWNER"  # the pid of the worker that holds the lock, for its children to see


class MachineLock:
    """Shared and exclusive holds of the lock files `<stem>.gate` and `<stem>.lock` (no files: no locking)."""

    def __init__(self, stem: Path | None) -> None:
        self.stem = stem
        self.exclusive_depth = 0  # an exclusive hold of this process: its shared holds are no-ops meanwhile

    @classmethod
    def for_this_run(cls) -> "MachineLock":
        """The lock of this pytest-xdist run (its workers share PYTEST_XDIST_TESTRUNUID); none without xdist,
        and none in a process a test started (it inherits the variables; its shared hold, waiting behind an
        exclusive one that waits for the test, would never end)."""
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # not in xdist's controller, whose workers inherit OWNER
        if run is None or os.environ.setdefault(OWNER_VARIABLE, str(os.getpid())) != str(os.getpid()):
            return cls(None)
        return cls.of_run(run)

    @classmethod
    def of_run(cls, run: str) -> "MachineLock":
        """The lock of the xdist run `run` (its PYTEST_XDIST_TESTRUNUID), in the temporary folder."""
        return cls(Path(tempfile.gettempdir()) / f"planner-tests-{run}")

    def remove(self) -> None:
        """Delete the lock files (once no process of the run can hold them: xdist's controller at its end)."""
        if self.stem is not None:
            for suffix in (".gate", ".lock"):
                self.stem.with_suffix(suffix).unlink(missing_ok=True)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock shared: waits while a process holds it exclusively or waits to."""
        if self.stem is None or self.exclusive_depth:
            yield
            return
        with self._held(".gate", fcntl.LOCK_SH):
            pass
        with self._held(".lock", fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock alone: closes the gate to new shared holders, then waits for the present ones."""
        with contextlib.ExitStack() as holds:
            if self.stem is not None and not self.exclusive_depth:
                holds.enter_context(self._held(".gate", fcntl.LOCK_EX))
                holds.enter_context(self._held(".lock", fcntl.LOCK_EX))
            self.exclusive_depth += 1
            try:
                yield
            finally:
                self.exclusive_depth -= 1

    @contextlib.contextmanager
    def _held(self, suffix: str, operation: int) -> Iterator[IO[str]]:
        assert self.stem is not None
        with open(self.stem.with_suffix(suffix), "a+") as handle:
            fcntl.flock(handle, operation)
            try:
                yield handle
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
