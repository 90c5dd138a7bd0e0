"""Times training steps and splits them into per-layer forward and backward times.

Forward: a mark when each layer begins (its module's first call) splits the step into segments
F[0] (the first layer's start) <= F[1] <= ... <= F[L] (after the loss), so
`fwd_ms[i] = F[i+1] - F[i]`: a layer's time includes the functional operations after it. Work before the
first layer (inside the step, before the model reaches it) is in no layer's instrumented time; the plain
step's forward counts it, so scaling the forwards to that forward spreads it over them.

Backward: every autograd node belongs to the layer that was running when the forward created it
(autograd numbers nodes in creation order, so the sequence number at each layer's start splits
them). After the forward, the graph is walked once and every node gets a pre-hook that marks
the time and its layer; the time from one node's start to the next node's start is its layer's.
This stays right when layers run side by side (branches sharing an input) and when a layer's
input needs no gradient. Gradient accumulation into parameters is counted with the node before it.
Marks are host clocks on CPU and CUDA events on GPU (no synchronisation inside the step), so
per-layer times add up exactly to the instrumented step. `step_ms` is the median of uninstrumented
steps, each paired with an instrumented one. Over the steps, each layer's median is taken; the forwards
are scaled by one factor so that they add up to the plain steps' forward (`forward_share x step_ms`, the
median share from the step's start to the loss) and the backwards by another to the rest, so that
together they add up to `step_ms`, what training (uninstrumented) takes: within a phase the layers'
shares are the instrumented steps', each phase's sum the plain steps'. That takes out the
instrumentation's own cost, a few microseconds of host time per layer and per autograd node, in
proportion to each layer's time within its phase (the backward has a hook per node, the forward one per
layer). On CPU it is ~1-4% of a step; on a GPU whose step is bound by
kernel launches it is not small, since the hooks' host time delays the launches: 1.45x on the gpt
example at batch 8 on an H200, 1.01x on a GPT-2 of width 1024 (`instrumented_ratio`, the median of
instrumented_k / plain_k over the pairs, keeps it in the profile).

Input gradients (`time_input_gradients`): the part of each layer's backward that computes the
gradients of its inputs (zero-bubble schedules' B; the rest, the weights' gradients, is W). Steps
in which every parameter has `requires_grad=False` make autograd compute only the chain of
activation gradients; they are timed with the same node pre-hooks. A layer output that needs a
gradient in a normal step but none with frozen weights (its inputs are data: an embedding of token
ids) is replaced by a copy of a grad-requiring leaf, so that the graph reaches back to it as it
does to a pipeline stage's received input: the layers after it still compute their input
gradients, and a layer whose own input needs no gradient (the first layer fed by data) gets ~0.
Outputs that need no gradient in a normal step either (masks, rotary tables) are left alone.

Split backward (`time_split_backward`): how much longer the backward takes when run as B then W
(`planner.profiling.backward_split`: B's bookkeeping of the graph, a second pass over the stage, boundary
nodes without a weight formula run twice, products in another order) than run whole, as one ratio for the model: pairs of steps whose forward cuts the
graph after the first layer (its outputs replaced by grad-requiring leaves, as a stage's received
input), one differentiated by `backward_inputs` + `backward_weights`, the other by `loss.backward()`.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeVar

import torch

from torch.utils import _pytree as pytree

from planner.profiling.backward_split import backward_inputs, backward_weights
from planner.profiling.layers import Layer
from planner.profiling.layer_tracker import LayerTracker

T = TypeVar("T")

MAX_ITERS_FACTOR = 20  # `min_seconds` runs at most this many times the measured iterations asked for
INPUT_GRADIENT_ITERS = 5  # pairs of steps `time_input_gradients` measures at least (ratios within a pair are steady)


class Clock(Protocol):
    """Marks points in a step and measures between them."""

    def mark(self) -> Any:
        """A point in time, in issue order."""

    def synchronize(self) -> None:
        """Wait until every marked point has happened."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (after `synchronize`)."""

    def step_ms(self, start: Any, end: Any, wall_ms: float) -> float:
        """The milliseconds from mark `start` to mark `end`, given `wall_ms`, the host's time from just before
        `start` until `end` was marked, or until `synchronize` returned after it (a whole step's, to its device's
        end)."""


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

    def step_ms(self, start: float, end: float, wall_ms: float) -> float:
        """The marks' span (the host's time is the work's)."""
        return self.elapsed_ms(start, end)


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

    def step_ms(self, start: torch.cuda.Event, end: torch.cuda.Event, wall_ms: float) -> float:
        """The host's time, `wall_ms`, or the events' span if longer: a launch-bound step's host work before its
        first kernel and after its last launch, which the events miss (6-7% of a small transformer's step on an
        H200), is paid in training too. Where the device lags the host (its kernels dominate), the events' span
        is the longer, whether or not `wall_ms` waited for the device."""
        return max(wall_ms, self.elapsed_ms(start, end))


def clock_for(device: torch.device) -> Clock:
    """The clock that times work on `device`."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


@dataclass(frozen=True)
class StepTimes:
    """Per-layer times (ms per mini-batch) adding up to `step_ms`.

    `step_ms`: median uninstrumented step; `instrumented_ratio`: median over pairs of the
    instrumented step's time over its paired plain step's (the instrumentation's overhead, taken
    out of the layers' times; ~1 on CPU); `forward_share`: the median over plain steps of the forward's
    (and loss's) share of the step, to which the forwards add up (`phase_scales`);
    `instrumented_forward_share`: the forwards' share of the instrumented medians, before that scaling.
    """

    fwd_ms: list[float]
    bwd_ms: list[float]
    step_ms: float
    instrumented_ratio: float
    forward_share: float
    instrumented_forward_share: float


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


OutputFlags = list[tuple[bool, ...] | None]  # per layer: which tensors of its output need a gradient


def needs_grad_flags(output: Any) -> tuple[bool, ...]:
    """For each leaf of `output` in `tree_flatten` order: a tensor that needs a gradient."""
    return tuple(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in pytree.tree_flatten(output)[0])


def requiring_grad(output: Any, flags: Sequence[bool], cut: bool = False,
                   new_leaves: list[torch.Tensor] | None = None) -> Any:
    """`output` with each floating-point tensor that `flags` (from `needs_grad_flags` in a normal step)
    says needs a gradient, but now needs none, replaced by a copy of a leaf that does: a copy, so
    that in-place operations on it stay legal and the original keeps its flag. Tensors that needed
    no gradient in a normal step either (masks, rotary tables) stay as they are, so that no
    gradient a normal backward skips is computed. Returns `output` itself if nothing changed.

    `cut`: those that need a gradient now are replaced too, so that the graph before them is cut off
    as before a pipeline stage's received input. `new_leaves`: a list that gets each new leaf (the
    tensors whose gradients are such a stage's input gradients)."""
    leaves, spec = pytree.tree_flatten(output)
    if len(leaves) != len(flags):
        return output

    def leaf_copy(tensor: torch.Tensor) -> torch.Tensor:
        leaf = tensor.detach().requires_grad_()
        if new_leaves is not None:
            new_leaves.append(leaf)
        return leaf.clone()

    changed = [
        leaf_copy(leaf)
        if needed and isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and (cut or not leaf.requires_grad)
        else leaf
        for leaf, needed in zip(leaves, flags)
    ]
    if all(new is old for new, old in zip(changed, leaves)):
        return output
    return pytree.tree_unflatten(changed, spec)


class _InstrumentedStep:
    """Hooks that mark forward layer starts and the start of every backward node during one step.

    For `time_input_gradients`: `record_outputs` notes in `output_flags` which tensors of each layer's
    output need a gradient (`needs_grad_flags`); `replace_outputs`, such flags from a normal step,
    has the tensors they flag that need no gradient now (parameters frozen) replaced by ones that do
    (`requiring_grad`).
    """

    def __init__(self, layers: Sequence[Layer], clock: Clock, record_outputs: bool = False,
                 replace_outputs: OutputFlags | None = None) -> None:
        self.clock = clock
        self.num_layers = len(layers)
        self.fwd_marks: list[Any] = [None] * (self.num_layers + 1)
        self.sequence_starts: list[int | None] = [None] * self.num_layers
        self.bwd_events: list[tuple[int, Any]] = []  # (layer, mark) at each backward node's start
        self.output_flags: OutputFlags = [None] * self.num_layers
        self._replace = replace_outputs
        watch = record_outputs or replace_outputs is not None
        self.tracker = LayerTracker(layers, on_enter=self._enter, on_exit=self._exit if watch else None)
        self._exiting: int | None = None  # the layer whose first call the tracker has just seen return
        # registered after the tracker's hooks, so each runs right after the tracker's on the same call
        self._leaf_handles = [layer.module.register_forward_hook(self._leaf_hook(index))
                              for index, layer in enumerate(layers)] if self._replace is not None else []

    def _enter(self, index: int, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        self.fwd_marks[index] = self.clock.mark()
        self.sequence_starts[index] = sequence_nr()

    def _exit(self, index: int, output: Any) -> None:
        if self._replace is None:
            self.output_flags[index] = needs_grad_flags(output)
        else:
            self._exiting = index

    def _leaf_hook(self, index: int) -> Callable[..., Any]:
        def hook(_module: Any, _args: Any, output: Any) -> Any:
            flags = self._replace[index] if self._replace is not None and self._exiting == index else None
            self._exiting = None
            if not flags:
                return None
            replaced = requiring_grad(output, flags)
            return None if replaced is output else replaced
        return hook

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
        for handle in self._leaf_handles:
            handle.remove()
        self._leaf_handles.clear()


def _instrumented_ms(
    layers: Sequence[Layer], run_step: Callable[[], torch.Tensor], after_step: Callable[[], None], clock: Clock,
    record_outputs: bool = False, replace_outputs: OutputFlags | None = None,
) -> tuple[list[float], list[float], OutputFlags, float]:
    """One instrumented step (`_InstrumentedStep`, which takes the last two arguments): per-layer
    forward and backward ms, unscaled, the output flags recorded, and how many times its marks' span the
    step reads by the plain step's clock (`Clock.step_ms`: 1 on a CPU; on a GPU the host's time until the
    device is done over the events' span). A loss that needs no gradient (nothing to differentiate) gives
    no backward time."""
    step = _InstrumentedStep(layers, clock, record_outputs, replace_outputs)
    try:
        with _gc_paused():
            began_s = time.perf_counter()
            step.fwd_marks[0] = clock.mark()
            loss = run_step()
            step.fwd_marks[-1] = clock.mark()
            step.hook_backward(loss)
            backward_start = clock.mark()
            if loss.requires_grad:
                loss.backward()
            backward_end = clock.mark()
            del loss
    finally:
        step.remove()
    clock.synchronize()
    wall_ms = (time.perf_counter() - began_s) * 1e3
    after_step()
    span_ms = clock.elapsed_ms(step.fwd_marks[0], backward_end)
    stretch = clock.step_ms(step.fwd_marks[0], backward_end, wall_ms) / span_ms if span_ms > 0 else 1.0
    forward_ms = _segment_ms(clock, _fill_forward(step.fwd_marks))
    return forward_ms, step.backward_ms(backward_start, backward_end), step.output_flags, stretch


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


def measured_iterations(iters: int, min_seconds: float, pace_s: float) -> int:
    """How many iterations to measure: `iters`, or as many as fill `min_seconds` at `pace_s` seconds
    each (the first one's time), at most MAX_ITERS_FACTOR x iters."""
    return min(max(iters, math.ceil(min_seconds / max(pace_s, 1e-9))), MAX_ITERS_FACTOR * iters)


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
    stretches: list[float] = []  # per instrumented step: its `Clock.step_ms` over its marks' span
    forward_shares: list[float] = []  # per plain step: its forward's share of its time

    def plain() -> tuple[float, float]:
        with _gc_paused():
            began_s = time.perf_counter()
            start = clock.mark()
            loss = run_step()
            middle = clock.mark()
            forward_wall_ms = (time.perf_counter() - began_s) * 1e3
            loss.backward()
            end = clock.mark()
            del loss
        clock.synchronize()
        wall_ms = (time.perf_counter() - began_s) * 1e3
        after_step()
        whole_ms = clock.step_ms(start, end, wall_ms)
        return whole_ms, min(clock.step_ms(start, middle, forward_wall_ms), whole_ms)

    def measured() -> tuple[list[float], list[float], float]:
        fwd, bwd, _, stretch = _instrumented_ms(layers, run_step, after_step, clock)
        return fwd, bwd, stretch

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
                step_ms, forward_ms = plain()
                fwd, bwd, stretch = measured()
            else:
                fwd, bwd, stretch = measured()
                step_ms, forward_ms = plain()
            step_samples.append(step_ms)
            forward_shares.append(forward_ms / step_ms if step_ms > 0 else 0.0)
            fwd_samples.append(fwd)
            bwd_samples.append(bwd)
            stretches.append(stretch)
            if iteration == warmup and min_seconds > 0:  # the first measured iteration sets the pace
                total = warmup + measured_iterations(iters, min_seconds, time.perf_counter() - began)
        iteration += 1
        if progress is not None:
            progress(iteration, total)
    fwd_ms = [statistics.median(column) for column in zip(*fwd_samples)]
    bwd_ms = [statistics.median(column) for column in zip(*bwd_samples)]
    step_ms = statistics.median(step_samples)
    # The layers' medians keep each layer's share within its phase, and each phase is scaled to add up to its
    # share of the plain step, what training takes (`phase_scales`). The instrumentation's cost is reported as median(instrumented_k / plain_k), both
    # read by the plain step's clock (the layers' sum stretched as that clock read the step's span):
    # the machine's drift over seconds cancels within a pair, not between medians of each kind.
    totals = [(sum(fwd) + sum(bwd)) * stretch for fwd, bwd, stretch in zip(fwd_samples, bwd_samples, stretches)]
    ratio = statistics.median(total / plain for total, plain in zip(totals, step_samples) if plain > 0)
    forward_share = statistics.median(forward_shares)
    medians_sum = sum(fwd_ms) + sum(bwd_ms)
    fwd_scale, bwd_scale = phase_scales(sum(fwd_ms), sum(bwd_ms), step_ms, forward_share)
    return StepTimes(
        fwd_ms=[ms * fwd_scale for ms in fwd_ms],
        bwd_ms=[ms * bwd_scale for ms in bwd_ms],
        step_ms=step_ms,
        instrumented_ratio=ratio,
        forward_share=forward_share,
        instrumented_forward_share=sum(fwd_ms) / medians_sum if medians_sum > 0 else 0.0,
    )


def phase_scales(fwd_sum_ms: float, bwd_sum_ms: float, step_ms: float, forward_share: float) -> tuple[float, float]:
    """The factors that scale the instrumented layers' forward and backward medians (summing to `fwd_sum_ms`
    and `bwd_sum_ms`) to the plain step: forwards to `forward_share x step_ms`, backwards to the rest, so
    that each phase carries its own share of the instrumentation's cost (the backward's node hooks cost more
    host time than the forward's layer hooks: on a launch-bound H100, one factor for both gave the gpt
    example's forwards 0.73x the plain step's forward, which training then measured at 0.98x of the
    forwards scaled this way). Where a phase measured nothing, one factor
    `step_ms / (fwd_sum_ms + bwd_sum_ms)` scales both."""
    total = fwd_sum_ms + bwd_sum_ms
    if fwd_sum_ms <= 0 or bwd_sum_ms <= 0:
        scale = step_ms / total if total > 0 else 1.0
        return scale, scale
    return forward_share * step_ms / fwd_sum_ms, (1.0 - forward_share) * step_ms / bwd_sum_ms


@contextlib.contextmanager
def frozen(parameters: Iterable[torch.Tensor]) -> Any:
    """Every parameter with `requires_grad=False` for the duration; each gets its own flag back
    afterwards, also on error."""
    flags = [(parameter, parameter.requires_grad) for parameter in parameters]
    try:
        for parameter, _ in flags:
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter, flag in flags:
            parameter.requires_grad_(flag)


def _paired_iterations(
    warm_up: Callable[[], bool], pair: Callable[[int], T], iters: int,
    progress: Callable[[int, int], None] | None, min_seconds: float,
) -> list[T]:
    """The iteration rule of `time_input_gradients` and `time_split_backward`: `warm_up()` once (not
    counted; returning False stops there, with nothing measured), then `pair(k)` for k = 1, 2, ...
    `iters` times, or more while they take less than `min_seconds` at the first pair's pace (at most
    MAX_ITERS_FACTOR x iters, `measured_iterations`); `pair(k)` alternates which of its two steps goes
    first by k's parity. `progress(done, total)` after every iteration, the warm-up included. Returns
    the pairs' results."""
    results: list[T] = []
    total = 1 + iters
    iteration = 0
    while iteration < total:
        began = time.perf_counter()
        if iteration == 0:
            if not warm_up():
                total = 1
        else:
            results.append(pair(iteration))
            if iteration == 1 and min_seconds > 0:
                total = 1 + measured_iterations(iters, min_seconds, time.perf_counter() - began)
        iteration += 1
        if progress is not None:
            progress(iteration, total)
    return results


def time_input_gradients(
    layers: Sequence[Layer],
    run_step: Callable[[], torch.Tensor],
    after_step: Callable[[], None],
    clock: Clock,
    parameters: Iterable[torch.Tensor],
    bwd_ms: Sequence[float],
    iters: int = INPUT_GRADIENT_ITERS,
    progress: Callable[[int, int], None] | None = None,
    min_seconds: float = 0.0,
) -> list[float]:
    """Per layer, the ms of `bwd_ms[i]` (from `time_layers`) that computing its inputs' gradients takes
    (see the module docstring): `bwd_input_ms[i] = bwd_ms[i] x median_k(input_k[i] / full_k[i])`,
    clamped to [0, bwd_ms[i]]; a layer whose backward took no time gets 0.

    Each of `iters` iterations (or more, while they take less than `min_seconds`, as in
    `time_layers`) pairs an instrumented step with `parameters` frozen (input_k: its per-layer
    backward; every flag is restored after it, also on error) with a normal instrumented step
    (full_k), alternating which goes first. A warm-up iteration comes first: a normal step that
    records which layer outputs need a gradient, and a frozen one. `after_step` runs after every
    step; `progress(done, total)` after every iteration.

    Why ratios within pairs rather than the frozen steps' own medians times `time_layers`'s backward scale
    factor: these steps come after `time_layers`'s, and the machine's speed drifts by several
    percent over seconds, which a ratio of two steps run back to back cancels. Multiplying by
    `bwd_ms` puts the result in its units (shares of the plain step), and `bwd_ms[i] - bwd_input_ms[i]`
    is the weights' part.
    """
    parameters = list(parameters)
    output_flags: OutputFlags = [None] * len(layers)  # set by the warm-up's normal step

    def input_only() -> list[float]:
        with frozen(parameters):
            return _instrumented_ms(layers, run_step, after_step, clock, replace_outputs=output_flags)[1]

    def full() -> list[float]:
        return _instrumented_ms(layers, run_step, after_step, clock)[1]

    def warm_up() -> bool:  # which outputs need a gradient, and the frozen step's first run
        output_flags[:] = _instrumented_ms(layers, run_step, after_step, clock, record_outputs=True)[2]
        input_only()
        return True

    def pair(iteration: int) -> list[float]:
        if iteration % 2 == 0:
            inputs, whole = input_only(), full()
        else:
            whole, inputs = full(), input_only()
        return [part / all_ms if all_ms > 0 else 0.0 for part, all_ms in zip(inputs, whole)]

    shares = _paired_iterations(warm_up, pair, iters, progress, min_seconds)
    medians = [statistics.median(column) for column in zip(*shares)] if shares else [0.0] * len(bwd_ms)
    return [ms * min(max(share, 0.0), 1.0) for ms, share in zip(bwd_ms, medians)]


class StageInput:
    """A forward hook on a layer's module that, at its first call in a step, replaces the floating-point
    tensors of its output that need a gradient by copies of grad-requiring leaves (`requiring_grad` with
    `cut`): the layers after it run as a pipeline stage that received them. `leaves`: this step's new
    leaves. Call `reset()` before each step and `remove()` when done."""

    def __init__(self, layer: Layer) -> None:
        self.leaves: list[torch.Tensor] = []
        self._called = False
        self._handle = layer.module.register_forward_hook(self._hook)

    def reset(self) -> None:
        """Forget the previous step's leaves: the next call replaces again."""
        self.leaves = []
        self._called = False

    def remove(self) -> None:
        """Remove the hook."""
        self._handle.remove()

    def _hook(self, _module: Any, _args: Any, output: Any) -> Any:
        if self._called:
            return None
        self._called = True
        replaced = requiring_grad(output, needs_grad_flags(output), cut=True, new_leaves=self.leaves)
        return None if replaced is output else replaced


def time_split_backward(
    layers: Sequence[Layer],
    run_step: Callable[[], torch.Tensor],
    after_step: Callable[[], None],
    clock: Clock,
    parameters: Iterable[torch.Tensor],
    iters: int = INPUT_GRADIENT_ITERS,
    progress: Callable[[int, int], None] | None = None,
    min_seconds: float = 0.0,
) -> float:
    """How much longer a backward takes split into B and W (`planner.profiling.backward_split`) than
    run whole: `split_backward_ratio = median_k(split_k / plain_k)` over pairs of steps.

    Every step runs the forward with the first layer's floating-point outputs that need a gradient
    replaced by copies of grad-requiring leaves (`StageInput`), so that the layers after it form a
    stage that received them, as every stage after a pipeline's first does. Then the split step runs
    `backward_inputs([loss], [None], leaves, parameters)` and `backward_weights`; the plain step
    `loss.backward()`: both differentiate the same graph, so the ratio is the split's own cost (B's
    bookkeeping, a second pass, boundary nodes without a weight formula run twice, products in another order). Only the backward is
    timed, from after the loss until the graph and gradients of the step are dropped, with `clock`.
    Pairs alternate which step goes first; one warm-up pair, then `iters` pairs or more while they
    take less than `min_seconds` (`_paired_iterations`, as `time_input_gradients`); `after_step` runs
    after every step, `progress(done, total)` after every pair. The ratio is reported as measured,
    not clamped: noise can put it slightly below 1. A model of one layer, or whose first layer
    returns nothing that needs a gradient (nothing to replace), gives 1.0.
    """
    if len(layers) < 2:
        return 1.0
    parameters = [parameter for parameter in parameters if parameter.requires_grad]
    stage = StageInput(layers[0])

    def backward_ms(split: bool) -> tuple[float, bool]:
        """One step: its backward's ms, and whether the first layer's output was replaced."""
        stage.reset()
        with _gc_paused():
            loss = run_step()
            start = clock.mark()
            replaced = bool(stage.leaves) and loss.requires_grad
            if replaced and split:
                grads, pending = backward_inputs([loss], [None], stage.leaves, parameters)
                backward_weights(pending)
                del grads, pending
            elif replaced:
                loss.backward()
            del loss
            stage.reset()  # the leaves and their gradients go with the graph, inside the timed part
            end = clock.mark()
        clock.synchronize()
        after_step()
        return clock.elapsed_ms(start, end), replaced

    def warm_up() -> bool:
        _, replaced = backward_ms(split=True)
        return replaced and backward_ms(split=False)[1]

    def pair(iteration: int) -> float:
        if iteration % 2 == 0:
            split, plain = backward_ms(split=True)[0], backward_ms(split=False)[0]
        else:
            plain, split = backward_ms(split=False)[0], backward_ms(split=True)[0]
        return split / plain if plain > 0 else math.nan

    try:
        ratios = [ratio for ratio in _paired_iterations(warm_up, pair, iters, progress, min_seconds)
                  if not math.isnan(ratio)]
    finally:
        stage.remove()
    return statistics.median(ratios) if ratios else 1.0
