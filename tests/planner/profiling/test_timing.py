"""Per-layer timing: forward and backward time land on the right layer, functional ops included."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from planner.profiling.layers import find_layers
from planner.profiling.timing import HostClock, _fill_forward, time_layers

TOLERANCE_MS = 4.0  # sleeps overshoot by scheduler latency; python hooks add microseconds


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps `fwd_s` and whose backward sleeps `bwd_s`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd_s)
        return grad, None, None


class _SleepLayer(nn.Module):
    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.fwd_s, self.bwd_s)


class _WithFunctionalSleep(nn.Module):
    """first, then a functional op (not a module) that sleeps, then second."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _SleepLayer(0.010, 0.005)
        self.second = _SleepLayer(0.005, 0.020)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        between = _Sleep.apply(self.first(x), 0.020, 0.030)
        return self.second(between)


def _times(model: nn.Module) -> tuple[list[float], list[float], float]:
    x = torch.randn(4, 8, requires_grad=False)
    layers = find_layers(model, lambda: model(x))
    times = time_layers(
        layers, lambda: model(x).sum(), lambda: model.zero_grad(set_to_none=True), HostClock(), warmup=1, iters=3
    )
    return times.fwd_ms, times.bwd_ms, times.step_ms


def test_each_layer_gets_its_own_forward_and_backward_time() -> None:
    model = nn.Sequential(_SleepLayer(0.020, 0.040), _SleepLayer(0.010, 0.005), _SleepLayer(0.0, 0.015))
    fwd_ms, bwd_ms, step_ms = _times(model)
    assert fwd_ms == pytest.approx([20, 10, 0], abs=TOLERANCE_MS)
    assert bwd_ms == pytest.approx([40, 5, 15], abs=TOLERANCE_MS)
    assert sum(fwd_ms) + sum(bwd_ms) == pytest.approx(step_ms, abs=2 * TOLERANCE_MS)


def test_functional_ops_count_toward_the_layer_before_them() -> None:
    fwd_ms, bwd_ms, _ = _times(_WithFunctionalSleep())
    assert fwd_ms == pytest.approx([10 + 20, 5], abs=TOLERANCE_MS)
    assert bwd_ms == pytest.approx([5 + 30, 20], abs=TOLERANCE_MS)


class _Branches(nn.Module):
    """stem, then three branches that all read the stem's output, then a head that adds them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = _SleepLayer(0.002, 0.004)
        self.a = _SleepLayer(0.004, 0.010)
        self.b = _SleepLayer(0.004, 0.020)
        self.c = _SleepLayer(0.004, 0.030)
        self.head = _SleepLayer(0.006, 0.002)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.a(h) + self.b(h) + self.c(h))


def test_branches_sharing_an_input_each_get_their_own_backward() -> None:
    fwd_ms, bwd_ms, _ = _times(_Branches())
    assert fwd_ms == pytest.approx([2, 4, 4, 4, 6], abs=TOLERANCE_MS)
    assert bwd_ms == pytest.approx([4, 10, 20, 30, 2], abs=TOLERANCE_MS)


class _ConstantInput(nn.Module):
    """The second layer's input needs no gradient (it is made from a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _SleepLayer(0.010, 0.020)
        self.second = _SleepLayer(0.005, 0.015)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.second(torch.ones_like(x))


def test_a_layer_whose_input_needs_no_gradient_still_gets_its_backward() -> None:
    fwd_ms, bwd_ms, _ = _times(_ConstantInput())
    assert fwd_ms == pytest.approx([10, 5], abs=TOLERANCE_MS)
    assert bwd_ms == pytest.approx([20, 15], abs=TOLERANCE_MS)


def test_a_layer_that_never_began_takes_zero_forward_time() -> None:
    # forward marks in time order: layer 1 never began, so it takes layer 2's start
    assert _fill_forward([0.0, None, 5.0, 9.0]) == [0.0, 5.0, 5.0, 9.0]


def test_short_steps_are_measured_until_min_seconds_have_passed() -> None:
    # one iteration (a plain and an instrumented step) takes about 2 x 10 ms: 0.2 s needs about 10 of them
    model = nn.Sequential(_SleepLayer(0.003, 0.002))
    x = torch.randn(4, 8)
    layers = find_layers(model, lambda: model(x))
    seen: list[tuple[int, int]] = []

    def run(min_seconds: float, iters: int) -> None:
        seen.clear()
        time_layers(layers, lambda: model(x).sum(), lambda: model.zero_grad(set_to_none=True), HostClock(), warmup=1,
                    iters=iters, progress=lambda done, total: seen.append((done, total)), min_seconds=min_seconds)

    run(0.0, 2)
    assert seen[-1] == (3, 3)  # the floor is off: warm-up + iters
    run(0.2, 2)
    done, total = seen[-1]
    assert done == total and 1 + 5 <= total <= 1 + 20  # about 10 measured, well past the 2 asked for
    assert [step for step, _ in seen] == list(range(1, total + 1))
    run(60.0, 2)
    assert seen[-1] == (1 + 2 * 20, 1 + 2 * 20)  # never more than MAX_ITERS_FACTOR x iters
