"""The optimizers training runs (`make_optimizer`), and the time and scratch memory of one step of each over a model."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable

import torch
from torch import nn

from planner.profiling.memory import extra_memory_of
from planner.profiling.timing import Clock, measured_iterations

__all__ = ["OPTIMIZERS", "make_optimizer", "time_grad_accumulation", "time_optimizer_steps"]

OPTIMIZERS = ("sgd", "adam")


def make_optimizer(name: str, parameters: Iterable[Any], lr: float) -> torch.optim.Optimizer:
    """`name`'s optimizer as training runs it: "sgd" (momentum 0.9) or "adam" (torch's defaults)."""
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")


def time_grad_accumulation(model: nn.Module, backward: Callable[[], None], clock: Clock, iters: int) -> float:
    """The median ms of adding one more microbatch's gradients into every parameter's `.grad`
    (what each backward after a stage's first in a step does), measured as in-place adds of the
    gradients `backward` leaves."""
    backward()
    pairs = [(p.grad, p.grad.clone()) for p in model.parameters() if p.grad is not None]
    times = []
    for _ in range(max(iters, 1) + 1):
        began_s = time.perf_counter()
        start = clock.mark()
        for grad, more in pairs:
            grad.add_(more)
        end = clock.mark()
        clock.synchronize()
        times.append(clock.step_ms(start, end, (time.perf_counter() - began_s) * 1e3))  # as `_median_step_ms`
    return statistics.median(times[1:])


def time_optimizer_steps(model: nn.Module, backward: Callable[[], None], clock: Clock, iters: int,
                         device: torch.device, min_seconds: float = 0.0,
                         ) -> tuple[dict[str, float], dict[str, int], dict[str, float], dict[str, float]]:
    """Per optimizer of OPTIMIZERS: the median ms of one `step()` over every parameter of `model`
    (after one warm-up step that creates its state), each right after a `backward` into cleared
    gradients, as training steps (a step timed in a loop of steps alone finds the weights, gradients
    and state in cache: resnet's Adam step read 1.36 ms so and 2.0-2.2 ms after a backward): `iters`
    steps, or more while they and their backwards take less than `min_seconds` at the first one's pace
    (`timing.measured_iterations`; each costs a whole training step, so the profiler asks for few); the scratch
    bytes one step holds beyond the weights, gradients and state (`memory.extra_memory_of`; e.g. Adam's
    per-tensor intermediates); its ms per parameter tensor (`_step_ms_per_tensor`); and its ms per call
    (`_step_ms_per_call`). The steps change the weights (by a learning rate of 1e-9): time them last."""
    backward()
    found, scratch, per_tensor, per_call = {}, {}, {}, {}

    def after_a_backward() -> None:
        model.zero_grad(set_to_none=True)
        backward()

    for name in OPTIMIZERS:
        optimizer = make_optimizer(name, model.parameters(), lr=1e-9)
        optimizer.step()
        state = tuple(tensor for values in optimizer.state.values() for tensor in values.values()
                      if isinstance(tensor, torch.Tensor))
        scratch[name] = extra_memory_of(optimizer.step, model, state, device)
        found[name] = _median_step_ms(optimizer, clock, iters, prepare=after_a_backward, min_seconds=min_seconds)
        del optimizer
        per_tensor[name] = _step_ms_per_tensor(name, clock, iters, device)
        per_call[name] = _step_ms_per_call(name, after_a_backward, clock, min(iters, PER_CALL_ITERS), device,
                                           per_tensor[name])
    return found, scratch, per_tensor, per_call


PER_TENSOR_PROBE = 256  # one-element tensors `_step_ms_per_tensor` steps over
# steps `_step_ms_per_call` times, each after a whole forward and backward: the gpt example's profile took 19.1 s
# without them, 20.9 s with 5 per optimizer, 20.4 s with 3 (means of two runs side by side); Adam's cost per call
# read 0.39-0.48 ms in six profiles
PER_CALL_ITERS = 3


def _step_ms_per_tensor(name: str, clock: Clock, iters: int, device: torch.device) -> float:
    """The median ms of one `name` step over PER_TENSOR_PROBE one-element parameters, divided by their
    count: what a step costs per tensor whatever its size (on CPU, torch's per-parameter loop; e.g.
    resnet's many small tensors make this dominate)."""
    parameters = [torch.zeros(1, device=device, requires_grad=True) for _ in range(PER_TENSOR_PROBE)]
    for parameter in parameters:
        parameter.grad = torch.ones_like(parameter)
    optimizer = make_optimizer(name, parameters, lr=1e-9)
    optimizer.step()
    return _median_step_ms(optimizer, clock, iters) / PER_TENSOR_PROBE


def _step_ms_per_call(name: str, backward: Callable[[], None], clock: Clock, iters: int, device: torch.device,
                      per_tensor_ms: float) -> float:
    """What one `name` step costs whatever it steps: the median ms of a step over one one-element parameter, each
    right after `backward` (the model's: it leaves the optimizer's code and data out of cache, as training's
    backward does), less `per_tensor_ms`; at least 0. Each pipeline stage's rank makes such a call: on the 2-core
    CPU machine Adam's steps over a resnet's parameters in 1, 2, 4 and 8 calls, each after a backward, took
    1.90, 2.33, 3.18 and 4.85 ms (0.42 ms a call more), and a step over one small tensor 0.42 ms, against 0.05 ms
    in a loop of steps alone."""
    parameter = torch.zeros(1, device=device, requires_grad=True)
    parameter.grad = torch.ones_like(parameter)
    optimizer = make_optimizer(name, [parameter], lr=1e-9)
    optimizer.step()
    return max(0.0, _median_step_ms(optimizer, clock, iters, prepare=backward) - per_tensor_ms)


def _median_step_ms(optimizer: torch.optim.Optimizer, clock: Clock, iters: int,
                    prepare: Callable[[], None] | None = None, min_seconds: float = 0.0) -> float:
    """The median ms of `optimizer.step()` over `iters` steps (its state already made), or more while they
    take less than `min_seconds` at the first one's pace, `prepare` run (untimed, but counted in the pace)
    before each; each read by `clock.step_ms` (on a GPU, the host's time until the device is done: a
    launch-bound step's launches are paid whole)."""
    times: list[float] = []
    total = max(iters, 1)
    while len(times) < total:
        began_prepare_s = time.perf_counter()
        if prepare is not None:
            prepare()
            clock.synchronize()
        began_s = time.perf_counter()
        start = clock.mark()
        optimizer.step()
        end = clock.mark()
        clock.synchronize()
        times.append(clock.step_ms(start, end, (time.perf_counter() - began_s) * 1e3))
        if len(times) == 1 and min_seconds > 0:
            total = measured_iterations(total, min_seconds, time.perf_counter() - began_prepare_s)
    return statistics.median(times)
