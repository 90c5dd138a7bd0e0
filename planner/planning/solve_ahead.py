"""Memory-limited `optimize` calls solved ahead of need, in child processes, while the search goes on.

Where a memory limit binds, one `optimize` call (a schedule at one microbatch count) takes seconds on
deep profiles (PipeDream's densenet121 on 16 GPUs at 8 GB: 1.0-7.5 s each, ten of them) and
`partition` makes them one after another. `SolvesAhead` hands them, in the order given, to at most
`workers` child processes at a time (`python -m planner.planning.solve_ahead`: the task pickled on its
stdin, the plan on its stdout); `result(key)` waits for one, or gives back one that no child has begun
(the caller solves it itself, rather than wait for a child to come to it). The answers are `optimize`'s own (the same
pure function on the same inputs), so the plan is the one the search makes in one process; only the
wall time changes. Children are started afresh, not forked and not with multiprocessing's spawn: the
caller may hold threads (torch's, a notebook's) and its main module may be a script without a
`__name__ == "__main__"` guard. `close()` ends them, unfinished solves and all.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Hashable

from planner.costs.schedule_cost import CostInputs
from planner.errors import InfeasiblePlanError
from planner.planning.optimizer import Solution, optimize

__all__ = ["SolvesAhead"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding `planner`, for the children


def _solve(inputs: CostInputs, straight: bool, recompute: bool) -> Solution | None:
    """`optimize`'s plan; None where no plan fits (the error's smallest memory is a search of its own: the caller
    solves that case again where it needs the error)."""
    try:
        return optimize(inputs, straight, recompute)
    except InfeasiblePlanError:
        return None


class SolvesAhead:
    """`optimize(inputs, straight, recompute)` per key in child processes, `workers` at a time, in the order
    submitted."""

    def __init__(self, workers: int) -> None:
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="solve-ahead")
        self._pending: dict[Hashable, Future] = {}
        self._children: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, key: Hashable, inputs: CostInputs, straight: bool, recompute: bool) -> None:
        """Queue the solve of `key` (a key already queued stays as it was)."""
        if key not in self._pending:
            self._pending[key] = self._threads.submit(self._in_child, pickle.dumps((inputs, straight, recompute)))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pending

    def result(self, key: Hashable) -> Solution | None:
        """The plan of a submitted `key` once solved; None where no plan fits, the child failed, or no child has
        started on it yet (taken back from the queue): the caller solves it itself then (and meets the same error,
        or none)."""
        future = self._pending[key]
        return None if future.cancel() else future.result()

    def forget(self, key: Hashable) -> None:
        """Take `key` back from the queue where no child has begun it (one already begun runs on, unread)."""
        future = self._pending.pop(key, None)
        if future is not None:
            future.cancel()

    def close(self) -> None:
        """End the children, with any solve still queued or running."""
        with self._lock:
            self._closed = True
            for child in self._children:
                child.kill()
        self._threads.shutdown(wait=True, cancel_futures=True)

    def _in_child(self, task: bytes) -> Solution | None:
        """The child's answer; None if it could not start, failed or was killed (the caller solves it then).

        It runs in `_PACKAGE_ROOT` with that first on its path, so that it imports the caller's `planner`, not
        one in the caller's working directory (`python -m` puts that first). A frozen application's
        interpreter is the application itself: no children there."""
        if getattr(sys, "frozen", False) or not sys.executable:
            return None
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [_PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        with self._lock:
            if self._closed:
                return None
            try:
                child = subprocess.Popen([sys.executable, "-m", "planner.planning.solve_ahead"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=environment,
                                         cwd=_PACKAGE_ROOT)
            except (OSError, ValueError):  # (no more processes or files here)
                return None
            self._children.add(child)
        try:
            answer, _ = child.communicate(task)
        finally:
            with self._lock:
                self._children.discard(child)
        try:
            found = pickle.loads(answer) if child.returncode == 0 else None
        except Exception:  # not what a child writes (something else printed to its stdout): solved by the caller
            return None
        return found if isinstance(found, Solution) else None


if __name__ == "__main__":  # a child: one task from stdin, its plan to stdout
    pickle.dump(_solve(*pickle.load(sys.stdin.buffer)), sys.stdout.buffer)
