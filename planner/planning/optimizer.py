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

Without a memory limit (the default) solve(beta) is `unlimited_dp.solve_unlimited`: one state
per (layer, residue), the fewest devices. Here: the memory-limited DP over Pareto fronts, the
bound search and the tie and recompute rules. Stage sums come from `stage_sums.Pairs`.

Why one module of ~400 lines: the evaluator of the objective and the search over bounds share one cost
model state (`_Evaluator`); the memory-free fast path is `unlimited_dp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from planner.planning.bound_search import MAX_STEPS, TIE, Solution, smallest_bound
from planner.errors import InfeasiblePlanError, PlannerError
from planner.costs.schedule_cost import (
    CostInputs,
    Stage,
    accumulate_terms,
    allreduce_s,
    fill_drain_s,
    link_terms,
    memory_terms,
    objective_s,
    placement_ok,
    plan_fits,
    replicas_of,
    stage_cost,
    stage_costs,
    step_terms,
    time_terms,
    transfer_s,
)
from planner.schedules.schedule import CHUNKED_SCHEDULES, FLUSH_SCHEDULES, SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from planner.costs.stage_sums import Pairs
from planner.planning.unlimited_dp import GroupCombos, solve_unlimited

_NONE = np.iinfo(np.int64).max // 4  # 'no replica count works'


class _Evaluator:
    """Vectorised `schedule_cost.stage_cost`: bound Q(s) and memory of many candidate stages."""

    def __init__(self, inputs: CostInputs, pairs: Pairs) -> None:
        self.inputs, self.pairs = inputs, pairs
        outermost = inputs.cluster.levels[-1]
        self.top, self.top_latency = outermost.bandwidth_Bps, outermost.latency_s
        self.outer_comm = np.maximum(  # both links outermost
            transfer_s(pairs.cut_in, self.top, self.top_latency, pairs.starts > 0),
            transfer_s(pairs.cut_out, self.top, self.top_latency, pairs.stops < pairs.num_layers))
        self.combos = GroupCombos(inputs, pairs) if inputs.memory_bytes is None else None

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
        allreduce = allreduce_s(p.replicated[pair], replicas, *link_terms(cluster, first, last))
        _, bound = time_terms(inputs.schedule, inputs.microbatches, replicas, compute, comm_in, comm_out, allreduce,
                              step_terms(inputs, p.weights[pair], p.tensors[pair]),
                              accumulate_terms(inputs, p.weights[pair]), p.weight[pair])
        return bound, self.memory(pair, replicas, recompute, downstream)

    def memory(self, pair: np.ndarray, replicas: np.ndarray, recompute: np.ndarray, downstream: np.ndarray) -> np.ndarray:
        """Memory per device (bytes) of stages `pair` with `downstream` devices after them."""
        p = self.pairs
        return memory_terms(self.inputs, replicas, replicas + downstream, p.weights[pair], p.saved[pair],
                            p.entering[pair], recompute, p.workspace[pair], p.deferred[pair])[4]

    def fewest_outer(
        self, pair: np.ndarray, first_end: np.ndarray, recompute: np.ndarray, downstream: np.ndarray, bound: float
    ) -> np.ndarray:
        """Fewest replicas r = k M, k >= 2, ending at rank `first_end` (exclusive), with Q <= bound and
        memory within the limit; _NONE where none works. Every link such a stage sees is outermost."""
        inputs, p = self.inputs, self.pairs
        group = inputs.class_size
        if (self.top_latency > 0 or self.inputs.step_s_per_byte > 0 or self.inputs.accumulate_s_per_byte > 0
                or self.inputs.step_s_per_tensor > 0):
            # the closed forms below leave latency, the optimizer step and accumulation out: try every count
            return self._fewest_outer_scan(pair, first_end, recompute, downstream, bound)
        top = self.top
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
        return np.where(below_ok, tried[:count], np.where(need_ok, need, np.where(above_ok, tried[2 * count:], _NONE)))

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
        allreduce = allreduce_s(p.replicated[pair], replicas, self.top, self.top_latency)  # every link is outermost
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
        optimizer step's scratch (see schedule_cost); inf where nothing fits. zb-h1's deferred gradients
        are left out (less memory: a lower bound still; `_outer_ok` checks the memory exactly)."""
        inputs, p = self.inputs, self.pairs
        if inputs.memory_bytes is None:
            return np.zeros(len(pair))
        weights, saved = p.weights[pair], p.saved[pair]
        per_flight = np.where(recompute, p.entering[pair], saved)
        in_backward = np.where(recompute, saved, 0.0) + p.workspace[pair]  # rebuilt (memory_terms)
        base = weights * (2 + inputs.optimizer_copies) + in_backward
        if inputs.schedule == "pipedream":
            per_flight, base = per_flight + weights, base - weights
        with np.errstate(divide="ignore", invalid="ignore"):
            flights = np.where(per_flight > 0, np.floor((inputs.memory_bytes - base) / per_flight + 1e-9), np.inf)
        flights = np.where(base > inputs.memory_bytes, -np.inf, flights)  # (+1e-9: a plan exactly at the
        # limit must not be lost to rounding; every candidate is checked exactly afterwards)
        stepping = base - in_backward + inputs.scratch_per_byte * weights  # the optimizer step's
        flights = np.where(stepping > inputs.memory_bytes, -np.inf, flights)  # peak does not depend on replicas
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
        if inputs.schedule == "zb-h1":  # in flight min(ceil(m / r), ceil(D / r) + ceil((P - D) / r)) >= min(.., P / r),
            devices = float(inputs.cluster.num_devices)  # P the cluster's devices (`schedule_cost.memory_terms`)
            with np.errstate(divide="ignore", invalid="ignore"):
                by_total = np.where(flights >= 1, np.ceil(devices / flights - 1e-9), np.inf)
            return np.minimum(by_count, by_total)
        return by_depth


def _copies(values: np.ndarray, count: int) -> np.ndarray:
    """`values` repeated `count` times end to end (np.tile of a 1-D array, without its overhead)."""
    return values if count == 1 else np.concatenate((values,) * count)


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
        return solve_unlimited(evaluator.combos, bound, straight)
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
        # every recompute option at once: entries repeated once per option
        options = len(recompute_options)
        entries, pair, downstream, end = (_copies(x, options) for x in (entries, pair, downstream, end))
        flags = np.repeat(np.array(recompute_options, dtype=bool), len(entries) // options)
        # replica counts 1..M: each reaches its own residue class
        r = np.tile(small, len(entries))
        e_pair, e_down, e_end, e_flag, e_entry = (np.repeat(x, len(small)) for x in (pair, downstream, end, flags, entries))
        q, memory = evaluator.terms(e_pair, r, e_end - r, e_flag, e_down)
        ok = (q <= bound) & evaluator.placement_ok(e_end - r, r)
        if inputs.memory_bytes is not None:
            ok &= memory <= inputs.memory_bytes
        pieces = [(e_entry[ok], r[ok], e_flag[ok])]
        aligned = end % group == 0
        if not straight and aligned.any():  # whole outer groups: the fewest that work
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
            stages.append(Stage(int(front.start[entry]), int(front.stop[entry]), int(front.replicas[entry]),
                                bool(front.recompute[entry])))
            entry = int(front.parent[entry])
        plans.append(stages)
    return plans


def recompute_options(inputs: CostInputs, allow_recompute: bool) -> tuple[bool, ...]:
    """The recompute flags a stage may take: both where allowed and a memory limit is set, except under
    zero-bubble schedules (their W would need the recomputed activations kept from B on: not planned)."""
    allowed = allow_recompute and inputs.memory_bytes is not None and inputs.schedule not in SPLIT_BACKWARD_SCHEDULES
    return (False, True) if allowed else (False,)


def optimize(inputs: CostInputs, straight: bool = False, allow_recompute: bool = True) -> Solution:
    """The plan minimising `schedule_cost.objective_s` on at most the cluster's devices (module docstring)."""
    if inputs.schedule not in SCHEDULES:
        raise PlannerError(f"unknown schedule {inputs.schedule!r}; use one of {', '.join(SCHEDULES)}")
    if inputs.schedule in CHUNKED_SCHEDULES:
        raise PlannerError(f"the optimizer cuts one stage per rank; {inputs.schedule} plans come from "
                           "planner.planning.chunked (partition does this)")
    if inputs.microbatches < 1:
        raise PlannerError(f"need at least one microbatch, got {inputs.microbatches}")
    if inputs.arrays.num_layers < 1:
        raise PlannerError("the profile has no layers")
    pairs = Pairs(inputs)
    evaluator = _Evaluator(inputs, pairs)
    options = recompute_options(inputs, allow_recompute)

    def solve(bound: float, track_cost: bool = False) -> list[Stage] | None:
        return _solve(evaluator, bound, straight, options, track_cost)

    def max_bound(stages: list[Stage]) -> float:
        return max(cost.bound_s for cost in stage_costs(inputs, stages))

    best = solve(math.inf)
    if best is None:
        raise InfeasiblePlanError(inputs.memory_bytes or 0, _smallest_memory(inputs, straight, options))
    everywhere = [Stage(0, inputs.arrays.num_layers, inputs.cluster.num_devices, False)]  # data parallelism: a
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
        fewest = min(tied, key=lambda plan: sum(replicas_of(plan)))
        if sum(replicas_of(fewest)) < sum(replicas_of(best)):
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
        return _solve(_Evaluator(trial, Pairs(trial)), math.inf, straight, options, False) is not None

    whole = stage_cost(inputs, 0, inputs.arrays.num_layers, 1, False, inputs.cluster.num_devices - 1, 1)
    low, high = 0.0, whole.memory_bytes * 1.01 + 1e6
    for _ in range(100):
        if high - low <= 1e5:
            break
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    whole_mb = math.floor(high / 1e6) * 1e6
    return whole_mb if whole_mb > low and fits(whole_mb) else math.ceil(high / 1e6) * 1e6
