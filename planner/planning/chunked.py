"""Plans of a chunked schedule: the model in p x v chunks of one device each, on p ranks (pure).

The optimizer (`optimizer.optimize`) cuts one contiguous stage per rank; under a chunked schedule rank r
holds non-contiguous chunks (`stage_placement`: interleaved-1f1b r, r + p, ...; zbv r and 2p - 1 - r), so
its work is a sum over chunks spread along the model.
Here the chunks are cut to balance forward + backward time (`even_chunks`: the least largest chunk,
exactly p v of them; then `balance_ranks` moves cuts while that unloads the busiest rank, with zbv's first
chunk's backward whole, as the engine runs it), for each
number of chunks per rank in CHUNK_CHOICES (zbv: 2), and the plans are judged
by the simulator (`simulate_stages`), whose timeline also gives each device's memory (its chunks
together), checked against the limit; the plan finally chosen has its cuts moved one layer at a time
while its simulated iteration shortens (`refine_chunked`, within a budget of simulated ops). A
heuristic: no bound proves that another cut is not faster.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from planner.costs.layer_arrays import LayerArrays
from planner.costs.schedule_cost import CostInputs, Stage
from planner.planning.local_search import REFINE_OPS, cut_moves, descend, simulated_ops
from planner.schedules.schedule import FIXED_CHUNKS, SPLIT_BACKWARD_SCHEDULES, stage_placement
from planner.simulation.simulator import simulate_stages, simulated_iteration_s

CHUNK_CHOICES = (2, 3, 4)  # chunks per rank tried (1 is 1f1b)


@dataclass(frozen=True)
class ChunkedChoice:
    """The fastest chunked plan found: its inputs (with `chunks`), stages, simulated iteration (s) and the
    most bytes any device holds (all its chunks together)."""

    inputs: CostInputs
    stages: tuple[Stage, ...]
    iteration_s: float
    peak_bytes: tuple[float, ...]  # per stage: the peak of the device holding it


def even_chunks(arrays: LayerArrays, count: int) -> list[tuple[int, int]]:
    """`count` contiguous layer ranges [start, stop) covering the model whose largest forward + backward time
    is as small as possible; needs 1 <= count <= layers.

    A range ending as late as the bound allows, from the left, gives the fewest ranges under a bound
    (greedy); the least bound with at most `count` ranges is found by bisection to a relative 1e-9 of
    the whole model's time, and ranges of two or more layers are then halved (longest first) until
    there are `count`: halving a range never raises the largest.
    """
    n = arrays.num_layers
    if not 1 <= count <= n:
        raise ValueError(f"cannot cut {n} layers into {count} chunks")
    prefix = np.maximum.accumulate(arrays.compute_s)  # times are not negative; guard rounding
    total = float(prefix[-1])

    def greedy(bound: float) -> list[tuple[int, int]] | None:
        ranges, start = [], 0
        while start < n:
            stop = int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1
            stop = min(max(stop, start), n)
            if stop == start:
                return None
            ranges.append((start, stop))
            start = stop
        return ranges

    low, high = 0.0, total
    best = greedy(high + 1e-12 * max(total, 1.0)) or [(0, n)]
    for _ in range(200):
        if high - low <= 1e-9 * max(total, 1e-30):
            break
        middle = (low + high) / 2
        found = greedy(middle)
        if found is not None and len(found) <= count:
            best, high = found, middle
        else:
            low = middle
    while len(best) < count:
        longest = max((r for r in best if r[1] - r[0] >= 2), key=lambda r: (r[1] - r[0], -r[0]))
        at = best.index(longest)
        middle = (longest[0] + longest[1]) // 2
        best[at:at + 1] = [(longest[0], middle), (middle, longest[1])]
    return best


def balance_ranks(arrays: LayerArrays, ranges: list[tuple[int, int]], ranks: int,
                  schedule: str = "interleaved-1f1b") -> list[tuple[int, int]]:
    """`ranges` with their boundaries moved one layer at a time while that lowers the busiest rank's time
    (range k runs on rank `stage_placement(schedule, ...)[k]`; ties: the lower sum of squared rank times): a
    chunk cut evenly can leave one rank with a large indivisible layer (a language model's head) on top of its share.
    A rank's time is the sum of its ranges' forward + backward seconds; under a zero-bubble schedule the first
    range's backward counts whole (`LayerArrays.first_stage_unsplit`: the engine's first chunk has no input
    gradient, so its backward is not split), the others' split as `arrays` carry them.
    Local search, at most 50 passes over the boundaries; every range keeps at least one layer."""
    cuts = [start for start, _ in ranges[1:]]
    n = arrays.num_layers
    times = arrays.compute_s
    placement = stage_placement(schedule, len(ranges), len(ranges) // ranks)
    unsplit = schedule in SPLIT_BACKWARD_SCHEDULES and arrays.split_applied != 1.0
    first_s = arrays.first_stage_unsplit(np.arange(n + 1))[0] if unsplit else times  # [0, stop) at each stop

    def score(points: list[int]) -> tuple[float, float]:
        load = [0.0] * ranks
        edges = [0, *points, n]
        for index, (start, stop) in enumerate(zip(edges, edges[1:])):
            load[placement[index]] += float((first_s if index == 0 else times)[stop] - times[start])
        return max(load), sum(value * value for value in load)

    best = score(cuts)
    for _ in range(50):
        improved = False
        for at in range(len(cuts)):
            low = cuts[at - 1] + 1 if at > 0 else 1
            high = cuts[at + 1] - 1 if at + 1 < len(cuts) else n - 1
            for moved in (cuts[at] - 1, cuts[at] + 1):
                if low <= moved <= high:
                    trial = cuts[:at] + [moved] + cuts[at + 1:]
                    found = score(trial)
                    if found < best:
                        cuts, best, improved = trial, found, True
        if not improved:
            break
    edges = [0, *cuts, n]
    return list(zip(edges, edges[1:]))


def chunk_choices(schedule: str) -> tuple[int, ...]:
    """The chunks per rank a plan of `schedule` may have: zbv's fixed 2, else CHUNK_CHOICES."""
    return (FIXED_CHUNKS[schedule],) if schedule in FIXED_CHUNKS else CHUNK_CHOICES


def best_chunked(inputs: CostInputs, ranks: int) -> ChunkedChoice | None:
    """The fastest simulated plan of `inputs` (a chunked schedule) on `ranks` devices (one per chunk's rank)
    over the chunk counts (`chunk_choices`) that the layers allow, within the memory limit; None if none fits."""
    found: ChunkedChoice | None = None
    for chunks in chunk_choices(inputs.schedule):
        if ranks * chunks > inputs.arrays.num_layers or not chunked_count_ok(inputs.schedule, inputs.microbatches,
                                                                                ranks):
            continue
        chunked = dataclasses.replace(inputs, chunks=chunks)
        ranges = balance_ranks(inputs.arrays, even_chunks(inputs.arrays, ranks * chunks), ranks, inputs.schedule)
        choice = _judged(chunked, tuple(Stage(start, stop, 1, False) for start, stop in ranges))
        if choice is not None and (found is None or choice.iteration_s < found.iteration_s * (1.0 - 1e-9)):
            found = choice
    return found


def _judged(inputs: CostInputs, stages: tuple[Stage, ...], memory: bool = True) -> ChunkedChoice | None:
    """`stages` simulated: their iteration and each device's peak memory; None beyond the memory limit.
    `memory=False` without a limit leaves the peaks out (empty): reading them from the timeline costs as much
    as the simulation."""
    if not memory and inputs.memory_bytes is None:
        return ChunkedChoice(inputs, stages, simulated_iteration_s(inputs, list(stages)), ())
    timeline = simulate_stages(inputs, list(stages))
    peaks = timeline.peak_memory()
    peak_bytes = tuple(float(peaks[stage]) for stage in range(len(stages)))
    if inputs.memory_bytes is not None and max(peak_bytes) > inputs.memory_bytes:
        return None
    return ChunkedChoice(inputs, stages, timeline.iteration_s(), peak_bytes)


def refine_chunked(choice: ChunkedChoice, budget_ops: int = REFINE_OPS) -> ChunkedChoice:
    """`choice` with its cuts moved one layer at a time while that shortens the simulated iteration (within
    the memory limit; `local_search.descend` over `cut_moves` of one layer): the rank-balanced cut leaves a
    pipeline's path uneven (a V's first and last chunks share rank 0; a heavy head's chunk ends every
    microbatch). Never slower than `choice`; deterministic."""
    def judge(stages: tuple[Stage, ...]) -> float | None:
        trial = _judged(choice.inputs, stages, False)
        return None if trial is None else trial.iteration_s

    stages, _ = descend(choice.stages, choice.iteration_s, lambda plan: cut_moves(plan, (-1, 1)), judge, budget_ops,
                        lambda plan: simulated_ops(choice.inputs, plan), resume=False)
    if stages == choice.stages and (choice.peak_bytes or choice.inputs.memory_bytes is not None):
        return choice
    judged = _judged(choice.inputs, stages)  # the peaks read once, at the end
    assert judged is not None
    return judged


def chunked_count_ok(schedule: str, microbatches: int, ranks: int) -> bool:
    """Whether `schedule` runs `microbatches` on `ranks` ranks: interleaved-1f1b needs a multiple of p (it
    runs them in groups of one per rank); zbv runs any count."""
    return schedule != "interleaved-1f1b" or microbatches % ranks == 0


def chunked_counts(schedule: str, counts: tuple[int, ...], ranks: int, auto: bool) -> tuple[int, ...]:
    """The microbatch counts a plan of `schedule` on `ranks` ranks may use: those of `counts` it runs
    (`chunked_count_ok`); interleaved-1f1b under --microbatches auto without a global batch, p x 1, 2, 4, ...
    up to max(128, p)."""
    if auto and schedule == "interleaved-1f1b":
        return tuple(ranks * 2**k for k in range(int(math.log2(max(128 // ranks, 1))) + 1))
    return tuple(count for count in counts if chunked_count_ok(schedule, count, ranks))
