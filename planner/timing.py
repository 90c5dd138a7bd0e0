"""Times training steps and splits them into per-layer forward and backward times.

Forward: a mark when each layer begins (its module's first call) splits the step into segments
F[0] (before the model is called) <= F[1] <= ... <= F[L] (after the loss), so
`fwd_ms[i] = F[i+1] - F[i]`: a layer's time includes the functional operations after it.

Backward: autograd runs nodes in reverse creation order, so the backward of layer i ends when
the node that produced layer i's input is about to run. A pre-hook on that node
(`grad_fn.register_prehook`) marks E[i]; E[L] is the call of `loss.backward()`, E[0] its return,
and `bwd_ms[i] = E[i] - E[i+1]`. If layer i's inputs need no gradient, the nodes of layer i-1's
outputs are used; a boundary that never fires takes the mark of the one before it in time.
Marks are host clocks on CPU and CUDA events on GPU (no synchronisation inside the step), so the
per-layer times add up exactly to the instrumented step. `step_ms` is the median of uninstrumented
steps, each paired with an instrumented one. Over the steps, each layer's median is taken and all
are scaled by one factor so that they add up to `step_ms x median(instrumented_k / plain_k)`:
the per-pair ratio cancels the machine's drift, which medians of each kind alone do not, and
a sum of medians falls short of the median sum when the noise is skewed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from planner.dataflow import tensors_in
from planner.layers import Layer
from planner.segments import LayerTracker


class Clock(Protocol):
    """Marks points in a step and measures between them."""

    def mark(self) -> Any:
        """A point in time, in issue order."""

    def synchronize(self) -> None:
        """Wait until every marked point has happened."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (after `synchronize`)."""


class HostClock:
    """`time.perf_counter` marks, for CPU devices."""

    def mark(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:
        return None

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1000.0


class CudaClock:
    """CUDA event marks recorded on the current stream, for CUDA devices."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))


def clock_for(device: torch.device) -> Clock:
    """The clock that times work on `device`."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


@dataclass(frozen=True)
class StepTimes:
    """Per-layer times (ms per mini-batch) adding up to `step_ms x instrumented_ratio`.

    `step_ms`: median uninstrumented step; `instrumented_ratio`: median over pairs of the
    instrumented step's time over its paired plain step's (the instrumentation's overhead, ~1).
    """

    fwd_ms: list[float]
    bwd_ms: list[float]
    step_ms: float
    instrumented_ratio: float


def _grad_nodes(value: Any) -> list[torch.autograd.graph.Node]:
    """The autograd nodes that produced the tensors in `value` (those that need a gradient)."""
    return [t.grad_fn for t in tensors_in(value) if t.grad_fn is not None]


class _InstrumentedStep:
    """Hooks that mark forward and backward layer boundaries during one step."""

    def __init__(self, layers: Sequence[Layer], clock: Clock) -> None:
        self.clock = clock
        self.num_layers = len(layers)
        self.fwd_marks: list[Any] = []
        self.bwd_marks: list[Any] = []
        self.outputs: list[Any] = []
        self.tracker = LayerTracker(layers, on_enter=self._enter, on_exit=self._exit)

    def reset(self) -> None:
        self.tracker.reset()
        self.fwd_marks = [None] * (self.num_layers + 1)
        self.bwd_marks = [None] * (self.num_layers + 1)
        self.outputs = [None] * self.num_layers

    def _enter(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fwd_marks[index] = self.clock.mark()
        if index == 0:
            return
        previous_output, self.outputs[index - 1] = self.outputs[index - 1], None  # hold no tensor longer
        nodes = _grad_nodes((args, kwargs)) or _grad_nodes(previous_output)
        for node in nodes:
            node.register_prehook(self._backward_boundary(index))

    def _exit(self, index: int, output: Any) -> None:
        self.outputs[index] = output  # its grad nodes are looked up only if layer index+1 needs them

    def _backward_boundary(self, index: int) -> Callable[[Any], None]:
        def hook(_grad_outputs: Any) -> None:
            if self.bwd_marks[index] is None:
                self.bwd_marks[index] = self.clock.mark()
        return hook

    def remove(self) -> None:
        self.tracker.remove()


def _fill_forward(marks: list[Any]) -> list[Any]:
    """Layers that never began (index > 0) take the next mark, so their time is 0."""
    filled = list(marks)
    for index in range(len(filled) - 2, 0, -1):
        if filled[index] is None:
            filled[index] = filled[index + 1]
    return filled


def _fill_backward(marks: list[Any]) -> list[Any]:
    """Boundaries that never fired take the mark of the later-in-time boundary below them."""
    filled = list(marks)
    for index in range(1, len(filled) - 1):
        if filled[index] is None:
            filled[index] = filled[index - 1]
    return filled


def _segment_ms(clock: Clock, marks: list[Any], reverse: bool) -> list[float]:
    """Durations between consecutive marks, clamped at 0; `reverse` for backward (time runs down)."""
    durations = []
    for index in range(len(marks) - 1):
        start, end = (marks[index + 1], marks[index]) if reverse else (marks[index], marks[index + 1])
        durations.append(max(0.0, clock.elapsed_ms(start, end)))
    return durations


def time_layers(
    layers: Sequence[Layer],
    run_step: Callable[[], torch.Tensor],
    after_step: Callable[[], None],
    clock: Clock,
    warmup: int,
    iters: int,
    progress: Callable[[int, int], None] | None = None,
) -> StepTimes:
    """Median per-layer forward/backward ms and median uninstrumented step ms over `iters` steps.

    Every iteration runs a plain and an instrumented step, alternating which goes first, so that
    both see the same machine (a burst of load elsewhere hits both alike). `warmup` iterations come
    first, one step each, alternating kinds, and are not counted; `after_step` runs after every step (e.g. zeroing gradients).
    """
    fwd_samples: list[list[float]] = []
    bwd_samples: list[list[float]] = []
    step_samples: list[float] = []

    def plain() -> float:
        start = clock.mark()
        loss = run_step()
        loss.backward()
        end = clock.mark()
        del loss
        clock.synchronize()
        after_step()
        return clock.elapsed_ms(start, end)

    def measured() -> tuple[list[float], list[float]]:
        step = _InstrumentedStep(layers, clock)
        step.reset()
        try:
            step.fwd_marks[0] = clock.mark()
            loss = run_step()
            step.fwd_marks[-1] = clock.mark()
            step.outputs = []
            step.bwd_marks[-1] = clock.mark()
            loss.backward()
            step.bwd_marks[0] = clock.mark()
            del loss
        finally:
            step.remove()
        clock.synchronize()
        after_step()
        fwd = _segment_ms(clock, _fill_forward(step.fwd_marks), reverse=False)
        bwd = _segment_ms(clock, _fill_backward(step.bwd_marks), reverse=True)
        return fwd, bwd

    total = warmup + iters
    for iteration in range(total):
        if iteration < warmup:  # one step each warms what both kinds of step run
            if iteration % 2 == 0:
                plain()
            else:
                measured()
        else:
            if iteration % 2 == 0:
                step_ms = plain()
                fwd, bwd = measured()
            else:
                fwd, bwd = measured()
                step_ms = plain()
            step_samples.append(step_ms)
            fwd_samples.append(fwd)
            bwd_samples.append(bwd)
        if progress is not None:
            progress(iteration + 1, total)
    fwd_ms = [statistics.median(column) for column in zip(*fwd_samples)]
    bwd_ms = [statistics.median(column) for column in zip(*bwd_samples)]
    step_ms = statistics.median(step_samples)
    # The machine's speed drifts over seconds, so medians of the two kinds of step, even paired,
    # differ by several percent at 10 steps. The drift cancels within a pair: the instrumented
    # step's cost relative to its plain partner is median(instrumented_k / plain_k). The layers'
    # medians keep each layer's share and are scaled to add up to step_ms x that ratio.
    totals = [sum(fwd) + sum(bwd) for fwd, bwd in zip(fwd_samples, bwd_samples)]
    ratio = statistics.median(total / plain for total, plain in zip(totals, step_samples) if plain > 0)
    medians_sum = sum(fwd_ms) + sum(bwd_ms)
    scale = step_ms * ratio / medians_sum if medians_sum > 0 else 1.0
    return StepTimes(
        fwd_ms=[ms * scale for ms in fwd_ms],
        bwd_ms=[ms * scale for ms in bwd_ms],
        step_ms=step_ms,
        instrumented_ratio=ratio,
    )
