"""Times training steps and splits them into per-layer forward and backward times.

Forward: a mark when each layer begins (its module's first call) splits the step into segments
F[0] (before the model is called) <= F[1] <= ... <= F[L] (after the loss), so
`fwd_ms[i] = F[i+1] - F[i]`: a layer's time includes the functional operations after it.

Backward: every autograd node belongs to the layer that was running when the forward created it
(autograd numbers nodes in creation order, so the sequence number at each layer's start splits
them). After the forward, the graph is walked once and every node gets a pre-hook that marks
the time and its layer; the time from one node's start to the next node's start is its layer's.
This stays right when layers run side by side (branches sharing an input) and when a layer's
input needs no gradient. Gradient accumulation into parameters is counted with the node before it.
Marks are host clocks on CPU and CUDA events on GPU (no synchronisation inside the step), so
per-layer times add up exactly to the instrumented step. `step_ms` is the median of uninstrumented
steps, each paired with an instrumented one. Over the steps, each layer's median is taken and all
are scaled by one factor so that they add up to `step_ms x median(instrumented_k / plain_k)`:
the per-pair ratio cancels the machine's drift, which medians of each kind alone do not, and
a sum of medians falls short of the median sum when the noise is skewed. What remains is the
instrumentation's own cost, a few microseconds per layer and per autograd node.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from planner.profiling.layers import Layer
from planner.profiling.layer_tracker import LayerTracker

MAX_ITERS_FACTOR = 20  # `min_seconds` runs at most this many times the measured iterations asked for


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
        """Seconds from `time.perf_counter`."""
        return time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for: host marks are taken when they happen."""
        return None

    def elapsed_ms(self, start: float, end: float) -> float:
        """(end - start) in milliseconds."""
        return (end - start) * 1000.0


class CudaClock:
    """CUDA event marks recorded on the current stream, for CUDA devices."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        """An event on this device's current stream (autograd's backward thread included)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        """Wait for the device, so that every recorded event has happened."""
        torch.cuda.synchronize(self.device)

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        """Milliseconds between two recorded events (after `synchronize`)."""
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


@contextlib.contextmanager
def _gc_paused() -> Any:
    """Python's cyclic garbage collector off for the duration (as timeit does): a collection
    triggered by the hooks' small allocations would land inside the instrumented step only."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get."""
    return int(torch._C._autograd._get_sequence_nr())


def _graph_nodes(root: torch.autograd.graph.Node) -> list[torch.autograd.graph.Node]:
    """Every node reachable from `root` through `next_functions`."""
    seen = {id(root)}
    nodes = [root]
    for node in nodes:  # grows while iterating: a breadth-first walk
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                nodes.append(child)
    return nodes


def backward_nodes(loss: torch.Tensor, sequence_starts: Sequence[int | None]) -> list[tuple[Any, int]]:
    """Every autograd node of `loss`'s graph that a layer's forward created, with that layer: the
    last layer whose start (`sequence_starts[i]`: `sequence_nr()` when layer i began, None if it
    never did) is at or below the node's number. Call it right after the forward and loss."""
    if loss.grad_fn is None:
        return []
    forward_end = sequence_nr()  # nodes numbered from here on (gradient accumulators) are not layers'
    starts: list[int] = []
    following = forward_end
    for start in reversed(sequence_starts):  # a layer that never began starts where the next does
        following = start if start is not None else following
        starts.append(following)
    starts.reverse()
    return [(node, max(bisect.bisect_right(starts, node._sequence_nr()) - 1, 0))
            for node in _graph_nodes(loss.grad_fn) if node._sequence_nr() < forward_end]


class _InstrumentedStep:
    """Hooks that mark forward layer starts and the start of every backward node during one step."""

    def __init__(self, layers: Sequence[Layer], clock: Clock) -> None:
        self.clock = clock
        self.num_layers = len(layers)
        self.fwd_marks: list[Any] = [None] * (self.num_layers + 1)
        self.sequence_starts: list[int | None] = [None] * self.num_layers
        self.bwd_events: list[tuple[int, Any]] = []  # (layer, mark) at each backward node's start
        self.tracker = LayerTracker(layers, on_enter=self._enter)

    def _enter(self, index: int, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        self.fwd_marks[index] = self.clock.mark()
        self.sequence_starts[index] = sequence_nr()

    def hook_backward(self, loss: torch.Tensor) -> None:
        """Give every node of the loss's graph a pre-hook that records its layer and the time."""
        hooks = [self._backward_hook(layer) for layer in range(self.num_layers)]
        for node, layer in backward_nodes(loss, self.sequence_starts):
            node.register_prehook(hooks[layer])

    def _backward_hook(self, layer: int) -> Callable[[Any], None]:
        def hook(_grad_outputs: Any) -> None:
            self.bwd_events.append((layer, self.clock.mark()))
        return hook

    def backward_ms(self, start: Any, end: Any) -> list[float]:
        """Per-layer backward ms: each interval between node starts goes to the earlier node's layer."""
        totals = [0.0] * self.num_layers
        if not self.bwd_events:
            totals[-1] = max(0.0, self.clock.elapsed_ms(start, end))
            return totals
        first_layer = self.bwd_events[0][0]
        totals[first_layer] += max(0.0, self.clock.elapsed_ms(start, self.bwd_events[0][1]))
        for (layer, mark), (_, next_mark) in zip(self.bwd_events, self.bwd_events[1:] + [(0, end)]):
            totals[layer] += max(0.0, self.clock.elapsed_ms(mark, next_mark))
        return totals

    def remove(self) -> None:
        """Remove the forward hooks (node hooks go with their graph)."""
        self.tracker.remove()


def _fill_forward(marks: list[Any]) -> list[Any]:
    """Layers that never began (index > 0) take the next mark, so their time is 0."""
    filled = list(marks)
    for index in range(len(filled) - 2, 0, -1):
        if filled[index] is None:
            filled[index] = filled[index + 1]
    return filled


def _segment_ms(clock: Clock, marks: list[Any]) -> list[float]:
    """Durations between consecutive marks, clamped at 0."""
    return [max(0.0, clock.elapsed_ms(start, end)) for start, end in zip(marks, marks[1:])]


def time_layers(
    layers: Sequence[Layer],
    run_step: Callable[[], torch.Tensor],
    after_step: Callable[[], None],
    clock: Clock,
    warmup: int,
    iters: int,
    progress: Callable[[int, int], None] | None = None,
    min_seconds: float = 0.0,
) -> StepTimes:
    """Median per-layer forward/backward ms and median uninstrumented step ms over `iters` steps, or more:
    as many as fill `min_seconds` at the first measured iteration's pace (at most MAX_ITERS_FACTOR x iters),
    since medians of a few short steps move by several percent from one run to the next.

    Every iteration runs a plain and an instrumented step, alternating which goes first, so that
    both see the same machine (a burst of load elsewhere hits both alike). `warmup` iterations come
    first, one step each, alternating kinds, and are not counted; `after_step` runs after every step (e.g. zeroing gradients).
    """
    fwd_samples: list[list[float]] = []
    bwd_samples: list[list[float]] = []
    step_samples: list[float] = []

    def plain() -> float:
        with _gc_paused():
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
        try:
            with _gc_paused():
                step.fwd_marks[0] = clock.mark()
                loss = run_step()
                step.fwd_marks[-1] = clock.mark()
                step.hook_backward(loss)
                backward_start = clock.mark()
                loss.backward()
                backward_end = clock.mark()
                del loss
        finally:
            step.remove()
        clock.synchronize()
        after_step()
        return _segment_ms(clock, _fill_forward(step.fwd_marks)), step.backward_ms(backward_start, backward_end)

    total = warmup + iters
    iteration = 0
    while iteration < total:
        began = time.perf_counter()
        if iteration < warmup:  # one step each warms what both kinds of step run
            if iteration % 2 == 0:
                measured()
            else:
                plain()
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
            if iteration == warmup and min_seconds > 0:  # the first measured iteration sets the pace
                pace_s = max(time.perf_counter() - began, 1e-9)
                total = warmup + min(max(iters, math.ceil(min_seconds / pace_s)), MAX_ITERS_FACTOR * iters)
        iteration += 1
        if progress is not None:
            progress(iteration, total)
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
