"""The optimizer step's timing: each step timed right after a backward into cleared gradients, as training steps."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from planner.profiling.optimizer_step import OPTIMIZERS, PER_CALL_ITERS, PER_TENSOR_PROBE, time_optimizer_steps


class CountingClock:
    """A host clock whose marks count up by one: every timed step reads 1 ms."""

    def __init__(self) -> None:
        self.now = 0

    def mark(self) -> int:
        self.now += 1
        return self.now

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(end - start)

    def step_ms(self, start: Any, end: Any, wall_ms: float) -> float:
        return self.elapsed_ms(start, end)


def test_every_timed_step_follows_a_backward_into_cleared_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    inputs = torch.randn(4, 8)
    seen: list[bool] = []  # per backward: whether the gradients were cleared before it (set to None)

    def backward() -> None:
        seen.append(all(parameter.grad is None for parameter in model.parameters()))
        model(inputs).sum().backward()

    iters = PER_CALL_ITERS + 1
    found, scratch, per_tensor, per_call = time_optimizer_steps(model, backward, CountingClock(), iters,
                                                                torch.device("cpu"))
    assert set(found) == set(scratch) == set(per_tensor) == set(per_call) == set(OPTIMIZERS)
    assert found == {name: 1.0 for name in OPTIMIZERS}  # one clock tick per step: nothing else is timed
    # the step over one tensor after a backward, less one tensor's share of a step over PER_TENSOR_PROBE of them
    assert per_call == {name: 1.0 - 1.0 / PER_TENSOR_PROBE for name in OPTIMIZERS}
    # the first, then one before each timed step: the whole model's, then the one tensor's (fewer)
    timed = len(OPTIMIZERS) * (iters + min(iters, PER_CALL_ITERS))
    assert len(seen) == 1 + timed and seen[1:] == [True] * timed  # into cleared gradients


def test_a_fast_step_is_timed_more_often_to_fill_min_seconds() -> None:
    """Each timed step costs a backward: with `min_seconds`, steps (backwards included) are added at the first
    one's pace, as the profiler's other phases do (`timing.measured_iterations`): 0.2 s of ~20 ms steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    inputs = torch.randn(4, 8)
    backwards = 0

    def backward() -> None:
        nonlocal backwards
        backwards += 1
        time.sleep(0.02)
        model(inputs).sum().backward()

    iters = 2
    time_optimizer_steps(model, backward, CountingClock(), iters, torch.device("cpu"), min_seconds=0.2)
    # the first backward makes the gradients the warm-up steps need; the per-call probes take `iters` each
    timed = backwards - 1 - len(OPTIMIZERS) * min(iters, PER_CALL_ITERS)
    assert len(OPTIMIZERS) * iters < timed <= len(OPTIMIZERS) * 10  # ceil(0.2 s / pace) each, the pace >= 20 ms
