"""A stage's own random stream, swapped into its device's default generator around its forwards.

Stages that share a device (in-process pipelines) would otherwise draw from one generator in
whatever order their threads run. A `RandomStream` is seeded per step; `run` swaps it in under
a per-device lock, so each stage's draws depend only on its seed, and a checkpointed forward
can replay the stream state it started from when it is recomputed (same dropout masks).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

__all__ = ["RandomStream"]

_LOCKS: dict[int, threading.Lock] = {}  # by id of the generator ("cpu" and "cpu:0" share one)
_LOCKS_GUARD = threading.Lock()


def _generator(device: torch.device) -> torch.Generator | None:
    """The default generator random ops on `device` draw from (None for device types not handled)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        return torch.cuda.default_generators[index]
    return None


def _lock(generator: torch.Generator | None) -> threading.Lock:
    """The process-wide lock of a default generator (a lock of its own for None)."""
    if generator is None:
        return threading.Lock()
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(id(generator), threading.Lock())


class RandomStream:
    """A random stream of its own for one stage on `device` (no-op for device types without a generator)."""

    def __init__(self, device: torch.device) -> None:
        self.generator = _generator(device)
        self.lock = _lock(self.generator)
        # until the first reseed, the stream continues from the generator's state of now
        self.state: torch.Tensor | None = None if self.generator is None else self.generator.get_state()

    def reseed(self, seed: int) -> None:
        """Start the stream afresh from `seed` (leaves the default generator as it was)."""
        if self.generator is None:
            return
        with self.lock:
            saved = self.generator.get_state()
            self.generator.manual_seed(seed)
            self.state = self.generator.get_state()
            self.generator.set_state(saved)

    def run(self, function: Callable[[], Any], replay: torch.Tensor | None = None) -> tuple[Any, Any]:
        """(function(), the stream state it started from), drawing from the stream, or replaying `replay`."""
        if self.generator is None:
            return function(), None
        with self.lock:
            saved = self.generator.get_state()
            start = self.state if replay is None else replay
            self.generator.set_state(start)
            try:
                result = function()
                if replay is None:
                    self.state = self.generator.get_state()
            finally:
                self.generator.set_state(saved)
        return result, start
