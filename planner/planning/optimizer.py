"""The planner's optimizer: stage boundaries, replicas and recompute flags minimising `schedule_cost`.

The objective (see `schedule_cost`) is `fill_drain + max_s Q(s)`, where fill_drain is a constant
plus the recomputed forwards (flush schedules; 0 for pipedream). It is solved exactly by a
search over a bound beta on max_s Q(s):

- solve(beta) is a dynamic program over suffixes of the layers. A state is (first layer i,
  devices d used by layers [i, L)); only d mod M matters for bandwidth (M: second-outermost
  group size; shifting ranks by M changes no link), and among states of one residue fewer
  devices are never worse (fewer devices downstream only lower memory, and leave more for the
  stages before). So each layer keeps a Pareto front of (devices, recompute cost) per residue.
  Not under zb-h1 with deferred gradients: there a stage keeps min(d + 1, m) microbatches' deferred
  gradients, d = P - D falling as the devices D from it on grow (`schedule_cost.deferred_count`), so
  more devices downstream can let a stage before fit; each layer keeps its cheapest entry of every
  device count (a first version kept the fewest and refused a plan that fit: 6 layers on 6 GPUs at 4 GB).
  Nor under zb-h1 with replicated stages: a stage on r replicas holds min(ceil(m / r), ceil(D / r) +
  ceil((P - D) / r)) microbatches in flight, which D falling does not lower (P = 4, r = 2: 2 at D = 4,
  3 at D = 3): a review's case chose a plan 11% slower than the best within 3.5 GB.
  A stage [i, j) placed on top of a state takes the ranks just before it; it is feasible when
  Q(s) <= beta, memory fits and the placement rule holds. Replica counts up to M are all tried
  (each reaches another residue); beyond M a stage is whole outer groups, every bandwidth it sees
  is the outermost one, and the fewest feasible replicas come from a short fixed-point
  iteration (flush: `_flush_fixed_point`) or the quadratic of PipeDream's objective (pipedream).
- beta is bisected to the smallest feasible value (relative 1e-3), then lowered just below the
  best plan's own max Q until nothing is feasible: exact to a relative 1e-9. With a memory limit the
  smallest feasible beta comes instead from one pass of the same dynamic program that keeps per entry
  the largest Q of its suffix (`_least_bound`; exact; it also finds that no plan fits, and gives a plan
  that reaches it): the bisection took 7-14 solves there, and a first solve for any plan. The pass prunes
  a candidate once a floor under the largest Q of any plan through it (what the layers before it need on
  the devices left, too) exceeds the largest Q of a plan made without a search (`quick_plans`: nasnetalarge
  on 16 GPUs at 8 GB, 1f1b at 64 microbatches, 7.0 s -> 1.9 s). (The bisection stays where the closed forms
  of many whole outer groups need a bound: `_bisected`.)
- Recompute costs time in the fill/drain sum, so with a memory limit (the only case where it
  can help) the objective is C + c + max Q (c: the recomputed forwards): one more pass of the dynamic
  program, whose entries carry (devices, largest Q so far, c) and keep those no other of their residue
  beats in all three, finds the least c + max Q and the plans that could tie it (`_least_objectives`).
  Where the closed forms of many whole outer groups are needed, every cheaper-recompute breakpoint of
  solve(beta) above the smallest beta is found by bisection instead, as long as it can still beat the
  best plan (`_cheaper_recompute`, 9-16 solves a call where the pass takes about two).
- Ties within a relative 1e-9 go to the plan with the fewest devices.
- With a memory limit, the optimum without it is found first; where it fits, it is the answer: every plan
  within the limit is a plan without it, or one with recompute flags, which only add time (a recomputing
  plan that ties is tied by its plan without recompute, on as many devices). nasnetalarge on 16 GPUs at 16
  GB with `--schedule auto --microbatches auto`: 11.5 s -> 1.2 s, the same plan. gpipe and 1f1b share that
  optimum (their objectives without a limit are one), so `partition` finds it once per count for both.

Without a memory limit (the default) solve(beta) is `unlimited_dp.solve_unlimited`: one state
per (layer, residue), the fewest devices. Here: the memory-limited DP over Pareto fronts, the
bound search and the tie and recompute rules. Stage sums come from `stage_sums.Pairs`.

Why one module of ~900 lines: the evaluator of the objective and the search over bounds share one cost
model state (`_Evaluator`); the memory-free fast path is `unlimited_dp`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from planner.planning.bound_search import MAX_STEPS, PROBES, TIE, Solution, smallest_bound
from planner.errors import InfeasiblePlanError, PlannerError
from planner.files.cluster import Cluster
from planner.costs.schedule_cost import (
    RECEIVES_AHEAD,
    CostInputs,
    Stage,
    accumulate_terms,
    activation_top,
    allreduce_s,
    allreduce_terms,
    deferred_count,
    fill_drain_s,
    link_terms,
    memory_terms,
    objective_s,
    placement_ok,
    plan_fits,
    reduce_terms,
    replicas_of,
    stage_cost,
    stage_costs,
    step_terms,
    time_terms,
    transfer_s,
)
from planner.schedules.schedule import (
    CHUNKED_SCHEDULES, FLUSH_SCHEDULES, SCHEDULES, SPLIT_BACKWARD_SCHEDULES, in_flight,
)
from planner.costs.stage_sums import Pairs
from planner.planning.quick_plans import quick_bound
from planner.planning.unlimited_dp import GroupCombos, solve_unlimited

_NONE = np.iinfo(np.int64).max // 4  # 'no replica count works'


class _Evaluator:
    """Vectorised `schedule_cost.stage_cost`: bound Q(s) and memory of many candidate stages."""

    def __init__(self, inputs: CostInputs, pairs: Pairs) -> None:
        self.inputs, self.pairs = inputs, pairs
        outermost = inputs.cluster.levels[-1]
        self.top, self.top_latency = outermost.bandwidth_Bps, outermost.latency_s
        self.ar_top, self.ar_top_latency = outermost.reduce_bandwidth_Bps, outermost.reduce_latency_s  # all-reduces
        self.outer_comm = np.maximum(  # both links outermost
            transfer_s(pairs.cut_in, self.top, self.top_latency, pairs.starts > 0),
            transfer_s(pairs.cut_out, self.top, self.top_latency, pairs.stops < pairs.num_layers))
        self.combos = GroupCombos(inputs, pairs) if inputs.memory_bytes is None else None
        self.grids: dict[tuple[bool, tuple[bool, ...]], _StageGrid] = {}  # `_solve_front`'s, per (straight, options)

    def placement_ok(self, first: np.ndarray, replicas: np.ndarray) -> np.ndarray:
        """`schedule_cost.placement_ok`, per element (and not before rank 0)."""
        return (first >= 0) & placement_ok(self.inputs.cluster, first, replicas)

    def terms(
        self, pair: np.ndarray, replicas: np.ndarray, first: np.ndarray, recompute: np.ndarray, downstream: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(Q(s), memory bytes) of stages `pair` with these replicas, first ranks and recompute flags."""
        p, inputs = self.pairs, self.inputs
        compute = p.both[pair] + np.where(recompute, p.fwd[pair], 0.0)
        last = first + replicas - 1
        cluster = inputs.cluster
        comm_in = transfer_s(p.cut_in[pair], *link_terms(cluster, first - 1, first), p.starts[pair] > 0)
        comm_out = transfer_s(p.cut_out[pair], *link_terms(cluster, last, last + 1), p.stops[pair] < p.num_layers)
        allreduce = allreduce_s(p.replicated[pair], replicas, *allreduce_terms(cluster, first, last))
        _, bound = time_terms(inputs.schedule, inputs.microbatches, replicas, compute, comm_in, comm_out, allreduce,
                              step_terms(inputs, p.weights[pair], p.tensors[pair]),
                              accumulate_terms(inputs, p.weights[pair]), p.weight[pair])
        return bound, self.memory(pair, replicas, recompute, downstream)

    def memory(self, pair: np.ndarray, replicas: np.ndarray, recompute: np.ndarray, downstream: np.ndarray) -> np.ndarray:
        """Memory per device (bytes) of stages `pair` with `downstream` devices after them."""
        p = self.pairs
        return memory_terms(self.inputs, replicas, replicas + downstream, p.weights[pair], p.saved[pair],
                            p.entering[pair], recompute, p.workspace[pair], p.deferred[pair], p.frozen[pair],
                            p.backward_top[pair], p.weight_top[pair], p.received[pair], p.largest[pair],
                            p.cut_in[pair], p.cut_out[pair],
                            reduce_terms(replicas, p.replicated[pair], p.tied[pair]))[4]

    def fewest_outer(
        self, pair: np.ndarray, first_end: np.ndarray, recompute: np.ndarray, downstream: np.ndarray, bound: float
    ) -> np.ndarray:
        """Fewest replicas r = k M, k >= 2, ending at rank `first_end` (exclusive), with Q <= bound and
        memory within the limit; _NONE where none works. Every link such a stage sees is outermost."""
        inputs, p = self.inputs, self.pairs
        group = inputs.class_size
        if (self.top_latency > 0 or self.ar_top_latency > 0 or self.inputs.step_s_per_byte > 0
                or self.inputs.accumulate_s_per_byte > 0 or self.inputs.step_s_per_tensor > 0
                or self.inputs.step_s_per_call > 0):
            # the closed forms below leave latency, the optimizer step and accumulation out: try every count
            return self._fewest_outer_scan(pair, first_end, recompute, downstream, bound)
        top = self.ar_top
        compute = p.both[pair] + np.where(recompute, p.fwd[pair], 0.0)
        comm = self.outer_comm[pair]
        a = 2.0 * p.replicated[pair] / top
        lowest = np.full(len(pair), 2.0 * group)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if inputs.schedule == "pipedream":
                need = np.maximum(lowest, comm / bound)
                root = ((compute + a) + np.sqrt(np.maximum((compute + a) ** 2 - 4.0 * bound * a, 0.0))) / (2.0 * bound)
                need = np.where(self._outer_ok(pair, need, first_end, recompute, downstream, bound, group), need,
                                np.maximum(need, root))
                need = np.maximum(need, self._memory_replicas(pair, recompute, downstream))
            else:
                need = np.maximum(lowest, self._memory_replicas(pair, recompute, downstream))
                # (zero-bubble Q adds the stage's own W: the fixed point solves for what is left of the bound)
                need = self._flush_fixed_point(np.maximum(compute, comm), a, need, bound - p.weight[pair], group)
            need = np.ceil(np.minimum(need, 4.0 * _NONE) / group - 1e-9) * group  # a multiple of M
        need = np.where(np.isfinite(need) & (need <= inputs.cluster.num_devices), need, _NONE).astype(np.int64)
        # the closed forms round: take the one below if it still works, else this one, else the one above
        # (the three checked in one call)
        count = len(pair)
        tried = np.concatenate([need - group, need, need + group])
        ok = self._outer_ok(_copies(pair, 3), tried, _copies(first_end, 3), _copies(recompute, 3),
                            _copies(downstream, 3), bound, group)
        below_ok, need_ok, above_ok = ok[:count], ok[count:2 * count], ok[2 * count:]
        below_ok &= tried[:count] >= 2 * group
        found = np.where(below_ok, tried[:count], np.where(need_ok, need, np.where(above_ok, tried[2 * count:], _NONE)))
        # `_memory_replicas` leaves the receive buffers out (`ahead_terms`), so the fewest count that fits may lie
        # further above its bound: where none of the three works, try every count
        missed = (found == _NONE) & (need != _NONE) & (inputs.memory_bytes is not None)
        if np.any(missed):
            found[missed] = self._fewest_outer_scan(pair[missed], first_end[missed], recompute[missed],
                                                    downstream[missed], bound)
        return found

    def _fewest_outer_scan(
        self, pair: np.ndarray, first_end: np.ndarray, recompute: np.ndarray, downstream: np.ndarray, bound: float
    ) -> np.ndarray:
        """`fewest_outer` by trying every r = k M, k >= 2, that the cluster has (exact for any link terms)."""
        group = self.inputs.class_size
        counts = np.arange(2 * group, self.inputs.cluster.num_devices + 1, group)
        if len(counts) == 0 or len(pair) == 0:
            return np.full(len(pair), _NONE, dtype=np.int64)
        k = len(counts)
        ok = self._outer_ok(np.repeat(pair, k), np.tile(counts, len(pair)), np.repeat(first_end, k),
                            np.repeat(recompute, k), np.repeat(downstream, k), bound, group).reshape(len(pair), k)
        return np.where(ok.any(axis=1), counts[np.argmax(ok, axis=1)], _NONE).astype(np.int64)

    def _flush_fixed_point(
        self, busy: np.ndarray, a: np.ndarray, lowest: np.ndarray, bound: float | np.ndarray, group: int
    ) -> np.ndarray:
        """Fewest r (multiple of M, >= lowest) with (ceil(m / r) - 1) busy + a (1 - 1/r) <= bound.

        For r >= r_k the all-reduce term is at least a (1 - 1/r_k), so ceil(m / r) may be at most
        c = 1 + floor((bound - a (1 - 1/r_k)) / busy), i.e. r >= ceil(m / c) =: r_(k+1): no r below
        r_(k+1) works. Iterating from `lowest` reaches the fewest r where the bound holds.
        """
        m = float(self.inputs.microbatches)
        ceiling = float(self.inputs.cluster.num_devices + group)  # more than the cluster: no plan
        r = np.minimum(np.ceil(lowest / group - 1e-9) * group, ceiling)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for _ in range(MAX_STEPS):
                spare = bound - a * (1.0 - 1.0 / r)
                turns = np.where(busy > 0, np.floor(spare / busy * (1 + 1e-12)), np.where(spare >= 0, m, -1.0))
                nxt = np.where(turns >= 0, np.ceil(m / (1.0 + np.minimum(turns, m)) / group - 1e-9) * group, np.inf)
                nxt = np.minimum(np.maximum(nxt, r), ceiling)
                if np.array_equal(nxt, r):
                    break
                r = nxt
        return r

    def _outer_ok(
        self, pair: np.ndarray, replicas: np.ndarray, first_end: np.ndarray, recompute: np.ndarray,
        downstream: np.ndarray, bound: float, group: int,
    ) -> np.ndarray:
        usable = np.isfinite(replicas) & (replicas < _NONE)
        replicas = np.where(usable, replicas, 2 * group).astype(np.int64)
        replicas = np.maximum(-(-replicas // group) * group, 2 * group)
        p = self.pairs
        compute = p.both[pair] + np.where(recompute, p.fwd[pair], 0.0)
        allreduce = allreduce_s(p.replicated[pair], replicas, self.ar_top, self.ar_top_latency)  # all outermost
        comm = self.outer_comm[pair]
        _, q = time_terms(self.inputs.schedule, self.inputs.microbatches, replicas, compute, comm, comm, allreduce,
                          step_terms(self.inputs, p.weights[pair], p.tensors[pair]),
                          accumulate_terms(self.inputs, p.weights[pair]), p.weight[pair])
        ok = usable & (q <= bound) & (first_end - replicas >= 0)
        if self.inputs.memory_bytes is not None:
            ok &= self.memory(pair, replicas, recompute, downstream) <= self.inputs.memory_bytes
        return ok

    def _memory_replicas(self, pair: np.ndarray, recompute: np.ndarray, downstream: np.ndarray) -> np.ndarray:
        """Lower bound on replicas from memory: n(r) microbatches in flight must fit, and so must the
        optimizer step's scratch and the all-reduce's buffer (`reduce_terms`: these counts are all above 1; see
        schedule_cost); inf where nothing fits. zb-h1's in-flight count
        ceil(D / r) + ceil((P - D) / r) has no closed-form inverse: there it is the exact fewest
        (`_fewest_fitting`)."""
        inputs, p = self.inputs, self.pairs
        if inputs.memory_bytes is None:
            return np.zeros(len(pair))
        weights, saved = p.weights[pair], p.saved[pair]
        per_flight = np.where(recompute, p.entering[pair], saved + p.received[pair])  # held (memory_terms)
        in_backward = np.where(recompute, saved, 0.0) + p.workspace[pair]  # rebuilt (memory_terms)
        base = inputs.library_bytes + weights * (2 + inputs.optimizer_copies) + in_backward
        if inputs.schedule == "pipedream":
            per_flight, base = per_flight + weights, base - weights
        with np.errstate(divide="ignore", invalid="ignore"):
            flights = np.where(per_flight > 0, np.floor((inputs.memory_bytes - base) / per_flight + 1e-9), np.inf)
        flights = np.where(base > inputs.memory_bytes, -np.inf, flights)  # (+1e-9: a plan exactly at the
        # limit must not be lost to rounding; every candidate is checked exactly afterwards)
        stepping = base - in_backward + np.maximum(  # the optimizer step's peak, or the all-reduces' (r >= 2 here),
            inputs.scratch_per_byte * weights + inputs.scratch_per_largest * p.largest[pair],  # does not depend on r
            reduce_terms(2, p.replicated[pair], p.tied[pair]))
        flights = np.where(stepping > inputs.memory_bytes, -np.inf, flights)
        m = float(inputs.microbatches)
        d = downstream.astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            by_count = np.where(flights >= 1, np.ceil(m / flights), np.inf)
            by_depth = np.where(d == 0, np.where(flights >= 1, 1.0, np.inf),
                                np.where(flights >= 2, np.ceil(d / (flights - 1)), np.inf))
        if inputs.schedule == "gpipe":
            return by_count
        if inputs.schedule == "1f1b":
            return np.minimum(by_count, by_depth)
        if inputs.schedule == "zb-h1":
            return self._fewest_fitting(pair, recompute, downstream)
        return by_depth

    def _fewest_fitting(self, pair: np.ndarray, recompute: np.ndarray, downstream: np.ndarray) -> np.ndarray:
        """The fewest replicas r = k M, k >= 2 (k = 1 on a cluster of one group), whose memory (`memory`,
        deferred gradients included) fits the limit; inf where none up to the cluster's devices does. Exact
        by bisection on k: with downstream <= P and no negative byte count, the memory is a non-increasing
        function of r (ceil(m / r); zb-h1's ceil(D / r) + ceil((P - D) / r) with D = r + downstream;
        min(ceil((P - D) / r) + 1, ceil(m / r)) deferred; the receive buffers, `ahead_terms`, alone can grow
        with r, by one activation entering per microbatch fewer in flight, which held at least that much), so
        the fitting r form a ray.
        (`fewest_outer` checks its answer exactly, as for the other schedules' closed forms.)"""
        group, limit = self.inputs.class_size, self.inputs.memory_bytes
        assert limit is not None
        low = np.full(len(pair), 2, dtype=np.int64)  # k that may fit; high: k that fits, or most + 1 (none)
        most = self.inputs.cluster.num_devices // group
        high = np.where(self.memory(pair, np.full(len(pair), most * group), recompute, downstream) <= limit,
                        most, most + 1)
        while np.any(low < high):
            middle = (low + high) // 2
            fits = self.memory(pair, middle * group, recompute, downstream) <= limit
            open_ = low < high
            high = np.where(open_ & fits, middle, high)
            low = np.where(open_ & ~fits, middle + 1, low)
        return np.where(high <= most, high * group, np.inf).astype(float)


def _copies(values: np.ndarray, count: int) -> np.ndarray:
    """`values` repeated `count` times end to end (np.tile of a 1-D array, without its overhead)."""
    return values if count == 1 else np.concatenate((values,) * count)


@dataclass
class _Front:
    """The entries of a dynamic program over suffixes, as parallel arrays grown as needed; entry 0 is the empty
    suffix, and the first `size` are in use. An entry is a stage [start, stop) on `replicas` devices, recomputing or
    not, placed on the entry `parent` (whose start is `stop`), with the `devices`, the recompute cost (seconds) and
    the largest Q (seconds) of its whole suffix."""

    devices: np.ndarray
    cost: np.ndarray
    largest: np.ndarray
    stop: np.ndarray
    parent: np.ndarray
    replicas: np.ndarray
    recompute: np.ndarray
    start: np.ndarray
    size: int

    @classmethod
    def empty(cls, layers: int, capacity: int) -> _Front:
        """Room for `capacity` entries, with entry 0, the empty suffix of a model of `layers` layers."""
        front = cls(*(np.zeros(capacity, dtype=t) for t in (np.int64, float, float, np.int64, np.int64, np.int64,
                                                             bool, np.int64)), size=1)
        front.start[0], front.stop[0], front.parent[0] = layers, layers, -1
        return front

    def add(self, start: int, parent: np.ndarray, replicas: np.ndarray, recompute: np.ndarray, devices: np.ndarray,
            cost: np.ndarray, largest: np.ndarray) -> None:
        """New entries of stages from `start` on the entries `parent` (the arrays element for element)."""
        if self.size + len(parent) > len(self.devices):  # (the passes' Pareto sets may outgrow a guess)
            grow = max(len(self.devices), len(parent))
            for name in ("devices", "cost", "largest", "stop", "parent", "replicas", "recompute", "start"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros(grow, dtype=old.dtype)]))
        added = slice(self.size, self.size + len(parent))
        self.start[added], self.stop[added], self.parent[added] = start, self.start[parent], parent
        self.replicas[added], self.recompute[added], self.devices[added] = replicas, recompute, devices
        self.cost[added], self.largest[added] = cost, largest
        self.size += len(parent)

    def plan(self, entry: int) -> list[Stage]:
        """The stages of the whole suffix of `entry`, first to last."""
        stages = []
        while self.start[entry] < self.stop[0]:
            stages.append(Stage(int(self.start[entry]), int(self.stop[entry]), int(self.replicas[entry]),
                                bool(self.recompute[entry])))
            entry = int(self.parent[entry])
        return stages

    def at_zero(self) -> np.ndarray:
        """The entries of whole plans (their suffix starts at layer 0)."""
        return np.nonzero(self.start[:self.size] == 0)[0]


_SCANNED = 64  # whole-outer-group counts `_solve_front` tries one by one, beyond which it takes the closed forms
# (scanning was as fast or faster up to 64 in memory-limited plans of PipeDream's profiles: flat 8 GPUs x1.4-2.3)


def _level_index(cluster: Cluster, levels: list[tuple[float, float]], rank_a: np.ndarray,
                 rank_b: np.ndarray) -> np.ndarray:
    """The index in `levels` of (bandwidth, latency) of the link between ranks (`link_terms`), element-wise."""
    bandwidth, latency = link_terms(cluster, rank_a, rank_b)
    index = np.zeros(np.shape(bandwidth), dtype=np.int64)
    for level in range(len(levels) - 1, -1, -1):  # the first level with these values (any such gives the same)
        index = np.where((bandwidth == levels[level][0]) & (latency == levels[level][1]), level, index)
    return index


class _StageGrid:
    """What `_solve_front` needs of its candidate stages that depends neither on the bound nor on the memory
    limit, built once per evaluator (so once per `optimize`) and kept in `_Evaluator.grids`.

    A candidate is a stage [start, stop) on a front entry with d devices after it, under combination
    k = (r_k replicas, recompute flag f_k): r = 1..M (each reaches its own residue), then the whole outer
    groups r = j M, j >= 2, when there are at most `_SCANNED` of them (`_solve_front` keeps the fewest that
    work, which is what `_Evaluator.fewest_outer` finds; with more it calls that). A candidate's ranks, so
    its links and the placement rule, depend on (d, k) alone and its sums on (start, stop) alone: both are
    tabled here, and `bound` puts them through the cost model's own functions, element for element the Q
    of `_Evaluator.terms` (`memory` is `_Evaluator.memory`).

    `live` first drops the candidates that no bound this low and no such memory limit admits, by floors
    that hold in floating point too (rounding is monotone): flush Q = turns(r) busy + all-reduce + step + W
    >= turns(r) min_f(t_f + acc), and pipedream's Q >= t / r, where all-reduce, step and W are >= 0
    (checked, else no Q floor); memory = base + max(n held + top(c), scratch) >= base + max(held + top(c'),
    scratch) with n >= 1 microbatches in flight and c' the fewest deferred of any placement (`activation_top`,
    non-decreasing in c), where held and deferred are >= 0 (checked, else no memory floor). They would fail
    `_solve_front`'s exact test anyway.
    """

    def __init__(self, evaluator: _Evaluator, straight: bool, options: tuple[bool, ...]) -> None:
        inputs, p = evaluator.inputs, evaluator.pairs
        cluster, total, group = inputs.cluster, inputs.cluster.num_devices, inputs.class_size
        self.evaluator, self.inputs, self.pairs, self.options = evaluator, inputs, p, len(options)
        # whether a suffix on more devices can let a stage before it fit (the module docstring: zb-h1's deferred
        # gradients, and its replicated stages' microbatches in flight), so that the DP keeps every device count
        self.more_devices_can_help = (inputs.schedule in SPLIT_BACKWARD_SCHEDULES and inputs.memory_bytes is not None
                                      and (not straight or bool(np.any(np.diff(inputs.arrays.deferred_bytes) > 0))))
        outer = [] if straight else list(range(2 * group, total + 1, group))
        self.scans_outer = len(outer) <= _SCANNED
        counts = list(range(1, (1 if straight else group) + 1)) + (outer if self.scans_outer else [])
        self.flag_index = np.repeat(np.arange(len(options)), len(counts))
        self.replicas = np.array(counts * len(options), dtype=np.int64)
        self.flags = np.array(options, dtype=bool)[self.flag_index]
        self.outer = self.replicas > group
        self.has_outer = bool(self.outer.any())
        self.combos = len(self.replicas)
        # per (d, k): the placement rule (and not before rank 0) in row d; the links, flattened to d combos + k
        downstream = np.arange(total + 1)[:, None]
        first = total - downstream - self.replicas[None, :]
        last = first + self.replicas[None, :] - 1
        self.valid = (first >= 0) & placement_ok(cluster, first, self.replicas[None, :])  # row d
        levels = [(level.bandwidth_Bps, level.latency_s) for level in cluster.levels]
        self.levels = len(levels)
        self.level_in = _level_index(cluster, levels, first - 1, first).ravel()
        self.level_out = _level_index(cluster, levels, last, last + 1).ravel()
        self.allreduce_link = tuple(np.ravel(value) for value in allreduce_terms(cluster, first, last))
        # per pair (start, stop): row[start] + stop is its index; per option or level: pair-major, flattened
        self.row = p.offsets - np.arange(len(p.offsets)) - 1
        compute = np.stack([p.both + np.where(flag, p.fwd, 0.0) for flag in options], axis=1)
        self.compute = compute.ravel()
        self.accumulate = accumulate_terms(inputs, p.weights)
        self.step = step_terms(inputs, p.weights, p.tensors)
        self.comm_in = np.stack([transfer_s(p.cut_in, bw, lat, p.starts > 0) for bw, lat in levels], axis=1).ravel()
        self.comm_out = np.stack([transfer_s(p.cut_out, bw, lat, p.stops < p.num_layers) for bw, lat in levels],
                                 axis=1).ravel()
        # the floors of `live`
        nonnegative = (np.all(p.replicated >= 0) and all(bw > 0 and lat >= 0 for bw, lat in levels)
                       and np.all(self.step >= 0) and np.all(p.weight >= 0))
        self.busy_floor = np.min(compute + self.accumulate[:, None], axis=1) if nonnegative else None
        self.turns = (-(-inputs.microbatches // self.replicas) - 1).astype(float)
        self.pipedream = inputs.schedule == "pipedream"
        # memory floors and ceilings per (pair, option), pair-major (no memory limit is read here): between one
        # microbatch in flight and none deferred, and the most any placement has of each
        replicas, devices = np.broadcast_arrays(self.replicas[None, :], downstream + self.replicas[None, :])
        replicas, devices = replicas[self.valid], devices[self.valid]
        flights = np.max(in_flight(inputs.schedule, inputs.microbatches, replicas, devices, total), initial=1)
        counts = deferred_count(inputs, replicas, devices)
        fewest, deferred = (int(np.min(counts)), int(np.max(counts))) if np.size(counts) else (0, 0)
        floors, ceilings = [], []
        for flag in options:
            base, held, rebuilt, scratch, _ = memory_terms(inputs, 1, 1, p.weights, p.saved, p.entering, flag,
                                                           p.workspace, frozen_bytes=p.frozen,
                                                           received_bytes=p.received, largest_bytes=p.largest)
            bounded = np.all(held >= 0) and np.all(p.deferred >= 0)
            fixed = inputs.library_bytes + base  # (memory_terms)
            least = activation_top(fewest, p.deferred, rebuilt, flag, p.backward_top, p.weight_top)
            floors.append(fixed + np.maximum(held + least, scratch) if bounded else np.full(len(held), -np.inf))
            top = activation_top(deferred, p.deferred, rebuilt, flag, p.backward_top, p.weight_top)  # (the most)
            ahead = (RECEIVES_AHEAD + 1) * p.cut_in + RECEIVES_AHEAD * p.cut_out  # (the most `ahead_terms` gives)
            reduce = reduce_terms(1 if straight else 2, p.replicated, p.tied)  # (the most `reduce_terms` gives)
            ceilings.append(fixed + np.maximum(flights * held + top + ahead, np.maximum(scratch, reduce)) if bounded
                            else np.full(len(held), np.inf))
        self.memory_floor, self.memory_ceiling = np.stack(floors, axis=1), np.stack(ceilings, axis=1).ravel()

    def live(self, pair: np.ndarray, downstream: np.ndarray, bound: float,
             memory_bytes: float | None) -> tuple[np.ndarray, np.ndarray]:
        """(entry, combination) indices of the candidates on entries of these pairs and devices after them
        that obey the placement rule and that neither floor rules out at `bound` and this memory limit,
        entry by entry, then k."""
        ok = self.valid[downstream]
        if memory_bytes is not None:
            ok &= self.memory_floor[pair][:, self.flag_index] <= memory_bytes
        if self.busy_floor is not None:
            busy = self.busy_floor[pair][:, None]
            ok &= (busy / self.replicas if self.pipedream else busy * self.turns) <= bound
        return np.nonzero(ok)

    def before_floor(self, start: int, left: np.ndarray, straight: bool) -> np.ndarray | float:
        """A floor under the largest Q of any plan of layers [0, `start`) on `left` devices (inf where none are
        left, 0 where `live` has no floor or start is 0). With r_i replicas and compute t_i each, a flush stage's
        Q >= (ceil(m / r_i) - 1) t_i >= (t_i / r_i)(m - r_i) (`live`'s floor), and the stage of most t_i / r_i has
        t_i / r_i >= sum t_i / R >= T / R (R: the devices left; T: both(0, start), at most the stages' sum, also
        under zb-h1 whose split backwards cost no less than the unsplit one of a first stage) and r_i <= R, so
        max Q >= (T / R)(m - R) = m T / R - T (also where r_i > m: Q >= 0 >= it); one replica each (straight):
        >= (m - 1) T / R. Pipedream's Q >= t_i / r_i gives T / R."""
        if start == 0 or self.busy_floor is None:
            return 0.0
        before, m = float(self.pairs.both[self.row[0] + start]), float(self.inputs.microbatches)
        with np.errstate(divide="ignore", invalid="ignore"):  # (no device left: inf below)
            share = before / np.maximum(left, 0)
            floor = share if self.pipedream else (m - 1) * share if straight else m * share - before
        return np.where(left > 0, floor, np.inf)

    def bound(self, pair: np.ndarray, downstream: np.ndarray, combo: np.ndarray) -> np.ndarray:
        """Q(s) of stages `pair` with `downstream` devices after them under combinations `combo`, as
        `_Evaluator.terms` computes it."""
        p, inputs = self.pairs, self.inputs
        replicas, at = self.replicas[combo], downstream * self.combos + combo
        bandwidth, latency = self.allreduce_link
        allreduce = allreduce_s(p.replicated[pair], replicas, bandwidth[at], latency[at])
        compute = self.compute[pair * self.options + self.flag_index[combo]]
        comm_in = self.comm_in[pair * self.levels + self.level_in[at]]
        comm_out = self.comm_out[pair * self.levels + self.level_out[at]]
        return time_terms(inputs.schedule, inputs.microbatches, replicas, compute, comm_in, comm_out, allreduce,
                          self.step[pair], self.accumulate[pair], p.weight[pair])[1]

    def memory(self, pair: np.ndarray, downstream: np.ndarray, combo: np.ndarray) -> np.ndarray:
        """Memory per device (bytes) of the same stages (`_Evaluator.memory`)."""
        return self.evaluator.memory(pair, self.replicas[combo], self.flags[combo], downstream)

    def fits(self, pair: np.ndarray, downstream: np.ndarray, combo: np.ndarray, memory_bytes: float) -> np.ndarray:
        """Whether the same stages fit `memory_bytes`: those whose ceiling does, without their memory."""
        ok = self.memory_ceiling[pair * self.options + self.flag_index[combo]] <= memory_bytes
        unsure = np.nonzero(~ok)[0]
        ok[unsure] = self.memory(pair[unsure], downstream[unsure], combo[unsure]) <= memory_bytes
        return ok


def _firsts(groups: int, group: np.ndarray, cost: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """The index of the element of least (cost, tie) in each group present (0 <= group < groups; the ties
    are distinct within a group): what a sort by (group, cost, tie) would put first, without the sort."""
    least = np.full(groups, np.inf)
    np.minimum.at(least, group, cost)
    cheapest = np.nonzero(cost == least[group])[0]
    first = np.full(groups, np.iinfo(np.int64).max)
    np.minimum.at(first, group[cheapest], tie[cheapest])
    return cheapest[tie[cheapest] == first[group[cheapest]]]


def _solve(
    evaluator: _Evaluator, bound: float, straight: bool, recompute_options: tuple[bool, ...], track_cost: bool
) -> list[Stage] | None:
    """The plan with every Q(s) <= bound of least recompute cost (if tracked), then fewest devices."""
    if evaluator.inputs.memory_bytes is None:
        return solve_unlimited(evaluator.combos, bound, straight)
    found = _solve_front(evaluator, bound, straight, recompute_options, track_cost)
    return found[0] if found else None


def _grid(evaluator: _Evaluator, straight: bool, recompute_options: tuple[bool, ...]) -> _StageGrid:
    """The evaluator's `_StageGrid` for these options, built on first use."""
    key = (straight, recompute_options)
    if key not in evaluator.grids:
        evaluator.grids[key] = _StageGrid(evaluator, straight, recompute_options)
    return evaluator.grids[key]


def _solve_front(
    evaluator: _Evaluator, bound: float, straight: bool, recompute_options: tuple[bool, ...], track_cost: bool
) -> list[list[Stage]]:
    """Every Pareto plan (devices, recompute cost) for the whole model with every Q(s) <= bound,
    least cost first, then fewest devices.

    Per start, every entry of the front so far (a suffix: its first layer, the devices d it uses) is a
    state to build on; the candidate stages on it come from `_StageGrid` (the same Q and memory as
    `_Evaluator.terms`, less those its floors rule out: they would fail the exact test below anyway).
    A start keeps at most one entry per device count, so the front is allocated once.
    """
    inputs, pairs = evaluator.inputs, evaluator.pairs
    n, total, group = pairs.num_layers, inputs.cluster.num_devices, inputs.class_size
    grid = _grid(evaluator, straight, recompute_options)
    options = len(recompute_options)
    front = _Front.empty(n, 1 + n * total)
    for start in range(n - 1, -1, -1):
        downstream = front.devices[:front.size]
        pair = grid.row[start] + front.start[:front.size]
        entries, combos = grid.live(pair, downstream, bound, inputs.memory_bytes)
        ok = grid.bound(pair[entries], downstream[entries], combos) <= bound
        entries, combos = entries[ok], combos[ok]
        if inputs.memory_bytes is not None:
            ok = grid.fits(pair[entries], downstream[entries], combos, inputs.memory_bytes)
            entries, combos = entries[ok], combos[ok]
        if grid.has_outer:  # of the whole outer groups that work under one flag, the fewest (k ascends)
            outer = grid.outer[combos]
            state = entries * options + grid.flag_index[combos]
            repeated = np.concatenate([[False], outer[:-1] & (state[1:] == state[:-1])])
            entries, combos = entries[~(outer & repeated)], combos[~(outer & repeated)]
        parent, replicas, flags = entries, grid.replicas[combos], grid.flags[combos]
        if not straight and not grid.scans_outer:  # many whole-outer-group counts: the closed forms
            end = total - downstream  # exclusive end rank of the new stage
            # (an outer stage takes at least 2 groups: ending before rank 2M, it has no room)
            aligned = _copies(np.nonzero((end % group == 0) & (end >= 2 * group))[0], options)
            aligned_flags = np.repeat(np.array(recompute_options, dtype=bool), len(aligned) // options)
            if len(aligned):
                r_outer = evaluator.fewest_outer(pair[aligned], end[aligned], aligned_flags, downstream[aligned],
                                                 bound)
                keep = r_outer < _NONE
                parent = np.concatenate([parent, aligned[keep]])
                replicas = np.concatenate([replicas, r_outer[keep].astype(np.int64)])
                flags = np.concatenate([flags, aligned_flags[keep]])
        if len(parent) == 0:
            continue
        devices = front.devices[parent] + replicas  # <= total: no candidate starts before rank 0
        stop = front.start[parent]
        cost = front.cost[parent] + (np.where(flags, pairs.fwd[grid.row[start] + stop], 0.0) if track_cost else 0.0)
        offset = 2.0 * (float(np.max(cost)) + 1.0)  # separates the residues' costs below
        # in the order (residue, devices, cost, stop, replicas, flag) (every candidate differs in one of them),
        # only the first of each (residue, devices) can be kept: the others are no cheaper
        outcome = devices % group * (total + 1) + devices
        tie = (stop * (total + 1) + replicas) * 2 + flags
        firsts = _firsts(group * (total + 1), outcome, cost, tie)
        parent, replicas, flags, devices, stop, cost = (
            x[firsts] for x in (parent, replicas, flags, devices, stop, cost))
        order = np.lexsort((tie[firsts], cost, outcome[firsts]))
        residue, cost = devices[order] % group, cost[order]
        keep = np.concatenate([[True], residue[1:] != residue[:-1]])  # the fewest devices of each residue
        if grid.more_devices_can_help:  # every device count (each the cheapest), as more downstream can save memory
            keep[:] = True
        if track_cost:
            # Pareto within each residue: keep an entry only if it is cheaper than every earlier (fewer-device) one
            shifted = cost - residue * offset  # later classes restart the running min
            running = np.minimum.accumulate(np.concatenate([[np.inf], shifted[:-1]]))
            keep = keep | (shifted < running)
        chosen = order[keep]
        front.add(start, parent[chosen], replicas[chosen], flags[chosen], devices[chosen], cost[keep], 0.0)
    at_zero = front.at_zero()
    return [front.plan(entry) for entry in at_zero[np.lexsort((front.devices[at_zero], front.cost[at_zero]))]]


def _least_bound(evaluator: _Evaluator, straight: bool, recompute_options: tuple[bool, ...],
                 upper: float) -> tuple[float, list[Stage]] | None:
    """The least max Q(s) of a plan within memory, at most `upper`, and a plan that has it, of least recompute cost
    among those the pass kept (inf and no plan where none is; None where the closed forms of many whole outer
    groups would be needed: they take a bound). One pass of `_solve_front`'s dynamic program with, per entry, the
    largest Q of its suffix's stages, v, in place of a bound: a candidate stage on an entry has v' = max(v, Q); per
    start the least v' of each device count is kept (of equal v', the least recompute cost c'), then within a
    residue only those below every fewer-device count's (fewer devices never hurt a stage placed before them: the
    module docstring; under zb-h1 with deferred gradients every count, as there). Exact: min over plans of max Q
    is min_d v(0, d), as `smallest_bound`'s bisection finds with many solves. Candidates are pruned by
    `_StageGrid.before_floor` too, so a finite `upper` (a plan that fits: `quick_plans`) saves most of the pass."""
    inputs, pairs = evaluator.inputs, evaluator.pairs
    n, total, group = pairs.num_layers, inputs.cluster.num_devices, inputs.class_size
    grid = _grid(evaluator, straight, recompute_options)
    if not straight and not grid.scans_outer:
        return None
    front = _Front.empty(n, 1 + n * (total + 1))
    for start in range(n - 1, -1, -1):
        entries, combos, new_largest, new_cost = _candidates(grid, front, start, straight, upper, -math.inf, False)
        if len(entries) == 0:
            continue
        new_devices = front.devices[entries] + grid.replicas[combos]
        tie = np.empty(len(entries), dtype=np.int64)
        tie[np.lexsort((np.arange(len(entries)), new_cost))] = np.arange(len(entries))  # distinct, by cost
        chosen = _firsts(total + 1, new_devices, new_largest, tie)
        chosen = chosen[np.argsort(new_devices[chosen])]  # one per device count, ascending
        counts, values = new_devices[chosen], new_largest[chosen]
        if not grid.more_devices_can_help:  # a row per residue, a column per device count of it (ascending)
            table = np.full((group, total // group + 1), np.inf)
            table[counts % group, counts // group] = values
            fewer = np.minimum.accumulate(np.concatenate([np.full((group, 1), np.inf), table[:, :-1]], axis=1), axis=1)
            chosen = chosen[values < fewer[counts % group, counts // group]]
        front.add(start, entries[chosen], grid.replicas[combos[chosen]], grid.flags[combos[chosen]],
                  new_devices[chosen], new_cost[chosen], new_largest[chosen])
    at_zero = front.at_zero()
    if len(at_zero) == 0:
        return math.inf, []
    entry = int(at_zero[np.lexsort((front.cost[at_zero], front.largest[at_zero]))[0]])
    return float(front.largest[entry]), front.plan(entry)


def _candidates(grid: _StageGrid, front: _Front, start: int, straight: bool, upper: float, least: float,
                priced: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(entries, combinations, largest Q, recompute cost) of the candidate stages from `start` on the entries of
    `front` that fit in memory and whose floor, at most `upper`, rules nothing out: the larger of their suffix's
    largest Q, `least` and what the layers before them need (`_StageGrid.before_floor`), plus their recompute cost
    where `priced` (the objective's part that only grows as stages are added before them)."""
    inputs, total = grid.inputs, grid.inputs.cluster.num_devices
    downstream, pair = front.devices[:front.size], grid.row[start] + front.start[:front.size]
    entries, combos = grid.live(pair, downstream, upper, inputs.memory_bytes)
    largest = np.maximum(front.largest[entries], grid.bound(pair[entries], downstream[entries], combos))
    cost = front.cost[entries] + np.where(grid.flags[combos], grid.pairs.fwd[pair[entries]], 0.0)
    left = total - downstream[entries] - grid.replicas[combos]
    floor = np.maximum(np.maximum(largest, least), grid.before_floor(start, left, straight))
    ok = np.nonzero((floor + cost if priced else floor) <= upper)[0]
    if inputs.memory_bytes is not None:
        ok = ok[grid.fits(pair[entries[ok]], downstream[entries[ok]], combos[ok], inputs.memory_bytes)]
    return entries[ok], combos[ok], largest[ok], cost[ok]


def _undominated(residue: np.ndarray, devices: np.ndarray, largest: np.ndarray, cost: np.ndarray,
                 exact_devices: bool) -> np.ndarray:
    """Indices of the entries no other entry of the same residue dominates: one with at most as many devices (the
    same count where `exact_devices`), at most as large a largest Q and at most the cost; of equal entries the
    first. Entries are taken in the order given (the caller's tie order)."""
    order = np.lexsort((np.arange(len(cost)), cost, largest, devices))
    # first, within each device count: the Pareto entries of (largest Q, cost), largest Q ascending
    count, cost_sorted = devices[order], cost[order]
    offset = 2.0 * (float(np.max(np.abs(cost_sorted))) + 1.0)
    shifted = cost_sorted - count * offset  # later counts restart the running min
    running = np.minimum.accumulate(np.concatenate([[np.inf], shifted[:-1]]))
    fresh = np.concatenate([[True], count[1:] != count[:-1]])
    kept = order[fresh | (shifted < running)]
    if exact_devices or len(kept) < 2:
        return kept
    # then across the counts of a residue: dominated by an entry of fewer devices (matrix; few entries survive)
    r, d, v, c = residue[kept], devices[kept], largest[kept], cost[kept]
    dominates = (r[:, None] == r[None, :]) & (d[:, None] < d[None, :]) & (v[:, None] <= v[None, :]) & \
        (c[:, None] <= c[None, :])
    return kept[~dominates.any(axis=0)]


def _least_objectives(evaluator: _Evaluator, straight: bool, recompute_options: tuple[bool, ...], least: float,
                      upper: float) -> list[list[Stage]] | None:
    """The plans within memory with c + max(max Q, `least`) <= `upper` that no other such plan beats in devices,
    max Q and c together (c: its recomputed forwards, so that C + c + max Q is its objective, C the fill and drain
    without them), least c + max Q first, then fewest devices; None where the closed forms of many whole outer
    groups would be needed. One pass of `_solve_front`'s dynamic program whose entries
    carry (devices, largest Q of the suffix v, recompute cost c): a candidate stage on an entry has v' = max(v, Q)
    and c' = c + its forwards if it recomputes; per start an entry is kept unless one of the same residue has at
    most its devices, v and c (fewer devices never hurt a stage placed before them: the module docstring; under
    zb-h1 with deferred gradients, the same device count). Every plan's v and c only grow as stages are added
    before it, so the pass finds min c + v exactly, and the fewest devices of the plans within a tie of it, where
    `_cheaper_recompute` solves at each breakpoint of c (densenet121 on 16 GPUs at 8 GB, 1f1b: 2.4-4.7 s -> 0.7-0.9
    s a microbatch count, the same objectives)."""
    inputs, pairs = evaluator.inputs, evaluator.pairs
    n, total, group = pairs.num_layers, inputs.cluster.num_devices, inputs.class_size
    grid = _grid(evaluator, straight, recompute_options)
    if not straight and not grid.scans_outer:
        return None
    front = _Front.empty(n, 1 + n * (total + 1))
    for start in range(n - 1, -1, -1):
        entries, combos, new_largest, new_cost = _candidates(grid, front, start, straight, upper, least, True)
        if len(entries) == 0:
            continue
        new_devices = front.devices[entries] + grid.replicas[combos]
        keep = _undominated(new_devices % group, new_devices, new_largest, new_cost, grid.more_devices_can_help)
        front.add(start, entries[keep], grid.replicas[combos[keep]], grid.flags[combos[keep]], new_devices[keep],
                  new_cost[keep], new_largest[keep])
    at_zero = front.at_zero()
    order = np.lexsort((front.devices[at_zero], front.cost[at_zero] + front.largest[at_zero]))
    return [front.plan(entry) for entry in at_zero[order]]


def recompute_options(inputs: CostInputs, allow_recompute: bool) -> tuple[bool, ...]:
    """The recompute flags a stage may take: both where allowed and a memory limit is set, except under
    zero-bubble schedules (their W would need the recomputed activations kept from B on: not planned)."""
    allowed = allow_recompute and inputs.memory_bytes is not None and inputs.schedule not in SPLIT_BACKWARD_SCHEDULES
    return (False, True) if allowed else (False,)


def optimize(inputs: CostInputs, straight: bool = False, allow_recompute: bool = True,
             unlimited: Solution | None = None) -> Solution:
    """The plan minimising `schedule_cost.objective_s` on at most the cluster's devices (module docstring).
    `unlimited`: with a memory limit, the best plan of `inputs` without it where the caller has it (gpipe's and
    1f1b's are one: `partition` passes 1f1b's on), or None to find it here; ignored without a limit."""
    if inputs.schedule not in SCHEDULES:
        raise PlannerError(f"unknown schedule {inputs.schedule!r}; use one of {', '.join(SCHEDULES)}")
    if inputs.schedule in CHUNKED_SCHEDULES:
        raise PlannerError(f"the optimizer cuts one stage per rank; {inputs.schedule} plans come from "
                           "planner.planning.chunked (partition does this)")
    if inputs.microbatches < 1:
        raise PlannerError(f"need at least one microbatch, got {inputs.microbatches}")
    if inputs.arrays.num_layers < 1:
        raise PlannerError("the profile has no layers")
    if inputs.memory_bytes is None:
        unlimited = None
    else:
        if unlimited is None:
            unlimited = optimize(replace(inputs, memory_bytes=None), straight, allow_recompute)
        if plan_fits(inputs, list(unlimited.stages)):  # the limit does not bind (module docstring)
            return Solution(unlimited.stages, objective_s(inputs, list(unlimited.stages)))
    pairs = Pairs(inputs)
    evaluator = _Evaluator(inputs, pairs)
    options = recompute_options(inputs, allow_recompute)

    def solve(bound: float, track_cost: bool = False) -> list[Stage] | None:
        return _solve(evaluator, bound, straight, options, track_cost)

    def max_bound(stages: list[Stage]) -> float:
        return max(cost.bound_s for cost in stage_costs(inputs, stages))

    recomputing = inputs.schedule in FLUSH_SCHEDULES and True in options
    # with a memory limit, the least max Q within it in one pass (no plan: inf), where that pass can run
    found = None if unlimited is None else _least_bound(
        evaluator, straight, options, quick_bound(inputs, straight, True in options, [list(unlimited.stages)], TIE))
    least = None if found is None else found[0]
    if least is None:
        best, best_bound = _bisected(inputs, solve, max_bound, straight, options, unlimited)
    elif math.isinf(least):
        raise _infeasible(inputs, straight, options)
    else:
        best, best_bound = found[1], least
    front = None  # every plan that could win or tie, where one pass found them
    if recomputing and found is not None:
        first = found[1]  # (its objective bounds the pass: no worse plan can tie the best)
        upper = (objective_s(inputs, first) * (1.0 + TIE) - fill_drain_s(inputs, [])) * (1.0 + _SLACK)
        front = _least_objectives(evaluator, straight, options, least, upper)
        best = min(front or [first], key=lambda plan: objective_s(inputs, plan))
    elif recomputing:
        best = _cheaper_recompute(inputs, solve, best, best_bound)
    assert best is not None
    best_value = objective_s(inputs, best)
    # ties within the tolerance go to the fewest devices: every Pareto plan whose max Q could tie
    limit = best_value * (1.0 + TIE)
    bound = limit - fill_drain_s(inputs, [])
    if front:
        candidates = front
    elif recomputing:
        candidates = _solve_front(evaluator, bound, straight, options, True)
    else:
        candidates = [plan for plan in [solve(bound)] if plan is not None]
    tied = [plan for plan in candidates if objective_s(inputs, plan) <= limit]
    if tied:
        fewest = min(tied, key=lambda plan: sum(replicas_of(plan)))
        if sum(replicas_of(fewest)) < sum(replicas_of(best)):
            best = fewest
    return Solution(tuple(best), objective_s(inputs, best))


def _bisected(inputs: CostInputs, solve: Callable[[float], list[Stage] | None],
              max_bound: Callable[[list[Stage]], float], straight: bool, options: tuple[bool, ...],
              unlimited: Solution | None) -> tuple[list[Stage], float]:
    """The plan of least max Q and that max Q, by `smallest_bound`'s bisection from any plan (`unlimited`: the
    optimum without the memory limit, which does not fit it); InfeasiblePlanError where no plan fits."""
    best = solve(math.inf)
    if best is None:
        raise _infeasible(inputs, straight, options)
    everywhere = [Stage(0, inputs.arrays.num_layers, inputs.cluster.num_devices, False)]  # data parallelism: a
    if not straight and plan_fits(inputs, everywhere) and max_bound(everywhere) < max_bound(best):  # first bound
        best = everywhere
    # no plan beats perfect division of the work (pipedream); flush bounds start from 0
    per_device = float(inputs.arrays.compute_s[-1]) * inputs.scale / inputs.cluster.num_devices
    low = per_device * (1.0 - 1e-9) if inputs.schedule == "pipedream" else 0.0
    probes = PROBES
    if unlimited is not None:  # nor the best plan without the limit, whose plans include every one within it
        # (less TIE x its objective: its tie-break to fewer devices may have given up that much of the least max Q)
        low = max(low, (max_bound(list(unlimited.stages)) - TIE * unlimited.objective_s) * (1.0 - 1e-9))
        # that plan does not fit: the limit binds and the optimum lies above it, mostly far (x1.1-37 in `planner
        # partition` of resnet50 on 16 GPUs at 16 GB): probes just above `low` would fail
        probes = 0
    return smallest_bound(solve, max_bound, best, low, probes)


_SLACK = 1e-12  # relative: far above the rounding of a plan's objective (a sum of a few terms)


@dataclass
class _Interval:
    """An interval (low, high] of the bound in `_cheaper_recompute`'s search, holding a breakpoint."""

    low: float
    high: float
    low_cost: float  # c(low), more than the plan's
    plan: list[Stage]  # of cost c(high), max Q <= high: solve(high) itself where `solved`
    solved: bool
    guessed: bool  # the last probe, just below the plan's max Q, found a plan as cheap there
    depth: int  # splits so far (a walk bisects each breakpoint at most MAX_STEPS times)


def _cheaper_recompute(inputs: CostInputs, solve, best: list[Stage] | None, lowest_bound: float) -> list[Stage]:
    """The plan of least objective at the cheaper-recompute breakpoints of solve(beta, True) (module docstring).

    Write c(beta) for the recompute cost of solve(beta, True), the least of any plan with max Q <= beta (so
    non-increasing in beta), and C for `fill_drain_s` without recompute. A plan of cost c and max Q q has
    objective C + c + q, so the plans that can win lie at the breakpoints b where c drops: the candidate is
    solve(b') for a b' within a relative TIE above b (as a walk up through every breakpoint, bisecting each
    to that width, finds them). The search keeps intervals (x1, x2] of the bound with c(x1) > c(x2) (a
    breakpoint inside), best first by C + x1 + c(x2): a lower bound on the objective of every candidate
    inside (its max Q is > x1, where every plan costs more; its cost is >= c(x2)). It stops when that bound
    reaches the best objective found: no candidate left can win. A TIE narrow interval gives its candidate
    solve(x2). A wider one is split at a probe, its middle; but where its plan (one of cost c(x2)) would
    itself beat the best plan, its breakpoint is worth locating first: with q the plan's max Q, c is
    constant on [q, x2] (the plan is feasible there), so x2 shrinks to q (1 + TIE/2) (above q's rounding),
    and the probe q (1 - TIE/4) either leaves a TIE narrow interval on its right or finds a plan as cheap
    with a smaller max Q (then the next probe is the middle, so that a run of such plans costs no more
    than bisection). Ties between candidates go to the lower bound, as in the walk up.
    """
    constant = fill_drain_s(inputs, [])

    def cost(plan: list[Stage]) -> float:
        return fill_drain_s(inputs, plan) - constant

    low = lowest_bound * (1.0 + TIE)
    plan = solve(low, True) or best or solve(math.inf, True)  # (a plan reaches `lowest_bound`: the first finds it)
    best, best_value, best_at = plan, objective_s(inputs, plan), low
    high = best_value - constant  # a plan with a larger max Q cannot beat the best one
    if cost(plan) <= 0 or high <= low:
        return best
    top = solve(high, True)
    if top is None or cost(top) >= cost(plan):
        return best
    intervals: list[tuple[float, float, _Interval]] = []  # (lower bound, low: disjoint, so unique, interval)

    def push(interval: _Interval) -> None:
        if cost(interval.plan) < interval.low_cost:  # else c is constant on the interval: no breakpoint
            heapq.heappush(intervals, (constant + interval.low + cost(interval.plan), interval.low, interval))

    push(_Interval(low, high, cost(plan), top, True, False, 0))
    while intervals:
        bound, _, interval = heapq.heappop(intervals)
        if bound >= best_value * (1.0 + _SLACK):  # neither this one nor any later one can win
            break
        x1, x2, right, solved = interval.low, interval.high, interval.plan, interval.solved
        guess = None
        if objective_s(inputs, right) < best_value and interval.depth < MAX_STEPS:  # locate its breakpoint
            own = max(stage.bound_s for stage in stage_costs(inputs, right))
            if x1 < own * (1.0 + TIE / 2) < x2:
                x2, solved = own * (1.0 + TIE / 2), False
            if not interval.guessed and own * (1.0 - TIE / 4) > x1:
                guess = own * (1.0 - TIE / 4)
        if x2 - x1 <= TIE * x2 or interval.depth >= MAX_STEPS:  # the breakpoint, within TIE: the candidate
            candidate = right if solved else solve(x2, True) or right
            value = objective_s(inputs, candidate)
            if (value, x2) < (best_value, best_at):
                best, best_value, best_at = candidate, value, x2
            continue
        probe = (x1 + x2) / 2 if guess is None else guess
        found = solve(probe, True)
        found_cost = interval.low_cost if found is None else cost(found)
        if found is not None:
            as_cheap = guess is not None and found_cost == cost(right)  # a plan as cheap below the guess
            push(_Interval(x1, probe, interval.low_cost, found, True, as_cheap, interval.depth + 1))
        push(_Interval(probe, x2, found_cost, right, solved, False, interval.depth + 1))
    return best


def _infeasible(inputs: CostInputs, straight: bool, options: tuple[bool, ...]) -> InfeasiblePlanError:
    """The error of `inputs`' memory limit, whose smallest memory `_smallest_memory` finds when first read."""
    return InfeasiblePlanError(inputs.memory_bytes or 0, lambda: _smallest_memory(inputs, straight, options),
                               smallest_below=lambda bound: _smallest_memory(inputs, straight, options, bound))


def _smallest_memory(inputs: CostInputs, straight: bool, options: tuple[bool, ...],
                     below: float = math.inf) -> float:
    """The least device memory, a whole MB, at which some plan fits (bisection; the least whole MB where the
    plans that fit grow with the memory); inf where that is `below` bytes or more, which one trial at the whole
    MB under `below` tells. Every trial shares the stage sums and `_solve_front`'s tables (neither depends on
    the memory limit)."""
    pairs = Pairs(inputs)
    grids: dict[tuple[bool, tuple[bool, ...]], _StageGrid] = {}

    def fits(memory: float) -> bool:
        evaluator = _Evaluator(replace(inputs, memory_bytes=memory), pairs)
        evaluator.grids = grids
        return _solve(evaluator, math.inf, straight, options, False) is not None

    whole = stage_cost(inputs, 0, inputs.arrays.num_layers, 1, False, inputs.cluster.num_devices - 1, 1)
    low, high = 0.0, whole.memory_bytes * 1.01 + 1e6
    under = math.ceil(below / 1e6) * 1e6 - 1e6 if math.isfinite(below) else math.inf  # the whole MB under `below`
    if under < high:
        if under <= 0 or not fits(under):
            return math.inf
        high = under
    for _ in range(100):
        if high - low <= 1e5:
            break
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    whole_mb = math.floor(high / 1e6) * 1e6
    return whole_mb if whole_mb > low and fits(whole_mb) else math.ceil(high / 1e6) * 1e6
