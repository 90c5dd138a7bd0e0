"""Typed errors of the planner: each carries the offending values and reads as one line."""

from __future__ import annotations

import math
from typing import Callable


class PlannerError(Exception):
    """Base of every error the planner reports to a user as one line (no traceback)."""


class FileProblemError(PlannerError):
    """Something is wrong with one file: names the file, the problem and, if known, the fix."""

    def __init__(self, path: str, problem: str, fix: str = "") -> None:
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        message = f"{self.path}: {problem}"
        if fix:
            message += f"; {fix}"
        super().__init__(message)


class ModelFileError(FileProblemError):
    """The user's model file is missing, malformed, or breaks the model-file contract."""


class FileFormatError(FileProblemError):
    """A planner file (profile, plan, PipeDream graph) is unreadable, of another format or too new."""


class ProfileError(PlannerError):
    """Profiling could not be done as asked (bad option value, unknown split point, ...)."""


class DeviceError(PlannerError):
    """The requested device does not exist on this machine."""

    def __init__(self, device: str, problem: str) -> None:
        self.device = device
        self.problem = problem
        super().__init__(f"device {device!r}: {problem}")


# what else lowers every stage's memory: fewer samples per microbatch, or (under gpipe) fewer in flight
SMALLER_BATCH = "a smaller --microbatch-size or --global-batch-size"


class InfeasiblePlanError(PlannerError):
    """No plan fits the device memory; names the smallest memory per device that would work.

    `smallest_memory_bytes` may be given as a function, called when the value (or the message) is first
    read: finding it takes a search of its own (1.5 s for inception_v3 on 4 GPUs), which a caller that
    tries other settings after this failure (`--microbatches auto`) need not pay. With `detail` (why no plan
    fits, beyond the search's own limit) it is a memory at which some plan found fits, not proven the least."""

    def __init__(self, memory_bytes: float, smallest_memory_bytes: float | Callable[[], float],
                 detail: str = "", smallest_below: Callable[[float], float] | None = None) -> None:
        self.memory_bytes = memory_bytes
        self._smallest: float | Callable[[], float] = smallest_memory_bytes
        self._smallest_below = smallest_below
        self.detail = detail
        super().__init__(f"no plan fits in {memory_bytes / 1e9:.4g} GB per device")

    @property
    def smallest_memory_bytes(self) -> float:
        """The least memory per device at which some plan fits, bytes (with `detail`: one where a plan found fits)."""
        if callable(self._smallest):
            self._smallest = float(self._smallest())
        return self._smallest

    def smallest_memory_below(self, bound: float) -> float:
        """`smallest_memory_bytes` where it is less than `bound` bytes, else inf. With `smallest_below` (the
        search that first asks whether any plan fits in the whole MB below `bound`: one solve where none does)
        a failure that needs `bound` or more is told apart without its own bisection, as `partition` does
        to name the least of the failures of every schedule and microbatch count it tried."""
        if callable(self._smallest) and self._smallest_below is not None:
            found = float(self._smallest_below(bound))
            if math.isinf(found):
                return math.inf
            self._smallest = found
        return self.smallest_memory_bytes if self.smallest_memory_bytes < bound else math.inf

    def __str__(self) -> str:
        enough_gb = math.ceil(self.smallest_memory_bytes / 1e6) / 1e3  # in GB, rounded up to the MB: it does fit
        if self.detail:
            return (f"no plan fits in {self.memory_bytes / 1e9:.4g} GB per device {self.detail}; pass a larger "
                    f"--memory (that plan fits in {enough_gb:g} GB), use more GPUs, {SMALLER_BATCH}, or an optimizer "
                    "with less state")
        return (f"no plan fits in {self.memory_bytes / 1e9:.4g} GB per device; the smallest memory that admits a "
                f"plan is {enough_gb:g} GB (pass --memory {enough_gb:g}GB or more, use more GPUs, {SMALLER_BATCH}, "
                "or an optimizer with less state)")
