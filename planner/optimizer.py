"""The planner's optimizer: stage boundaries, replicas and recompute flags minimising `schedule_cost`.

The objective (see `schedule_cost`) is `fill_drain + max_s Q(s)`, where fill_drain is a constant
plus the recomputed forwards (flush schedules; 0 for pipedream). It is solved exactly by a
search over a bound beta on max_s Q(s):

- solve(beta) is a dynamic program over suffixes of the layers. A state is (first layer i,
  devices d used by layers [i, L)); only d mod M matters for bandwidth (M: second-outermost
  group size; shifting ranks by M changes no link), and among states of one residue fewer
  devices are never worse (fewer devices downstream only lower memory, and leave more for the
  stages before). So each layer keeps a Pareto front of (devices, recompute cost) per residue.
  A stage [i, j) placed on top of a state takes the ranks just before it; it is feasible when
  Q(s) <= beta, memory fits and the placement rule holds. Replica counts up to M are all tried
  (each reaches another residue); beyond M a stage is whole outer groups, every bandwidth it sees
  is the outermost one, and the fewest feasible replicas come from a short fixed-point
  iteration (flush: `_flush_fixed_point`) or the quadratic of PipeDream's objective (pipedream).
- beta is bisected to the smallest feasible value (relative 1e-3), then lowered just below the
  best plan's own max Q until nothing is feasible: exact to a relative 1e-9.
- Recompute costs time in the fill/drain sum, so with a memory limit (the only case where it
  can help) every cheaper-recompute breakpoint of solve(beta) above the smallest beta is found
  by bisection, as long as it can still beat the best plan; the best fill_drain + max Q wins.
- Ties within a relative 1e-9 go to the plan with the fewest devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from planner.bound_search import MAX_STEPS, TIE, smallest_bound
from planner.costmodel import stage_pairs
from planner.errors import InfeasiblePlanError, PlannerError
from planner.schedule_cost import (
    FLUSH_SCHEDULES,
    SCHEDULES,
    CostInputs,
    Stage,
    fill_drain_s,
    in_flight,
    link_bandwidth,
    objective_s,
    placement_ok,
    plan_fits,
    stage_cost,
    stage_costs,
)

_NONE = np.iinfo(np.int64).max // 4  # 'no replica count works'


@dataclass(frozen=True)
class Solution:
    """Stages as (start, stop, replicas, recompute) and the objective (seconds)."""

    stages: tuple[Stage, ...]
    objective_s: float

    @property
    def devices(self) -> int:
        """Devices the plan uses: the sum of its replicas."""
        return sum(stage[2] for stage in self.stages)


class _Pairs:
    """Every candidate stage [i, j), i < j, as flat arrays ordered by i then j (scaled to the microbatch)."""

    def __init__(self, inputs: CostInputs) -> None:
        arrays, sigma = inputs.arrays, inputs.scale
        n = arrays.num_layers
        starts, stops, self.offsets = stage_pairs(n)
        self.num_layers = n
        self.starts, self.stops = starts, stops
        self.fwd = sigma * (arrays.fwd_s[stops] - arrays.fwd_s[starts])
        self.both = sigma * (arrays.compute_s[stops] - arrays.compute_s[starts])
        cut = np.concatenate([arrays.cut_bytes, [0.0]]) * sigma
        self.cut_in = np.where(starts > 0, cut[starts - 1], 0.0)
        self.cut_out = np.where(stops < n, cut[stops - 1], 0.0)
        self.entering = np.where(starts > 0, self.cut_in, sigma * inputs.input_bytes)
        weights = arrays.pair_weight_bytes(starts, stops)  # with copies of shared parameters
        self.weights = weights
        saved = arrays.saved_bytes
        self.saved = sigma * (np.zeros(len(starts)) if saved is None else saved[stops] - saved[starts])


class _Evaluator:
    """Vectorised `schedule_cost.stage_cost`: bound Q(s) and memory of many candidate stages."""

    def __init__(self, inputs: CostInputs, pairs: _Pairs) -> None:
        self.inputs, self.pairs = inputs, pairs
        self.bandwidths = [level.bandwidth_Bps for level in inputs.cluster.levels]
        self.outer_comm = np.maximum(pairs.cut_in, pairs.cut_out) / self.bandwidths[-1]  # both links outermost
        self.combos = _GroupCombos(inputs, pairs) if inputs.memory_bytes is None else None

    def placement_ok(self, first: np.ndarray, replicas: np.ndarray) -> np.ndarray:
        """`schedule_cost.placement_ok`, per element (and not before rank 0)."""
        return (first >= 0) & placement_ok(self.inputs.cluster, first, replicas)

    def terms(
        self, pair: np.ndarray, replicas: np.ndarray, first: np.ndarray, recompute: np.ndarray, downstream: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(Q(s), memory bytes) of stages `pair` with these replicas, first ranks and recompute flags."""
        p, inputs = self.pairs, self.inputs
        r = replicas.astype(float)
        compute = p.both[pair] + np.where(recompute, p.fwd[pair], 0.0)
        last = first + replicas - 1
        comm_in = np.where(p.starts[pair] > 0, p.cut_in[pair] / link_bandwidth(self.inputs.cluster, first - 1, first), 0.0)
        comm_out = np.where(p.stops[pair] < p.num_layers, p.cut_out[pair] / link_bandwidth(self.inputs.cluster, last, last + 1), 0.0)
        weights = p.weights[pair]
        allreduce = np.where(replicas > 1, 2.0 * (r - 1.0) / r * weights / link_bandwidth(self.inputs.cluster, first, last), 0.0)
        if inputs.schedule == "pipedream":
            bound = np.maximum(np.maximum(compute + allreduce, comm_in), comm_out) / r
        else:
            turns = -(-inputs.microbatches // replicas) - 1
            bound = turns * np.maximum(np.maximum(compute, comm_in), comm_out) + allreduce
        return bound, self.memory(pair, replicas, recompute, downstream)

    def memory(self, pair: np.ndarray, replicas: np.ndarray, recompute: np.ndarray, downstream: np.ndarray) -> np.ndarray:
        """Memory per device (bytes) of stages `pair` with `downstream` devices after them."""
        p, inputs = self.pairs, self.inputs
        weights, saved = p.weights[pair], p.saved[pair]
        flights = in_flight(inputs.schedule, inputs.microbatches, replicas, replicas + downstream)
        base, held = weights * (2 + inputs.optimizer_copies), np.where(recompute, p.entering[pair], saved)
        if inputs.schedule == "pipedream":  # the same terms, in the same order, as schedule_cost.stage_cost
            base, held = base - weights, held + weights
        return base + flights * held + np.where(recompute, saved, 0.0)

    def fewest_outer(
        self, pair: np.ndarray, first_end: np.ndarray, recompute: np.ndarray, downstream: np.ndarray, bound: float
    ) -> np.ndarray:
        """Fewest replicas r = k M, k >= 2, ending at rank `first_end` (exclusive), with Q <= bound and
        memory within the limit; _NONE where none works. Every link such a stage sees is outermost."""
        inputs, p = self.inputs, self.pairs
        group = inputs.class_size
        top = self.bandwidths[-1]
        compute = p.both[pair] + np.where(recompute, p.fwd[pair], 0.0)
        comm = self.outer_comm[pair]
        a = 2.0 * p.weights[pair] / top
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
                need = self._flush_fixed_point(np.maximum(compute, comm), a, need, bound, group)
            need = np.ceil(np.minimum(need, 4.0 * _NONE) / group - 1e-9) * group  # a multiple of M
        need = np.where(np.isfinite(need) & (need <= inputs.cluster.num_devices), need, _NONE).astype(np.int64)
        # the closed forms round: step down while the one below still works, else up once
        below = need - group
        use_below = (below >= 2 * group) & self._outer_ok(pair, below, first_end, recompute, downstream, bound, group)
        need = np.where(use_below, below, need)
        fine = self._outer_ok(pair, need, first_end, recompute, downstream, bound, group)
        above = need + group
        need = np.where(fine, need, np.where(self._outer_ok(pair, above, first_end, recompute, downstream, bound, group),
                                             above, _NONE))
        return need

    def _flush_fixed_point(
        self, busy: np.ndarray, a: np.ndarray, lowest: np.ndarray, bound: float, group: int
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
        p, top, r = self.pairs, self.bandwidths[-1], replicas.astype(float)
        compute = p.both[pair] + np.where(recompute, p.fwd[pair], 0.0)
        allreduce = 2.0 * (r - 1.0) / r * p.weights[pair] / top  # every link of the stage is outermost
        if self.inputs.schedule == "pipedream":
            q = np.maximum(compute + allreduce, self.outer_comm[pair]) / r
        else:
            q = (-(-self.inputs.microbatches // replicas) - 1) * np.maximum(compute, self.outer_comm[pair]) + allreduce
        ok = usable & (q <= bound) & (first_end - replicas >= 0)
        if self.inputs.memory_bytes is not None:
            ok &= self.memory(pair, replicas, recompute, downstream) <= self.inputs.memory_bytes
        return ok

    def _memory_replicas(self, pair: np.ndarray, recompute: np.ndarray, downstream: np.ndarray) -> np.ndarray:
        """Lower bound on replicas from memory: n(r) microbatches in flight must fit (see schedule_cost)."""
        inputs, p = self.inputs, self.pairs
        if inputs.memory_bytes is None:
            return np.zeros(len(pair))
        weights, saved = p.weights[pair], p.saved[pair]
        per_flight = np.where(recompute, p.entering[pair], saved)
        base = weights * (2 + inputs.optimizer_copies) + np.where(recompute, saved, 0.0)
        if inputs.schedule == "pipedream":
            per_flight, base = per_flight + weights, base - weights
        with np.errstate(divide="ignore", invalid="ignore"):
            flights = np.where(per_flight > 0, np.floor((inputs.memory_bytes - base) / per_flight + 1e-9), np.inf)
        flights = np.where(base > inputs.memory_bytes, -np.inf, flights)  # (+1e-9: a plan exactly at the
        # limit must not be lost to rounding; every candidate is checked exactly afterwards)
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
        return by_depth


@dataclass
class _Front:
    """Every Pareto entry of every suffix, as parallel arrays; entry 0 is the empty suffix."""

    devices: np.ndarray
    cost: np.ndarray
    stop: np.ndarray  # first layer of the suffix the entry extends (its own start is its state)
    parent: np.ndarray
    replicas: np.ndarray
    recompute: np.ndarray
    start: np.ndarray


def _solve(
    evaluator: _Evaluator, bound: float, straight: bool, recompute_options: tuple[bool, ...], track_cost: bool
) -> list[Stage] | None:
    """The plan with every Q(s) <= bound of least recompute cost (if tracked), then fewest devices."""
    if evaluator.inputs.memory_bytes is None:
        return _solve_unlimited(evaluator, evaluator.combos, bound, straight)
    found = _solve_front(evaluator, bound, straight, recompute_options, track_cost)
    return found[0] if found else None


def _solve_front(
    evaluator: _Evaluator, bound: float, straight: bool, recompute_options: tuple[bool, ...], track_cost: bool
) -> list[list[Stage]]:
    """Every Pareto plan (devices, recompute cost) for the whole model with every Q(s) <= bound,
    least cost first, then fewest devices."""
    inputs, pairs = evaluator.inputs, evaluator.pairs
    n, total, group = pairs.num_layers, inputs.cluster.num_devices, inputs.class_size
    front = _Front(*(np.zeros(1, dtype=t) for t in (np.int64, float, np.int64, np.int64, np.int64, bool, np.int64)))
    front.start[0], front.stop[0], front.parent[0] = n, n, -1
    small = np.arange(1, (1 if straight else group) + 1)
    for start in range(n - 1, -1, -1):
        entries = np.nonzero(front.start > start)[0]
        pair = pairs.offsets[start] + front.start[entries] - start - 1
        downstream = front.devices[entries]
        end = total - downstream  # exclusive end rank of the new stage
        pieces = []
        for recompute in recompute_options:
            flags = np.full(len(entries), recompute)
            # replica counts 1..M: each reaches its own residue class
            r = np.broadcast_to(small, (len(entries), len(small)))
            e_pair, e_down, e_end = (np.repeat(x, len(small)) for x in (pair, downstream, end))
            e_flag, e_entry, r = np.repeat(flags, len(small)), np.repeat(entries, len(small)), r.ravel()
            q, memory = evaluator.terms(e_pair, r, e_end - r, e_flag, e_down)
            ok = (q <= bound) & evaluator.placement_ok(e_end - r, r)
            if inputs.memory_bytes is not None:
                ok &= memory <= inputs.memory_bytes
            pieces.append((e_entry[ok], r[ok], e_flag[ok]))
            if not straight:  # whole outer groups: the fewest that work
                aligned = end % group == 0
                r_outer = evaluator.fewest_outer(pair[aligned], end[aligned], flags[aligned], downstream[aligned], bound)
                keep = r_outer < _NONE
                pieces.append((entries[aligned][keep], r_outer[keep], flags[aligned][keep]))
        parent = np.concatenate([piece[0] for piece in pieces])
        replicas = np.concatenate([piece[1] for piece in pieces]).astype(np.int64)
        flags = np.concatenate([piece[2] for piece in pieces]).astype(bool)
        devices = front.devices[parent] + replicas
        fits = devices <= total
        parent, replicas, flags, devices = parent[fits], replicas[fits], flags[fits], devices[fits]
        if len(parent) == 0:
            continue
        stop = front.start[parent]
        cost = front.cost[parent] + (np.where(flags, pairs.fwd[pairs.offsets[start] + stop - start - 1], 0.0)
                                     if track_cost else 0.0)
        residue = devices % group
        order = np.lexsort((flags, replicas, stop, cost, devices, residue))
        residue, devices, cost = residue[order], devices[order], cost[order]
        keep = np.concatenate([[True], residue[1:] != residue[:-1]])  # the fewest devices of each residue
        if track_cost:
            # Pareto within each residue: keep an entry only if it is cheaper than every earlier (fewer-device) one
            shifted = cost - residue * (2.0 * (float(np.max(cost)) + 1.0))  # later classes restart the running min
            running = np.minimum.accumulate(np.concatenate([[np.inf], shifted[:-1]]))
            keep = keep | (shifted < running)
        chosen = order[keep]
        front.devices = np.concatenate([front.devices, devices[keep]])
        front.cost = np.concatenate([front.cost, cost[keep]])
        front.stop = np.concatenate([front.stop, stop[order][keep]])
        front.parent = np.concatenate([front.parent, parent[chosen]])
        front.replicas = np.concatenate([front.replicas, replicas[chosen]])
        front.recompute = np.concatenate([front.recompute, flags[chosen]])
        front.start = np.concatenate([front.start, np.full(int(keep.sum()), start)])
    at_zero = np.nonzero(front.start == 0)[0]
    plans = []
    for entry in at_zero[np.lexsort((front.devices[at_zero], front.cost[at_zero]))]:
        stages = []
        while front.start[entry] < n:
            stages.append((int(front.start[entry]), int(front.stop[entry]), int(front.replicas[entry]),
                           bool(front.recompute[entry])))
            entry = int(front.parent[entry])
        plans.append(stages)
    return plans


class _GroupCombos:
    """Stage shapes for plans without a memory limit, by combination of residue and replicas.

    A state (layer j, rho) holds the fewest devices D with D mod M = rho used by layers [j, L);
    a stage [i, j) with r replicas on top of it ends at rank total - D, whose residue fixes every
    link the stage sees (shifting ranks by M changes no bandwidth). Combination k is a pair
    (rho_k, r_k) that obeys the placement rule; it leads to residue (rho_k + r_k) mod M. They are
    every r <= M inside one group and, for flush schedules, whole outer groups r = k M >= 2 M from
    residue 0: the least r for each value of ceil(m / r), since among equal turns the fewest
    replicas have the least all-reduce. (pipedream's Q falls with r, so its outer stages come from
    `_Evaluator.fewest_outer` per bound.) Q of every stage and combination is a function of the
    stage's sums and the combination's three bandwidths (in, out, all-reduce) alone.
    """

    def __init__(self, inputs: CostInputs, pairs: _Pairs) -> None:
        self.inputs, self.pairs = inputs, pairs
        group, cluster = inputs.class_size, inputs.cluster
        rho, replicas = [], []
        for downstream in range(group):
            end = (-downstream) % group  # residue of the stage's exclusive end rank
            room = end if end > 0 else group  # ranks left in the group below the end
            for r in range(1, room + 1):
                rho.append(downstream)
                replicas.append(r)
        if inputs.schedule in FLUSH_SCHEDULES:
            turns = inputs.microbatches
            for r in range(2 * group, cluster.num_devices + 1, group):
                if -(-inputs.microbatches // r) - 1 < turns:
                    turns = -(-inputs.microbatches // r) - 1
                    rho.append(0)
                    replicas.append(r)
        self.rho, self.replicas = np.array(rho, dtype=np.int64), np.array(replicas, dtype=np.int64)
        self.next_rho = (self.rho + self.replicas) % group
        end = (-self.rho) % group
        end = np.where(end > 0, end, np.maximum(group, self.replicas))  # a representative end rank (>= r)
        first = end - self.replicas
        self.bw_in = link_bandwidth(cluster, first - 1, first)
        self.bw_out = link_bandwidth(cluster, end - 1, end)
        self.bw_allreduce = link_bandwidth(cluster, first, end - 1)
        self.turns = (-(-inputs.microbatches // self.replicas) - 1).astype(float)
        self.share = 2.0 * (self.replicas - 1.0) / self.replicas  # ring all-reduce traffic per weight byte
        small = len(pairs.starts) * len(self.rho) <= _CACHE_ENTRIES
        self._cache = self._compute(slice(None)) if small else None
        whole = int(np.nonzero((self.rho == 0) & (self.replicas == group))[0][0])
        self.lowest = np.empty(len(pairs.starts))  # least Q of each pair inside a group
        self.whole_group_q = np.empty(len(pairs.starts))  # Q on a whole inner group
        for i in range(pairs.num_layers):
            where = slice(int(pairs.offsets[i]), int(pairs.offsets[i + 1]))
            row = self.bounds(where)
            self.lowest[where], self.whole_group_q[where] = row.min(axis=1), row[:, whole]

    def bounds(self, where: slice) -> np.ndarray:
        """Q of the pairs in `where` (rows) under every combination (columns), seconds."""
        return self._cache[where] if self._cache is not None else self._compute(where)

    def _compute(self, where: slice) -> np.ndarray:
        """`bounds` from the stage sums: turns max(t, c_in, c_out) + ar (flush) or max(t + ar, c_in, c_out) / r."""
        p = self.pairs
        compute = p.both[where][:, None]
        comm_in = p.cut_in[where][:, None] / self.bw_in
        comm_out = p.cut_out[where][:, None] / self.bw_out
        allreduce = self.share * p.weights[where][:, None] / self.bw_allreduce
        if self.inputs.schedule == "pipedream":
            return np.maximum(np.maximum(compute + allreduce, comm_in), comm_out) / self.replicas
        return self.turns * np.maximum(np.maximum(compute, comm_in), comm_out) + allreduce


_CACHE_ENTRIES = 8_000_000  # Q values (8 bytes each) kept across bounds; larger tables are recomputed


def _solve_unlimited(evaluator: _Evaluator, combos: _GroupCombos, bound: float, straight: bool) -> list[Stage] | None:
    """`_solve` without a memory limit: one state per (layer, residue), the fewest devices.

    E[i, rho'] = min over stops j and combinations k with next_rho_k = rho' of E[j, rho_k] + r_k
    over stages with Q <= bound; stages on whole outer groups (r = k M >= 2 M, only from residue
    0, every link outermost) add E[j, 0] + fewest_outer(i, j), needed only where the whole inner
    group (same residue, fewer devices) fails. Stops beyond the last one any stage from i can
    reach are skipped. Ties go to the shortest stage, then the fewest replicas.
    """
    inputs, pairs = evaluator.inputs, evaluator.pairs
    n, total, group = pairs.num_layers, inputs.cluster.num_devices, inputs.class_size
    usable = combos.replicas == 1 if straight else np.ones(len(combos.rho), dtype=bool)
    order = np.argsort(combos.next_rho[usable], kind="stable")
    columns = np.nonzero(usable)[0][order]
    rho, replicas, next_rho = combos.rho[columns], combos.replicas[columns], combos.next_rho[columns]
    present = np.isin(np.arange(group), next_rho)
    heads = np.searchsorted(next_rho, np.arange(group)[present])
    reach = combos.lowest <= bound
    outer = None
    if not straight and total >= 2 * group and inputs.schedule == "pipedream":
        outer = np.full(len(pairs.starts), _NONE, dtype=np.int64)
        need = np.nonzero(combos.whole_group_q > bound)[0]
        outer[need] = evaluator.fewest_outer(need, np.full(len(need), total), np.zeros(len(need), dtype=bool),
                                             np.zeros(len(need), dtype=np.int64), bound)
        reach |= outer < _NONE
    last_stop = np.maximum.reduceat(np.where(reach, pairs.stops, 0), pairs.offsets[:-1])
    worst = total + 1  # 'no plan'; keys below encode (devices, stop, replicas) in one integer
    stride_r = max(total, group) + 1
    stride_j = (n + 1) * stride_r
    best = np.full((n + 1, group), worst, dtype=np.int64)
    best[n, 0] = 0
    key = np.full((n + 1, group), worst * stride_j, dtype=np.int64)
    for start in range(n - 1, -1, -1):
        width = int(last_stop[start]) - start
        if width <= 0:
            continue
        where = slice(int(pairs.offsets[start]), int(pairs.offsets[start]) + width)
        stops = np.arange(start + 1, start + 1 + width)
        downstream = best[start + 1:start + 1 + width]
        devices = np.minimum(downstream[:, rho] + replicas, worst)
        devices = np.where((combos.bounds(where)[:, columns] <= bound) & (devices <= total), devices, worst)
        keys = (devices * (n + 1) + stops[:, None]) * stride_r + replicas
        row = np.full(group, worst * stride_j, dtype=np.int64)
        row[present] = np.minimum.reduceat(keys.min(axis=0), heads)
        if outer is not None:
            extra = outer[where]
            devices = np.minimum(downstream[:, 0] + extra, worst)
            devices = np.where(devices <= total, devices, worst)
            row[0] = min(row[0], int(((devices * (n + 1) + stops) * stride_r + np.minimum(extra, stride_r - 1)).min()))
        key[start] = row
        best[start] = np.minimum(row // stride_j, worst)
    residues = np.nonzero(best[0] <= total)[0]
    if len(residues) == 0:
        return None
    state = int(residues[np.argmin(best[0, residues])])
    stages, start = [], 0
    while start < n:
        code = int(key[start, state])
        stop, r = (code // stride_r) % (n + 1), code % stride_r
        stages.append((start, stop, r, False))
        start, state = stop, (state - r) % group
    return stages


def optimize(inputs: CostInputs, straight: bool = False, allow_recompute: bool = True) -> Solution:
    """The plan minimising `schedule_cost.objective_s` on at most the cluster's devices (module docstring)."""
    if inputs.schedule not in SCHEDULES:
        raise PlannerError(f"unknown schedule {inputs.schedule!r}; use one of {', '.join(SCHEDULES)}")
    if inputs.microbatches < 1:
        raise PlannerError(f"need at least one microbatch, got {inputs.microbatches}")
    if inputs.arrays.num_layers < 1:
        raise PlannerError("the profile has no layers")
    pairs = _Pairs(inputs)
    evaluator = _Evaluator(inputs, pairs)
    options = (False, True) if allow_recompute and inputs.memory_bytes is not None else (False,)

    def solve(bound: float, track_cost: bool = False) -> list[Stage] | None:
        return _solve(evaluator, bound, straight, options, track_cost)

    def max_bound(stages: list[Stage]) -> float:
        return max(cost.bound_s for cost in stage_costs(inputs, stages))

    best = solve(math.inf)
    if best is None:
        raise InfeasiblePlanError(inputs.memory_bytes or 0, _smallest_memory(inputs, straight, options))
    everywhere = [(0, inputs.arrays.num_layers, inputs.cluster.num_devices, False)]  # data parallelism: a
    if not straight and plan_fits(inputs, everywhere) and max_bound(everywhere) < max_bound(best):  # first bound
        best = everywhere
    # no plan beats perfect division of the work (pipedream); flush bounds start from 0
    per_device = float(inputs.arrays.compute_s[-1]) * inputs.scale / inputs.cluster.num_devices
    low = per_device * (1.0 - 1e-9) if inputs.schedule == "pipedream" else 0.0
    best, best_bound = smallest_bound(solve, max_bound, best, low)
    if inputs.schedule in FLUSH_SCHEDULES and True in options:
        best = _cheaper_recompute(inputs, solve, best, best_bound)
    best_value = objective_s(inputs, best)
    # ties within the tolerance go to the fewest devices: every Pareto plan whose max Q could tie
    limit = best_value * (1.0 + TIE)
    bound = limit - fill_drain_s(inputs, [])
    if True in options and inputs.schedule in FLUSH_SCHEDULES:
        candidates = _solve_front(evaluator, bound, straight, options, True)
    else:
        candidates = [plan for plan in [solve(bound)] if plan is not None]
    tied = [plan for plan in candidates if objective_s(inputs, plan) <= limit]
    if tied:
        fewest = min(tied, key=lambda plan: sum(stage[2] for stage in plan))
        if sum(stage[2] for stage in fewest) < sum(stage[2] for stage in best):
            best = fewest
    return Solution(tuple(best), objective_s(inputs, best))


def _cheaper_recompute(inputs: CostInputs, solve, best: list[Stage], lowest_bound: float) -> list[Stage]:
    """Walk up the bound through every breakpoint where less recompute becomes possible (module docstring)."""
    constant = fill_drain_s(inputs, [])
    plan = solve(lowest_bound * (1.0 + TIE), True) or best
    best, best_value = plan, objective_s(inputs, plan)
    low = lowest_bound * (1.0 + TIE)
    current_cost = fill_drain_s(inputs, plan) - constant
    for _ in range(MAX_STEPS):
        if current_cost <= 0:
            break
        high = best_value - constant  # a plan with a larger max Q cannot beat the best one
        if high <= low:
            break
        cheaper = solve(high, True)
        if cheaper is None or fill_drain_s(inputs, cheaper) - constant >= current_cost:
            break
        for _ in range(MAX_STEPS):  # the smallest bound at which a cheaper plan exists
            if high - low <= TIE * high:
                break
            middle = (low + high) / 2
            plan = solve(middle, True)
            if plan is not None and fill_drain_s(inputs, plan) - constant < current_cost:
                high, cheaper = middle, plan
            else:
                low = middle
        value = objective_s(inputs, cheaper)
        if value < best_value:
            best, best_value = cheaper, value
        current_cost = fill_drain_s(inputs, cheaper) - constant
        low = high
    return best


def _smallest_memory(inputs: CostInputs, straight: bool, options: tuple[bool, ...]) -> float:
    """The least device memory, rounded up to a whole MB, at which some plan fits (bisection)."""

    def fits(memory: float) -> bool:
        trial = replace(inputs, memory_bytes=memory)
        return _solve(_Evaluator(trial, _Pairs(trial)), math.inf, straight, options, False) is not None

    whole = stage_cost(inputs, 0, inputs.arrays.num_layers, 1, False, inputs.cluster.num_devices - 1, 1)
    low, high = 0.0, whole.memory_bytes * 1.01 + 1e6
    for _ in range(100):
        if high - low <= 1e5:
            break
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    whole_mb = math.floor(high / 1e6) * 1e6
    return whole_mb if whole_mb > low and fits(whole_mb) else math.ceil(high / 1e6) * 1e6
