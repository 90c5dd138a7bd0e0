"""The optimizer's final choice under the simulator: plans in order of a lower bound on their simulated time (pure).

The dynamic program (`optimizer.optimize`) minimises the closed form of `schedule_cost`, which leaves
out what only a whole plan decides: transfers during fill and drain, the all-reduce of tied weights,
gpipe's separate forward and backward phases, 1F1B's warm-up overlap, pipedream's round trips. Plans
state the simulated time, so the plan to choose is the one the simulator finds fastest.
`best_simulated` finds it by best-first search over plans built from the last stage backwards,
ordered by a lower bound on their simulated time, simulating each complete plan, until no plan left
can beat the best simulated one (then the choice is exact: `exhaustive`) or a cap on the work is hit
(the best simulated so far, never worse than the plans it was seeded with).

Lower bound (seconds) of stage s = layers [i, j) with r replicas, n = ceil(m / r) microbatches on its
busiest replica, k of them in flight (`schedule.in_flight`), terms t = f + b, c_in, c_out, ar, opt, acc
of `schedule_cost.stage_cost`, F = sigma fwd_s[i] and B = sigma (compute_s[i] - fwd_s[i]) the forward
and backward of the layers before it, and D the round trip of one microbatch from the stage's output
back to it (the later stages' t and twice their input messages), so that a loop is L = t + D:

    flush:     LB(s) = F + max(n t + (n - 1) acc + max(ar + opt, B), n c_in + B, n c_out + B)
               LB(s) = F + B + 2 c_in + ceil(n / k) L
               LB(s) = F + c_in + f + D + n (t - f) + (n - k) f + (n - 1) acc + max(ar + opt, c_in + B)
                       (zero-bubble: + ar + opt alone, its last op a W)
    pipedream: LB(s) = max(t + opt, L / k) / r

(flush: the busiest replica cannot start before its first microbatch's forward through the layers
before it, runs n forwards and backwards, or sends n messages on one channel, and after that either
all-reduces and steps or waits for the backwards before it; a replica starts microbatch q + k only after
the backward of q, so its microbatches form chains of ceil(n / k) loops; it runs k forwards before its
first backward, which waits for its first microbatch's way down and back (f + D), and all its other ops
after that; pipedream: the steady state of a replica's compute, and of its k microbatches in flight, each
needing a loop.) A flush plan also takes at least one microbatch's round trip T = sum_s t(s) + 2 sum of
the boundary transfers.

Straight plans (one device per stage; m microbatches) add flow-shop bounds (`_path_bound`):
gpipe T + (m - 1)(max_s f_s + max_s b_s + acc), 1f1b T + (m - 1)(b_s + acc) + (m - k_s) f_s per stage,
and for the layers before a partial plan, T + (m - 1) h with h the least bottleneck any split of them
onto the ranks left can have (`_StageBounds.prefix_turns`, a small dynamic program), and for 1f1b and zb-h1
T + the least over such splits of the largest max((m - 1) b_s + (m - k_s) f_s, (m - 1) c_in), k_s known from each rank
(`_StageBounds._prefix_path`: PipeDream's densenet121 straight on 4 GPUs, 1f1b, at most x1.149 -> x1.079
from the best), and for zb-h1 the least over such splits of the largest of a weaker form of the third flush
bound above for one of their stages, F + f + D' + m (t - f) + (m - k) f with D' the later layers' forwards and
B's alone (no messages, accumulation, all-reduce or step), which depends on the stage and its rank alone
(`_prefix_waited`: with equal F = B = W per stage and m >= p it is the schedule's m (F + B + W) + (p - 1)
(F + B - W), the first stage's; the zb-h1 plans of `benchmarks/model_agreement.py` proven within 2% went from
50 to 55 of 108 with it).

A partial plan's bound is the largest of its stages' (and of these for the layers before it, whose
stages are not chosen yet: their sums spread over the devices left, their largest layer): adding
stages never lowers it, so the search can prune on it, and the smallest bound left when the search
stops bounds every plan it did not simulate (`SimulatedChoice.lower_bound_s`).

zb-h1 sends a gradient back after B and runs W later: in its bounds a round trip and the chains of
loops count B alone (t - W), each stage's own W where it must come (after its last B, side by side
with the trip back), and the flow-shop bound b_s = B_s (with the forwards' 1f1b order); a device's share
of the layers not yet placed counts their W's (every W runs within the iteration on some device: with B
alone, 33 of the 108 plans of `benchmarks/model_agreement.py` were proven within 2%, with W 49); the
brute-force test covers it as the other flush schedules. A first stage runs its backward whole there
(`schedule_cost.first_terms`): the sums of the layers before a stage take each layer's lesser way back
(split B, or its share of an unsplit backward), whichever stage it will lie in. pipedream's simulated time
is measured on a window of a finite run (`Timeline.iteration_s`), which can end before the pipeline settles
into its steady state and so read below the steady-state bounds above: for pipedream the search is a
heuristic that proves nothing (`exhaustive` False, lower bound 0).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from planner.costs.schedule_cost import (
    CostInputs,
    Stage,
    StageMemo,
    accumulate_terms,
    allreduce_s,
    allreduce_terms,
    backward_top_terms,
    both_terms,
    deferred_terms,
    link_terms,
    memory_terms,
    placement_ok,
    plan_fits,
    received_terms,
    reduce_terms,
    replicas_of,
    step_terms,
    transfer_s,
    weight_terms,
)
from planner.planning.bound_search import TIE
from planner.planning.optimizer import recompute_options
from planner.schedules.schedule import SPLIT_BACKWARD_SCHEDULES, in_flight
from planner.simulation.simulator import SimulationTooLongError, simulated_iteration_s

MAX_SIMULATIONS = 48  # complete plans simulated per search, beyond the seeds
MAX_EXPANSIONS = 400  # partial plans extended per search
PREFIX_TABLE_CELLS = 4e7  # the straight prefix bound's table (devices x layers^2) is built up to this size

# schedules whose simulated time the bounds do not bound: pipedream (they hold for the steady state, not for the
# simulator's window)
HEURISTIC_SCHEDULES = ("pipedream",)

_Partial = tuple[float, int, int, int, float, tuple[float, float], tuple[Stage, ...]]


@dataclass(frozen=True)
class SimulatedChoice:
    """The chosen plan, its simulated seconds (iteration, or per microbatch for pipedream), whether the
    search proved no plan simulates faster (`exhaustive`), and how many plans it simulated."""

    stages: tuple[Stage, ...]
    simulated_s: float
    exhaustive: bool
    simulated: int
    lower_bound_s: float  # no plan simulates faster than this (= simulated_s when exhaustive; 0 for pipedream)

    @property
    def gap(self) -> float:
        """How much faster the best plan could still be: simulated_s / lower_bound_s (1.0 when exhaustive,
        inf when nothing is proven)."""
        return self.simulated_s / self.lower_bound_s if self.lower_bound_s > 0 else math.inf


def better(plan: Sequence[Stage], plan_s: float, than: Sequence[Stage], than_s: float) -> bool:
    """Whether `plan` (simulating `plan_s` seconds) is better than `than`: faster by more than a relative TIE, or
    as fast within TIE on fewer devices."""
    return plan_s < than_s * (1.0 - TIE) or (
        plan_s <= than_s * (1.0 + TIE) and sum(replicas_of(plan)) < sum(replicas_of(than)))


def simulated_s(inputs: CostInputs, stages: list[Stage], memo: StageMemo | None = None) -> float:
    """What a plan states as its time: the simulated iteration (flush) or steady-state time per
    microbatch (pipedream); inf when a pipedream plan's replica counts make simulation too long. `memo`: as in
    `schedule_cost.stage_costs`, for the plans of one search."""
    try:
        return simulated_iteration_s(inputs, stages, memo)
    except SimulationTooLongError:
        return math.inf


def best_simulated(inputs: CostInputs, seeds: list[list[Stage]], straight: bool, allow_recompute: bool,
                   max_simulations: int = MAX_SIMULATIONS, max_expansions: int = MAX_EXPANSIONS) -> SimulatedChoice:
    """The plan of least simulated time among every plan the optimizer may return (contiguous stages,
    replicas unless `straight`, recompute where allowed and a memory limit is set, within memory and
    the placement rule), by the module docstring's search; `seeds` (plans that fit, e.g. the dynamic
    program's) are simulated first. Ties within a relative TIE go to the fewest devices."""
    best: tuple[float, tuple[Stage, ...]] | None = None
    simulations = 0
    memo: StageMemo = {}

    def consider(stages: tuple[Stage, ...]) -> None:
        nonlocal best, simulations
        value = simulated_s(inputs, list(stages), memo)
        simulations += 1
        if best is None or better(stages, value, best[1], best[0]):
            best = (value, stages)

    for seed in seeds:
        consider(tuple(Stage(*stage) for stage in seed))
    assert best is not None, "best_simulated needs at least one seed plan"
    seeded = simulations
    bounds = _StageBounds(inputs, straight, allow_recompute)
    order = itertools.count()
    # (bound, order, start of the partial plan, its devices, its round trip, its peaks (f, b), its stages)
    root: _Partial = (0.0, next(order), inputs.arrays.num_layers, 0, 0.0, (0.0, 0.0), ())
    heap: list[_Partial] = [root]
    expansions, exhaustive = 0, False
    while heap:
        partial = heapq.heappop(heap)
        bound, _, stop, downstream, trip, peaks, stages = partial
        if bound > best[0] * (1.0 + TIE):
            exhaustive = True
            break
        if stop == 0:
            if simulations - seeded >= max_simulations:
                heapq.heappush(heap, partial)
                break
            if plan_fits(inputs, list(stages)):
                consider(stages)
            continue
        if expansions >= max_expansions:
            heapq.heappush(heap, partial)
            break
        expansions += 1
        for start, replicas, recompute, child_bound, child_trip, child_peaks in bounds.children(
                stop, downstream, bound, trip, peaks, best[0] * (1.0 + TIE)):
            heapq.heappush(heap, (child_bound, next(order), start, downstream + replicas, child_trip, child_peaks,
                                  (Stage(start, stop, replicas, recompute),) + stages))
    else:
        exhaustive = True
    lower = best[0] if exhaustive else min(best[0], heap[0][0])
    if inputs.schedule in HEURISTIC_SCHEDULES:
        exhaustive, lower = False, 0.0
    return SimulatedChoice(best[1], best[0], exhaustive, simulations, lower)


@dataclass(frozen=True)
class _Placements:
    """Where a stage can go before a partial plan on a given number of devices, a row per replica count
    (ascending) that the placement rule allows: its replicas, the links in and out and the all-reduce's
    (bandwidth, latency), the microbatches in flight, and its first rank, which is the count of devices left
    before it."""

    replicas: np.ndarray
    link_in: tuple[np.ndarray, np.ndarray]
    link_out: tuple[np.ndarray, np.ndarray]
    allreduce_link: tuple[np.ndarray, np.ndarray]
    flights: np.ndarray
    first: np.ndarray


class _StageBounds:
    """The module docstring's lower bounds of every stage ending at a layer, element-wise over its start."""

    def __init__(self, inputs: CostInputs, straight: bool, allow_recompute: bool) -> None:
        self.inputs, self.straight = inputs, straight
        self.options = recompute_options(inputs, allow_recompute)
        arrays, sigma = inputs.arrays, inputs.scale
        self.split = inputs.schedule in SPLIT_BACKWARD_SCHEDULES
        # zero-bubble schedules: a microbatch's trip and the chains of ops below count B alone (W runs later,
        # off the trip); `weight` is 0 elsewhere, so `backward` below is the whole backward there
        weight = sigma * arrays.weight_s if self.split else np.zeros_like(arrays.compute_s)
        layer_fwd = sigma * np.diff(arrays.fwd_s)
        layer_back = sigma * np.diff(arrays.compute_s - arrays.fwd_s) - np.diff(weight)  # on a microbatch's way back
        layer_work = sigma * np.diff(arrays.compute_s)  # every op a device runs, W included
        everywhere = np.arange(arrays.num_layers + 1)
        first_both = both_terms(inputs, np.zeros_like(everywhere), everywhere)
        # a zero-bubble first stage runs its backward unsplit (`schedule_cost.first_terms`), B then W at once, both
        # on the way back: a layer before a stage counts the lesser of its two ways, in whichever stage it lies
        self.first_back = first_both - sigma * arrays.fwd_s - weight_terms(inputs, np.zeros_like(everywhere),
                                                                            everywhere)  # B of stages from layer 0
        if not np.array_equal(first_both, sigma * arrays.compute_s):
            layer_back = np.minimum(layer_back, np.diff(first_both - sigma * arrays.fwd_s))
            layer_work = np.minimum(layer_work, np.diff(first_both))
        self.weight = weight
        self.fwd_before = sigma * arrays.fwd_s
        self.bwd_before = np.concatenate([[0.0], np.cumsum(layer_back)])
        self.compute_before = self.fwd_before + self.bwd_before
        self.work_before = np.concatenate([[0.0], np.cumsum(layer_work)])
        self.cut = sigma * np.concatenate([arrays.cut_bytes, [0.0]])
        # the largest single layer's forward, backward and both among layers [0, i), at index i
        self.layer_fwd_before, self.layer_bwd_before, self.layer_both_before, self.layer_work_before = (
            np.concatenate([[0.0], np.maximum.accumulate(values)])
            for values in (layer_fwd, layer_back, layer_fwd + layer_back, layer_work))
        # 1f1b and zb-h1 bound the layers not yet placed by their path table alone: it is at least (m - 1) times the
        # bottleneck table's value (so with it the other adds nothing, and costs as much to build)
        path = straight and inputs.schedule in ("1f1b", "zb-h1") and inputs.microbatches > 1
        self.path_table = self._build_path_table() if path else None
        self.waited_table = self._build_waited_table() if path and self.split else None
        self.prefix_table = self._build_prefix_table() if straight and not path else None
        self.placements: dict[int, _Placements | None] = {}  # `children`'s, per devices after the stage

    def children(self, stop: int, downstream: int, bound: float, trip: float, peaks: tuple[float, float],
                 limit: float) -> list[tuple[int, int, bool, float, float, tuple[float, float]]]:
        """(start, replicas, recompute, bound, round trip so far, peaks) of every stage [start, stop) that can go
        before a partial plan starting at `stop` on `downstream` devices, fits and whose bound is at most `limit`;
        peaks are the partial plan's largest forward and backward (with accumulation) per stage and message.
        In the order replicas, recompute flag, start (the search's ties follow it). Every replica count at once:
        a row per count, a column per start."""
        inputs, arrays, sigma = self.inputs, self.inputs.arrays, self.inputs.scale
        if downstream not in self.placements:
            self.placements[downstream] = self._placements(downstream)
        placement = self.placements[downstream]
        if placement is None:
            return []
        replicas, flights, left = placement.replicas, placement.flights, placement.first
        m = inputs.microbatches
        starts = np.arange(stop)
        fwd = sigma * (arrays.fwd_s[stop] - arrays.fwd_s[starts])
        stops = np.full(stop, stop)
        both = both_terms(inputs, starts, stops)
        weights = arrays.pair_weight_bytes(starts, stops)
        frozen = arrays.pair_frozen_bytes(starts, stops)
        replicated = arrays.pair_replicated_bytes(starts, stops)
        tied = arrays.pair_tied_bytes(starts, stops)
        tensors = arrays.pair_tensor_counts(starts, stops)
        saved = sigma * arrays.pair_saved_bytes(starts, stops)
        workspace = sigma * np.maximum.accumulate(arrays.workspace_bytes[:stop][::-1])[::-1]
        deferred = deferred_terms(inputs, starts, stops)
        largest = arrays.largest_param_in(starts, stops)
        backward_top, weight_top = backward_top_terms(inputs, starts, stops, workspace)
        cut_in = np.where(starts > 0, self.cut[starts - 1], 0.0)
        entering = np.where(starts > 0, cut_in, sigma * inputs.input_bytes)
        comm_in = transfer_s(cut_in, *placement.link_in, starts > 0)
        comm_out = transfer_s(self.cut[stop - 1], *placement.link_out, stop < arrays.num_layers)
        allreduce = allreduce_s(replicated, replicas, *placement.allreduce_link)
        step = step_terms(inputs, weights, tensors)
        accumulate = accumulate_terms(inputs, weights)
        weight = weight_terms(inputs, starts, stops)  # W (0 but for zero-bubble schedules)
        turns = -(-m // replicas)
        prefix = self._prefix_peaks(starts, left)
        count = 1 if inputs.schedule == "pipedream" else m
        prefix_bound = count * (prefix[3] if self.straight else prefix[4])
        peak_fwd = _largest(peaks[0], fwd, comm_in, comm_out)
        shape = (len(replicas), len(self.options), stop)  # (count, flag, start)
        bounds, trips, bwd_peaks, fitting = np.empty(shape), np.empty(shape), np.empty(shape), np.empty(shape, bool)
        for option, recompute in enumerate(self.options):
            compute = both + (fwd if recompute else 0.0)
            loop = compute - weight + trip  # from the stage's forward of a microbatch to the end of its B
            if inputs.schedule == "pipedream":
                stage_bound = np.maximum(compute + step, loop / flights) / replicas
                child_trip = trip + compute + 2.0 * comm_in
                child_bound = np.maximum(bound, stage_bound)
            else:
                backward = compute - fwd - weight
                before_bwd = self.bwd_before[starts]
                busy = np.maximum(turns * compute + (turns - 1) * accumulate,  # every op of the busiest replica
                                  turns * fwd + (turns - flights) * backward + trip + backward  # its last
                                  + weight)  # microbatch (zero-bubble: and that one's W, after its B)
                channels = turns * np.maximum(comm_in, comm_out) + before_bwd
                # after its last op, the replica all-reduces and steps, or (its last op a backward) the stages
                # before it run theirs; a zero-bubble replica's last op is a W, after which only the first holds
                after = allreduce + step if self.split else np.maximum(allreduce + step, before_bwd)
                stage_bound = self.fwd_before[starts] + np.maximum(busy + after, channels)
                child_trip = trip + compute - weight + 2.0 * comm_in
                # the chain's last B, then (side by side) its W here and the trip back through the stages before
                chain = (self.fwd_before[starts] + comm_in + -(-turns // flights) * loop
                         + np.maximum(weight, comm_in + self.bwd_before[starts]))
                # the busiest replica's first B waits for its first microbatch's way down and back; all its B's
                # and W's, its other forwards and accumulations come after it, then what follows its last op
                waited = (self.fwd_before[starts] + comm_in + fwd + trip + turns * (compute - fwd)
                          + (turns - 1) * accumulate + np.maximum(turns - flights, 0) * fwd
                          + (after if self.split else np.maximum(allreduce + step, comm_in + before_bwd)))
                child_bound = _largest(bound, stage_bound, chain, waited, child_trip + self.compute_before[starts])
            child_bound = np.maximum(child_bound, prefix_bound)
            own_bwd = compute - fwd - weight + (0.0 if self.split else accumulate)  # (W accumulates, not B)
            peak_bwd = _largest(peaks[1], own_bwd, comm_in, comm_out)
            if self.straight:  # one replica count, 1
                child_bound = self._straight_bound(child_bound, child_trip, fwd, own_bwd, int(flights[0, 0]),
                                                   peak_fwd, peak_bwd, prefix, int(left[0, 0]), starts)
            ok = child_bound <= limit
            if inputs.memory_bytes is not None:
                memory = memory_terms(inputs, replicas, replicas + downstream, weights, saved, entering, recompute,
                                      workspace, deferred, frozen, backward_top, weight_top,
                                      received_terms(inputs, starts, entering), largest, cut_in,
                                      np.where(stop < arrays.num_layers, self.cut[stop - 1], 0.0),
                                      reduce_terms(replicas, replicated, tied))[4]
                ok &= memory <= inputs.memory_bytes
            bounds[:, option], trips[:, option], bwd_peaks[:, option], fitting[:, option] = (
                child_bound, child_trip, peak_bwd, ok)
        row, option, start = np.nonzero(fitting)  # in C order
        column = np.broadcast_to(peak_fwd, (len(replicas), stop))[row, start]
        return list(zip(start.tolist(), replicas[row, 0].tolist(), np.array(self.options)[option].tolist(),
                        bounds[row, option, start].tolist(), trips[row, option, start].tolist(),
                        zip(column.tolist(), bwd_peaks[row, option, start].tolist())))

    def _placements(self, downstream: int) -> _Placements | None:
        """`children`'s stage placements before a partial plan on `downstream` devices; None where none fits."""
        inputs, cluster = self.inputs, self.inputs.cluster
        devices = cluster.num_devices
        counts = np.arange(1, (1 if self.straight else devices - downstream) + 1)
        firsts = devices - downstream - counts
        placed = (firsts >= 0) & placement_ok(cluster, firsts, counts)
        if not placed.any():
            return None
        replicas, first = counts[placed][:, None], firsts[placed][:, None]
        last = first + replicas - 1
        # how many forwards run ahead of the backwards (zb-h1 orders F and B as 1f1b does)
        flights = in_flight("1f1b" if self.split else inputs.schedule, inputs.microbatches, replicas,
                            replicas + downstream)
        return _Placements(replicas, link_terms(cluster, first - 1, first), link_terms(cluster, last, last + 1),
                           allreduce_terms(cluster, first, last), flights, first)

    def _straight_bound(self, child_bound: np.ndarray, child_trip: np.ndarray, fwd: np.ndarray, own_bwd: np.ndarray,
                        flights: int, peak_fwd: np.ndarray, peak_bwd: np.ndarray, prefix: tuple[np.ndarray, ...],
                        first: int, starts: np.ndarray) -> np.ndarray:
        """`children`'s bound of a straight stage on rank `first` (the `first` ranks before it hold the layers before
        it; every rank of the cluster from it on holds one stage) with the flow-shop and prefix bounds added (module
        docstring), a row of one replica."""
        inputs, devices = self.inputs, self.inputs.cluster.num_devices
        turns = self.prefix_turns(first, starts)
        round_trip = child_trip + self.compute_before[starts]
        if inputs.schedule == "pipedream":
            return _largest(child_bound, turns, round_trip / devices)
        # in flight at the first stage (1f1b and zb-h1; gpipe's first stage runs all m before a backward)
        most = inputs.microbatches if inputs.schedule == "gpipe" else min(devices, inputs.microbatches)
        return _largest(child_bound, round_trip + _times(inputs.microbatches - 1, turns),
                        round_trip + self._prefix_path(first, starts), self._prefix_waited(first, starts),
                        -(-inputs.microbatches // most) * round_trip,
                        self._path_bound(round_trip, fwd, own_bwd, flights, peak_fwd, peak_bwd, prefix, devices))

    def _prefix_peaks(self, starts: np.ndarray, left: np.ndarray) -> tuple[np.ndarray, ...]:
        """Lower bounds on the largest forward, backward (B alone for zero-bubble schedules) and both of one
        stage among layers [0, start) on `left` devices (a column, a row per replica count), unreplicated (a stage holds whole layers, and `left`
        stages share the sums), on the largest work of one such stage (W included: a device runs its W's within
        the iteration too), and on a device's share of the work of one microbatch through them (W included,
        replicas allowed); inf where layers are left without devices, 0 where no layer is."""
        with np.errstate(divide="ignore", invalid="ignore"):
            some = left > 0
            spread = np.where(some, left, 1)

            def share(before: np.ndarray, largest: np.ndarray | None) -> np.ndarray:
                each = before[starts] / spread
                each = each if some.all() else np.where(some, each, np.inf)
                if largest is not None:
                    each = np.maximum(each, largest[starts])
                return np.where(starts > 0, each, 0.0)

            return (share(self.fwd_before, self.layer_fwd_before), share(self.bwd_before, self.layer_bwd_before),
                    share(self.compute_before, self.layer_both_before), share(self.work_before, self.layer_work_before),
                    share(self.work_before, None))

    def _path_bound(self, round_trip: np.ndarray, fwd: np.ndarray, backward: np.ndarray, flights: int,
                    peak_fwd: np.ndarray, peak_bwd: np.ndarray, prefix: tuple[np.ndarray, ...],
                    devices_most: int) -> np.ndarray:
        """Lower bounds of a straight flush plan (every stage one device) from one microbatch's round trip T
        plus m - 1 more turns of a bottleneck, m microbatches, b including accumulation:

            gpipe: T + (m - 1) (max_s f_s + max_s b_s)   (every forward precedes the last stage's first
                   backward: a flow shop of m equal jobs forwards, then one backwards)
            1f1b:  T + (m - 1) b_s + (m - k_s) f_s        (stage s holding k_s in flight runs its other
                   m - k_s forwards and all m backwards after the first microbatch's round trip reaches it)

        with the layers before the stage bounded by `prefix` (k_s at most the devices from there on)."""
        m = self.inputs.microbatches
        prefix_fwd, prefix_bwd, prefix_both = prefix[:3]
        if self.inputs.schedule == "gpipe":
            return round_trip + _times(m - 1, np.maximum(peak_fwd, prefix_fwd) + np.maximum(peak_bwd, prefix_bwd))
        stage = round_trip + _times(m - 1, backward) + _times(max(m - int(flights), 0), fwd)
        before = round_trip + np.maximum(_times(m - 1, prefix_bwd), _times(max(m - min(m, devices_most), 0), prefix_both))
        return np.maximum(stage, before)

    def prefix_turns(self, first: int, starts: np.ndarray) -> np.ndarray:
        """A lower bound on the bottleneck u of the layers [0, start) when they are split into straight stages
        on the ranks before `first` (one stage per rank, ending at rank first - 1): the least over such splits
        of the largest u over their stages, with u = max(f + b, 2 c_in) for gpipe and max(f + b, c_in) for
        pipedream (c_in: the message into the stage from the rank before it; 1f1b and zb-h1 take `_prefix_path`
        instead, whose table holds (m - 1) max(b, c_in) and more).
        Dynamic program over ranks: h_r(j) = min_i max(u_r(i, j), h_{r-1}(i)), h_r(0) = 0. 0 without a table."""
        if self.prefix_table is None:
            return np.zeros(len(starts))
        return self.prefix_table[first][starts] if first > 0 else np.where(starts > 0, np.inf, 0.0)

    def _prefix_path(self, first: int, starts: np.ndarray) -> np.ndarray:
        """A lower bound on what the layers [0, start) add to one microbatch's round trip T (1f1b, zb-h1) when split
        into straight stages on the ranks before `first`: the least over such splits of the largest
        max((m - 1) b_s + (m - k_s) f_s, (m - 1) c_in), the path bound of `_path_bound` for each of their stages and
        the m - 1 later messages into it, with k_s = min(m, D - r) the microbatches in flight on rank r (a straight
        plan ends on the last of the D ranks, so every stage on rank r has D - r stages from it on). Dynamic program
        over ranks as `prefix_turns`."""
        if self.path_table is None:
            return np.zeros(len(starts))
        return self.path_table[first][starts] if first > 0 else np.where(starts > 0, np.inf, 0.0)

    def _prefix_waited(self, first: int, starts: np.ndarray) -> np.ndarray:
        """zb-h1, straight: a lower bound on the iteration from the layers [0, start) split into straight stages on
        the ranks before `first`: the least over such splits of the largest of their stages' bounds of
        `_build_waited_table` (the children's `waited` without messages, accumulation, all-reduce and step); 0
        without a table."""
        if self.waited_table is None:
            return np.zeros(len(starts))
        return self.waited_table[first][starts] if first > 0 else np.where(starts > 0, np.inf, 0.0)

    def _build_waited_table(self) -> np.ndarray | None:
        """The table of `_prefix_waited`: row r, column j for layers [0, j) on the ranks before r; None when the table
        would pass PREFIX_TABLE_CELLS. A stage [i, j) on rank r runs its first B only once its first microbatch has
        gone down and back, at F_before(i) + f + down(j) or later (down(j): every layer from j on forward and B, the
        messages left out), then every B and W of its m microbatches and its m - k_r other forwards:

            F_before(i) + (1 + m - k_r) f + m (b + w) + down(j),   k_r = min(m, D - r)

        with the layers' lesser ways back (`work_before`: a first stage's backward runs whole), seconds."""
        inputs, layers, m = self.inputs, self.inputs.arrays.num_layers, self.inputs.microbatches
        devices = inputs.cluster.num_devices
        if devices * (layers + 1) ** 2 > PREFIX_TABLE_CELLS:
            return None
        forwards = _spans(self.fwd_before)
        backwards = _spans(self.work_before) - forwards  # B and W
        reached = self.fwd_before[:layers, None] + (self.compute_before[-1] - self.compute_before)[None, :]
        empty = _no_layer(forwards)

        def cost(rank: int, message: np.ndarray) -> np.ndarray:
            waiting = m - int(in_flight("1f1b", m, 1, devices - rank))  # forwards after the first B
            found = reached + (1 + waiting) * forwards + m * backwards
            found[empty | np.isinf(message)[:, None]] = np.inf  # (rank 0 holds only a stage from layer 0)
            return found

        return self._min_max_table(cost)

    def _build_path_table(self) -> np.ndarray | None:
        """The table of `_prefix_path`: row r, column j for layers [0, j) on the ranks before r; None when the table
        would pass PREFIX_TABLE_CELLS. A stage's term max((m - 1) max(b, c_in), (m - 1) b + (m - k_r) f) is
        max((m - 1) b + (m - k_r) f, (m - 1) c_in), as f >= 0."""
        inputs, layers, m = self.inputs, self.inputs.arrays.num_layers, self.inputs.microbatches
        devices = inputs.cluster.num_devices
        if devices * (layers + 1) ** 2 > PREFIX_TABLE_CELLS:
            return None
        backwards = (m - 1) * self._busy_matrix()
        forwards = _spans(self.fwd_before)

        def cost(rank: int, message: np.ndarray) -> np.ndarray:
            waiting = m - int(in_flight("1f1b", m, 1, devices - rank))  # forwards after the first round trip
            own = backwards + waiting * forwards if waiting > 0 else backwards
            return np.maximum(own, (m - 1) * message[:, None])

        return self._min_max_table(cost)

    def _build_prefix_table(self) -> np.ndarray | None:
        """h_{r-1} of `prefix_turns` for every first rank r (row r) and prefix end j (column j); None when the
        table would pass PREFIX_TABLE_CELLS."""
        inputs, layers = self.inputs, self.inputs.arrays.num_layers
        if inputs.cluster.num_devices * (layers + 1) ** 2 > PREFIX_TABLE_CELLS:
            return None
        busy = self._busy_matrix()
        return self._min_max_table(lambda rank, message: np.maximum(busy, message[:, None]))

    def _busy_matrix(self) -> np.ndarray:
        """u[i, j] of a straight stage [i, j) (i < layers; inf where j <= i): b for 1f1b, B alone for zb-h1 (whose
        W's may wait past the flow; a first stage's own B from `schedule_cost.first_terms`), f + b for gpipe and
        pipedream, seconds."""
        inputs = self.inputs
        busy = inputs.scale * (inputs.arrays.compute_s - (inputs.arrays.fwd_s if inputs.schedule in ("1f1b", "zb-h1")
                                                          else 0.0))
        stage = _spans(busy - self.weight)
        if self.split:
            stage[0] = self.first_back
        stage[_no_layer(stage)] = np.inf
        return stage

    def _min_max_table(self, stage_cost: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
        """Row r, column j: the least over splits of layers [0, j) into straight stages on ranks before r of the
        largest `stage_cost(rank, message)[i, j]` of a stage [i, j) on `rank` (i < layers), given message[i] (its
        message in: once, twice for gpipe; inf on rank 0 but for the stage from layer 0). Ranks may stay empty at
        the front."""
        inputs, layers = self.inputs, self.inputs.arrays.num_layers
        devices = inputs.cluster.num_devices
        links = 2.0 if inputs.schedule == "gpipe" else 1.0
        table = np.full((devices + 1, layers + 1), np.inf)
        table[0, 0] = 0.0  # row r: ends on rank r - 1; row 0: no rank, no layers
        previous = table[0]
        cuts = np.concatenate([[0.0], self.cut[:layers - 1]])  # into layer i from layer i - 1
        for rank in range(devices):
            message = links * transfer_s(cuts, *link_terms(inputs.cluster, max(rank - 1, 0), rank),
                                         np.arange(layers) > 0) if rank > 0 else np.where(np.arange(layers) > 0, np.inf, 0.0)
            row = np.min(np.maximum(stage_cost(rank, message), previous[:layers, None]), axis=0)
            row[0] = 0.0
            table[rank + 1] = row
            previous = row
        return table


def _spans(before: np.ndarray) -> np.ndarray:
    """[i, j] = before[j] - before[i] for i < layers = len(before) - 1: the sums of every stage [i, j) of a prefix
    sum (negative where j < i)."""
    return (before[None, :] - before[:, None])[:-1]


def _no_layer(spans: np.ndarray) -> np.ndarray:
    """Where a matrix of `_spans` holds no stage: j <= i."""
    return np.tril(np.ones(spans.shape, dtype=bool))


def _largest(*values: float | np.ndarray) -> np.ndarray:
    """The element-wise maximum of arrays (and numbers) that broadcast together."""
    return functools.reduce(np.maximum, values)


def _times(count: int, values: np.ndarray) -> np.ndarray:
    """count x values, with 0 (not nan) where count is 0 and a value inf."""
    return count * values if count > 0 else np.zeros_like(values)
