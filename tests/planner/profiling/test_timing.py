"""Per-layer timing: forward and backward time land on the right layer, functional ops included;
the input-gradient part of each layer's backward; the split backward's cost."""

from __future__ import annotations

import time
from collections import namedtuple
from typing import Any, Callable

import pytest
import torch
from torch import nn

from planner.profiling import timing
from planner.profiling.layers import find_layers
from planner.profiling.timing import (
    MAX_ITERS_FACTOR,
    CudaClock,
    HostClock,
    _fill_forward,
    measured_iterations,
    frozen,
    needs_grad_flags,
    phase_scales,
    requiring_grad,
    time_input_gradients,
    time_layers,
    time_split_backward,
)

TOLERANCE_MS = 4.0  # sleeps overshoot by scheduler latency; python hooks add microseconds


class VirtualTime:
    """A clock that only sleeps move: `time.sleep(s)` adds s to what `time.perf_counter()` reads and returns at once.

    The tests of where a step's time lands sleep in their layers; with real sleeps, beside the suite's torchrun
    jobs (9 processes on 2 cores) a 10 ms sleep read 25 ms in a clean run. On this clock every sleep lasts
    exactly what it asks, the hooks' own work takes no time, and the timing loop's pacing (`min_seconds`) counts
    the sleeps alone."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def perf_counter(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def virtual_time(monkeypatch: pytest.MonkeyPatch) -> VirtualTime:
    """`VirtualTime` in place of time.perf_counter and time.sleep for the test (HostClock and the timing loop
    read time.perf_counter)."""
    clock = VirtualTime()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    return clock


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


def _times(model: nn.Module, sleeps_ms: float) -> tuple[list[float], list[float]]:
    """The layers' forward and backward ms on `VirtualTime` (the test's `virtual_time` fixture), where they add up
    to `sleeps_ms`, what the model sleeps in a step, exactly."""
    x = torch.randn(4, 8, requires_grad=False)
    layers = find_layers(model, lambda: model(x))
    times = time_layers(
        layers, lambda: model(x).sum(), lambda: model.zero_grad(set_to_none=True), HostClock(), warmup=1, iters=3
    )
    assert sum(times.fwd_ms) + sum(times.bwd_ms) == pytest.approx(sleeps_ms) and times.instrumented_ratio == 1.0
    return times.fwd_ms, times.bwd_ms


def test_each_layer_gets_its_own_forward_and_backward_time(virtual_time: VirtualTime) -> None:
    model = nn.Sequential(_SleepLayer(0.020, 0.040), _SleepLayer(0.010, 0.005), _SleepLayer(0.0, 0.015))
    fwd_ms, bwd_ms = _times(model, 20 + 10 + 40 + 5 + 15)
    assert fwd_ms == pytest.approx([20, 10, 0], abs=TOLERANCE_MS)
    assert bwd_ms == pytest.approx([40, 5, 15], abs=TOLERANCE_MS)


class _ManyTinyOps(nn.Module):
    """200 scalar multiplications: 200 autograd nodes of a few microseconds each."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(200):
            x = x * self.scale
        return x


class _CostlyClock(HostClock):
    """A host clock whose every mark costs 20 us first, as recording a CUDA event and its hook's Python delay the
    next kernel's launch on a GPU whose step is bound by launches. It reads this thread's CPU time (on a CPU
    autograd runs the backward in the calling thread), so that another process's turns on a busy machine land in
    no layer's time: beside the suite's other worker one layer's backward read 1.7x its twin's on the wall clock."""

    def mark(self) -> float:
        until = time.thread_time() + 20e-6
        while time.thread_time() < until:
            pass
        return time.thread_time()


def test_the_instrumentations_own_cost_is_taken_out_of_the_layers_times() -> None:
    """Where marking costs more than the work, the instrumented step is several times the plain one; the
    layers' times still add up to the plain step, what training takes, shared as the instrumented steps share
    it, and the ratio is kept apart."""
    model = nn.Sequential(_ManyTinyOps(), _ManyTinyOps())
    x = torch.randn(1)
    layers = find_layers(model, lambda: model(x))
    times = time_layers(layers, lambda: model(x).sum(), lambda: model.zero_grad(set_to_none=True), _CostlyClock(),
                        warmup=2, iters=9)
    assert times.instrumented_ratio > 1.5
    assert sum(times.fwd_ms) + sum(times.bwd_ms) == pytest.approx(times.step_ms, rel=1e-9)
    assert times.fwd_ms[0] == pytest.approx(times.fwd_ms[1], rel=0.5)
    assert times.bwd_ms[0] == pytest.approx(times.bwd_ms[1], rel=0.5)


class _SleepThenTinyOps(nn.Module):
    """One layer that sleeps 10 ms forward and 10 ms backward, then makes 20 autograd nodes that take no time."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Sleep.apply(x * self.scale, 0.010, 0.010)
        for _ in range(20):
            x = x * self.scale
        return x


class _MarkCostsOneMs(HostClock):
    """A host clock on `VirtualTime` whose every mark costs 1 ms first: the backward's node hooks (one per autograd
    node) then cost the instrumented step far more than the forward's layer hooks, as on a launch-bound GPU."""

    def mark(self) -> float:
        time.sleep(0.001)
        return super().mark()


def test_each_phase_adds_up_to_its_own_share_of_the_plain_step(virtual_time: VirtualTime) -> None:
    """The forwards add up to the plain step's forward (start mark to the loss), the backwards to the rest, however
    unevenly the hooks cost the two phases: here the plain step is 10 + 1 ms forward and 10 + 1 ms backward (its
    three marks cost 1 ms each, the first before the clock reads its start), while the instrumented backward pays
    a mark per node (over 20 ms more). One factor for both phases gave the forward 5.4 ms."""
    model = nn.Sequential(_SleepThenTinyOps())
    x = torch.randn(1)
    layers = find_layers(model, lambda: model(x))
    times = time_layers(layers, lambda: model(x).sum(), lambda: model.zero_grad(set_to_none=True),
                        _MarkCostsOneMs(), warmup=1, iters=3)
    assert times.step_ms == pytest.approx(10 + 1 + 10 + 1)
    assert times.forward_share == pytest.approx(0.5)
    assert sum(times.fwd_ms) == pytest.approx(11) and sum(times.bwd_ms) == pytest.approx(11)
    assert times.instrumented_ratio > 1.5 and times.instrumented_forward_share < 0.4


class _FakeDevice:
    """A device on `VirtualTime` that runs the work queued on it one item after another while the host goes on:
    `queue(s)` takes no host time; a mark is the time the device reaches it (a CUDA event's); `synchronize` waits
    for the device's last item; the whole step reads as CUDA's clock reads it (`CudaClock.step_ms`)."""

    def __init__(self) -> None:
        self.busy_until = 0.0

    def queue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, time.perf_counter()) + seconds

    def mark(self) -> float:
        return max(self.busy_until, time.perf_counter())

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))

    elapsed_ms = HostClock.elapsed_ms
    step_ms = CudaClock.step_ms


class _Kernels(torch.autograd.Function):
    """Identity that queues `fwd_s` of device work in its forward and `bwd_s` in its backward, host time 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, device: _FakeDevice, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.device, ctx.bwd_s = device, bwd_s
        device.queue(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.device.queue(ctx.bwd_s)
        return grad, None, None, None


class _KernelLayer(nn.Module):
    def __init__(self, device: _FakeDevice, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.device, self.fwd_s, self.bwd_s = device, fwd_s, bwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Kernels.apply(x * self.scale, self.device, self.fwd_s, self.bwd_s)


def test_where_the_device_lags_the_host_each_phase_is_its_kernels_time(virtual_time: VirtualTime) -> None:
    """A device whose kernels outlast the host's launches (a GPU-bound step): the plain step's forward ends when the
    device reaches the forward's end, not when the host does (the host launched it at once), so the forwards add up
    to the kernels' 5 + 10 ms and the backwards to their 20 + 5 ms."""
    device = _FakeDevice()
    model = nn.Sequential(_KernelLayer(device, 0.005, 0.020), _KernelLayer(device, 0.010, 0.005))
    x = torch.randn(1)
    layers = find_layers(model, lambda: model(x))
    times = time_layers(layers, lambda: model(x).sum(), lambda: model.zero_grad(set_to_none=True), device,
                        warmup=1, iters=3)
    assert times.step_ms == pytest.approx(40) and times.forward_share == pytest.approx(15 / 40)
    assert times.fwd_ms == pytest.approx([5, 10]) and times.bwd_ms == pytest.approx([20, 5])


def test_phase_scales_put_each_phase_at_its_share_and_fall_back_to_one_factor() -> None:
    """Hand-derived: forwards of 30 ms and backwards of 90 ms (instrumented) onto a plain step of 100 ms whose forward
    took a quarter: 25 / 30 and 75 / 90. Without a backward (or a forward), one factor 100 / 120 for both."""
    assert phase_scales(30.0, 90.0, 100.0, 0.25) == pytest.approx((25 / 30, 75 / 90))
    assert phase_scales(120.0, 0.0, 100.0, 0.25) == pytest.approx((100 / 120, 100 / 120))
    assert phase_scales(0.0, 120.0, 100.0, 0.25) == pytest.approx((100 / 120, 100 / 120))
    assert phase_scales(0.0, 0.0, 100.0, 0.25) == (1.0, 1.0)


class _LaggingDeviceClock(HostClock):
    """A device that finishes 5 ms after the host's last mark: `synchronize` waits for it; the plain step is read
    as CUDA's clock reads it (`CudaClock.step_ms`: the host's time until the device is done, or the marks' span)."""

    def synchronize(self) -> None:
        time.sleep(0.005)

    step_ms = CudaClock.step_ms


def test_on_a_device_the_plain_step_lasts_until_the_device_is_done(virtual_time: VirtualTime) -> None:
    """The plain step, so the layers' total, counts the host's time up to the end of the device's work, which the
    marks alone miss (on a GPU, a launch-bound step's host work before its first kernel and after its last launch)."""
    model = nn.Sequential(_SleepLayer(0.002, 0.003))
    x = torch.randn(1, requires_grad=True)
    layers = find_layers(model, lambda: model(x))
    times = time_layers(layers, lambda: model(x).sum(), lambda: model.zero_grad(set_to_none=True),
                        _LaggingDeviceClock(), warmup=1, iters=3)
    assert times.step_ms == pytest.approx(2 + 3 + 5)  # on virtual time, exactly: the sleeps and the device's lag
    assert sum(times.fwd_ms) + sum(times.bwd_ms) == pytest.approx(times.step_ms, rel=1e-9)


def test_functional_ops_count_toward_the_layer_before_them(virtual_time: VirtualTime) -> None:
    fwd_ms, bwd_ms = _times(_WithFunctionalSleep(), 30 + 5 + 35 + 20)
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


def test_branches_sharing_an_input_each_get_their_own_backward(virtual_time: VirtualTime) -> None:
    fwd_ms, bwd_ms = _times(_Branches(), 20 + 66)
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


def test_a_layer_whose_input_needs_no_gradient_still_gets_its_backward(virtual_time: VirtualTime) -> None:
    fwd_ms, bwd_ms = _times(_ConstantInput(), 15 + 35)
    assert fwd_ms == pytest.approx([10, 5], abs=TOLERANCE_MS)
    assert bwd_ms == pytest.approx([20, 15], abs=TOLERANCE_MS)


def test_a_layer_that_never_began_takes_zero_forward_time() -> None:
    # forward marks in time order: layer 1 never began, so it takes layer 2's start
    assert _fill_forward([0.0, None, 5.0, 9.0]) == [0.0, 5.0, 5.0, 9.0]


def test_the_iterations_measured_fill_min_seconds_at_the_first_pace_within_the_cap() -> None:
    assert measured_iterations(2, 0.0, 0.01) == 2  # the floor is off: the iterations asked for
    assert measured_iterations(2, 0.2, 0.02) == 10  # 0.2 s at 20 ms each
    assert measured_iterations(2, 0.2, 0.15) == 2  # slow iterations: never fewer than asked for
    assert measured_iterations(2, 0.2, 0.0) == 2 * MAX_ITERS_FACTOR  # never more than the cap
    assert measured_iterations(3, 0.1, 0.03) == 4  # rounded up: 3 x 30 ms falls short of 0.1 s


def test_the_paired_loop_takes_its_count_from_the_first_pairs_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    # a clock that only the pairs move: 20 ms each, so 0.2 s is 10 pairs, whatever the machine's load
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def pair(k: int) -> int:
        now[0] += 0.020
        return k

    seen: list[tuple[int, int]] = []
    results = timing._paired_iterations(lambda: True, pair, 2, lambda done, total: seen.append((done, total)), 0.2)
    assert results == list(range(1, 11)) and seen[-1] == (11, 11) and seen[0] == (1, 3)  # warm-up, then the pace
    assert timing._paired_iterations(lambda: False, pair, 2, None, 0.2) == []  # a failed warm-up measures nothing


def test_short_steps_are_measured_until_min_seconds_have_passed(virtual_time: VirtualTime) -> None:
    # the pace arithmetic is above; here the floor and the cap as the timing loop applies them, whatever the load
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
    run(60.0, 2)  # an iteration takes about 10 ms: far short of 60 s, so the cap binds
    assert [step for step, _ in seen] == list(range(1, 1 + 2 * MAX_ITERS_FACTOR + 1))  # well past the 2 asked for


# Input gradients ---------------------------------------------------------------------------------


class _SplitSleep(torch.autograd.Function):
    """x * w whose backward sleeps `input_s` if x needs a gradient and `weight_s` if w does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, input_s: float, weight_s: float) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.input_s, ctx.weight_s = input_s, weight_s
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            time.sleep(ctx.input_s)
            grad_x = grad * w
        if ctx.needs_input_grad[1]:
            time.sleep(ctx.weight_s)
            grad_w = (grad * x).sum().reshape(1)
        return grad_x, grad_w, None, None


class _SplitLayer(nn.Module):
    def __init__(self, input_s: float, weight_s: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.input_s, self.weight_s = input_s, weight_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SplitSleep.apply(x, self.w, self.input_s, self.weight_s)


def _input_gradients(model: nn.Module, x: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     iters: int = 5) -> tuple[list[float], list[float]]:
    """(bwd_ms, bwd_input_ms) of `model` on `x`: medians of `iters` steps (of sleeps, under the suite's load:
    at 3, one late wake-up in a clean-clone run moved a layer's input-gradient time from 10 ms to 14.1)."""
    loss = loss or (lambda out: out.float().sum())
    layers = find_layers(model, lambda: model(x))
    run_step, after_step = (lambda: loss(model(x))), (lambda: model.zero_grad(set_to_none=True))
    times = time_layers(layers, run_step, after_step, HostClock(), warmup=1, iters=iters)
    return times.bwd_ms, time_input_gradients(layers, run_step, after_step, HostClock(), model.parameters(),
                                              times.bwd_ms, iters=iters)


def test_the_input_gradients_are_the_part_of_the_backward_with_frozen_weights(virtual_time: VirtualTime) -> None:
    model = nn.Sequential(_SplitLayer(0.010, 0.020), _SplitLayer(0.005, 0.015), _SplitLayer(0.010, 0.005))
    bwd_ms, bwd_input_ms = _input_gradients(model, torch.randn(4, 8))  # the data needs no gradient
    # the first layer's input is data: it has no input gradient to compute, whatever it would cost
    assert bwd_input_ms == pytest.approx([0, 5, 10], abs=TOLERANCE_MS)
    weights_ms = [whole - part for whole, part in zip(bwd_ms, bwd_input_ms)]
    assert weights_ms == pytest.approx([20, 15, 5], abs=2 * TOLERANCE_MS)  # two sleeps' overshoot
    assert all(0 <= part <= whole for part, whole in zip(bwd_input_ms, bwd_ms))


def test_a_linear_mlp_splits_its_middle_layers_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 512), nn.Linear(512, 256))
    # backwards of ~0.3 ms: medians of 15 steps (at 5, a clean-clone run read a 16.6 ms stall for both parts)
    bwd_ms, bwd_input_ms = _input_gradients(model, torch.randn(64, 256), iters=15)
    assert 0 < bwd_input_ms[1] < bwd_ms[1]
    assert 0 < bwd_input_ms[2] < bwd_ms[2]
    assert bwd_input_ms[0] < bwd_input_ms[1]  # the first layer, fed by data, has (almost) none
    assert [p.requires_grad for p in model.parameters()] == [True] * 6


class _Tokens(nn.Module):
    """Token ids into an embedding (its output needs no gradient once frozen), then an in-place ReLU
    and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(64, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.embed(ids)))


def test_layers_after_one_whose_output_needs_no_gradient_still_get_their_input_gradients() -> None:
    model = _Tokens()
    model.head.bias.requires_grad_(False)  # an already frozen parameter stays frozen
    ids = torch.randint(0, 100, (16, 32))
    bwd_ms, bwd_input_ms = _input_gradients(model, ids)
    assert bwd_input_ms[2] > 0 and bwd_input_ms[2] <= bwd_ms[2]
    assert bwd_input_ms[0] <= bwd_ms[0]
    assert [p.requires_grad for p in model.parameters()] == [True, True, False]


def test_an_output_that_is_the_input_itself_is_not_changed() -> None:
    model = nn.Sequential(nn.Identity(), nn.Linear(8, 8))  # the first layer returns the data tensor
    x = torch.randn(4, 8)
    _input_gradients(model, x)
    assert not x.requires_grad and x.grad is None


def test_outputs_that_needed_a_gradient_in_a_normal_step_are_replaced_by_ones_that_do() -> None:
    pair = namedtuple("pair", "a b")
    weight = torch.ones(2, requires_grad=True)
    data, ids, table = torch.randn(2), torch.arange(3), torch.randn(2)

    def layer_output(x: torch.Tensor) -> tuple[Any, ...]:  # a rotary-like table never needs a gradient
        return (x * weight, [ids, table], {"x": x * weight}, pair(x * weight, 1), "text")

    flags = needs_grad_flags(layer_output(data))
    assert flags == (True, False, False, True, True, False, False)
    with torch.no_grad():  # as with frozen weights: nothing needs a gradient
        output = layer_output(data)
    found = requiring_grad(output, flags)
    assert found[0].requires_grad and found[0].grad_fn is not None  # a copy: in-place operations stay legal
    assert found[1][0] is ids and found[1][1] is table and not table.requires_grad
    assert found[2]["x"].requires_grad and isinstance(found[3], pair) and found[3].a.requires_grad
    assert found[3].b == 1 and found[4] == "text"
    assert not output[0].requires_grad  # the original keeps its flag
    needs = (weight * 2, ids)
    assert requiring_grad(needs, needs_grad_flags(needs)) is needs  # nothing to change


def test_frozen_gives_every_parameter_its_flag_back_even_on_error() -> None:
    model = nn.Linear(4, 4)
    model.bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="boom"):
        with frozen(model.parameters()):
            assert not any(p.requires_grad for p in model.parameters())
            raise RuntimeError("boom")
    assert [p.requires_grad for p in model.parameters()] == [True, False]


def test_an_error_in_a_frozen_step_restores_the_flags() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    layers = find_layers(model, lambda: model(x))

    def run_step() -> torch.Tensor:
        if not model[0].weight.requires_grad:
            raise ValueError("frozen step fails")
        return model(x).sum()

    with pytest.raises(ValueError, match="frozen step fails"):
        time_input_gradients(layers, run_step, lambda: None, HostClock(), model.parameters(), [1.0, 1.0])
    assert all(p.requires_grad for p in model.parameters())
    assert not any(layer.module._forward_hooks or layer.module._forward_pre_hooks for layer in layers)  # removed


def test_input_gradient_steps_are_measured_until_min_seconds_have_passed(virtual_time: VirtualTime) -> None:
    model = nn.Sequential(_SplitLayer(0.002, 0.002))
    x = torch.randn(4, 8)
    layers = find_layers(model, lambda: model(x))
    seen: list[tuple[int, int]] = []
    time_input_gradients(layers, lambda: model(x).sum(), lambda: None, HostClock(), model.parameters(), [4.0],
                         iters=2, progress=lambda done, total: seen.append((done, total)), min_seconds=60.0)
    # a pair takes a few ms, far short of 60 s: the cap binds, well past the 2 asked for, whatever the load
    assert [step for step, _ in seen] == list(range(1, 1 + 2 * MAX_ITERS_FACTOR + 1))


class _Rotary(nn.Module):
    """A table from positions, no parameters: its output never needs a gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.arange(x.shape[-1], dtype=x.dtype).sin().expand_as(x)


class _UsesTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _SplitLayer(0.0, 0.005)
        self.table = _Rotary()
        self.second = _SplitLayer(0.005, 0.005)
        self.table_needs_grad: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        table = self.table(h)  # as the next layer sees it, after every hook
        self.table_needs_grad.append(table.requires_grad)
        return self.second(h * table)


def test_outputs_that_need_no_gradient_in_a_normal_step_get_none_when_frozen(virtual_time: VirtualTime) -> None:
    model = _UsesTable()
    layers = find_layers(model, lambda: model(torch.randn(4, 8)))
    x = torch.randn(4, 8)
    model.table_needs_grad.clear()
    bwd_input_ms = time_input_gradients(layers, lambda: model(x).sum(), lambda: None, HostClock(),
                                        model.parameters(), [5.0, 0.0, 10.0], iters=1)
    assert len(model.table_needs_grad) == 4 and not any(model.table_needs_grad)  # in no step
    assert bwd_input_ms == pytest.approx([0, 0, 5], abs=TOLERANCE_MS)


# Split backward ------------------------------------------------------------------------------------


def _split_ratio(model: nn.Module, x: torch.Tensor, iters: int = 3) -> float:
    layers = find_layers(model, lambda: model(x))
    ratio = time_split_backward(layers, lambda: model(x).sum(), lambda: model.zero_grad(set_to_none=True),
                                HostClock(), model.parameters(), iters=iters)
    assert not any(layer.module._forward_hooks for layer in layers)  # removed
    return ratio


def test_the_split_backward_ratio_of_a_linear_mlp_is_measured() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 16))
    # backwards of ~0.1 ms: a median of 31 pairs (of 3, two stalls of the process under the suite's load read 106)
    ratio = _split_ratio(model, torch.randn(32, 64), iters=31)
    assert 0 < ratio < 10  # B + W costs somewhat more than one backward; not bounded tightly (noise)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # after_step ran


def test_the_split_backward_times_the_layers_after_the_first_split_into_b_and_w(virtual_time: VirtualTime) -> None:
    # a custom Function computes all its gradients whenever it runs, so B runs layers 1 and 2 whole and W
    # runs them again: twice the plain backward. The first layer, cut off as a stage's input would be, and
    # its 30 ms weight gradient count in neither (uncut: (40 + 30) / (20 + 30) = 1.4).
    model = nn.Sequential(_SplitLayer(0.0, 0.030), _SplitLayer(0.005, 0.005), _SplitLayer(0.005, 0.005))
    assert 1.7 < _split_ratio(model, torch.randn(4, 8)) < 2.3


def test_the_split_backward_ratio_is_one_with_one_layer_or_nothing_to_cut() -> None:
    assert _split_ratio(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8)) == 1.0
    x = torch.randn(4, 8)
    assert _split_ratio(nn.Sequential(nn.Identity(), nn.Linear(8, 8)), x) == 1.0  # returns the data itself
    assert not x.requires_grad and x.grad is None


def test_cut_replaces_outputs_that_need_a_gradient_by_copies_of_new_leaves() -> None:
    weight = torch.ones(2, requires_grad=True)
    output = (torch.randn(2) * weight, torch.arange(3), torch.randn(2))
    leaves: list[torch.Tensor] = []
    found = requiring_grad(output, needs_grad_flags(output), cut=True, new_leaves=leaves)
    assert found[1] is output[1] and found[2] is output[2]  # no gradient needed: left alone
    (leaf,) = leaves
    assert leaf.is_leaf and leaf.requires_grad and torch.equal(leaf, output[0])
    found[0].sum().backward()  # the graph ends at the leaf (a copy of it, so in-place operations stay legal)
    assert torch.equal(leaf.grad, torch.ones(2)) and weight.grad is None
