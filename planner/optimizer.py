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


@dataclass
class _Candidates:
    """The candidate stages of `_solve_unlimited` for every bound in [low, high], in segments.

    Segment s = start G + g (G target residues, g the index of one) holds every stage [start, stop)
    under a combination leading to that residue with Q <= high, then a sentinel (Q = -inf, key
    'no plan'), so that no segment is ever empty. Per entry: `q` (Q, seconds), `slot` (the
    downstream state, stop M + rho, as a flat index into the DP's table; the sentinel's slot
    always holds 'no plan') and `offset` (replicas stride_j + stop stride_r + replicas: the DP's
    key less the downstream devices times stride_j).
    """

    asked: float  # the bound it was built for
    low: float
    high: float
    straight: bool
    targets: np.ndarray  # the residues reached, one per segment of a start
    q: np.ndarray
    slot: np.ndarray
    offset: np.ndarray
    heads: np.ndarray  # first entry of each segment

    @property
    def entries(self) -> int:
        """Entries other than sentinels."""
        return len(self.q) - len(self.heads)


_Piece = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # segment, q, slot, offset per entry
_MARGIN = 0.02  # a new candidate list serves bounds within this relative distance of the one that asked
_SLACK = 3.0  # a held list is rebuilt when it has more entries than this times the stops a new one evaluates


def _runs(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """first[0], ..., first[0] + counts[0] - 1, first[1], ...: consecutive runs, concatenated."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(first - (ends - counts), counts)


class _GroupCombos:
    """Stage shapes for plans without a memory limit, by combination of residue and replicas, and
    the candidate stages of `_solve_unlimited` at a bound.

    A state (layer j, rho) holds the fewest devices D with D mod M = rho used by layers [j, L);
    a stage [i, j) with r replicas on top of it ends at rank total - D, whose residue fixes every
    link the stage sees (shifting ranks by M changes no bandwidth). Combination k is a pair
    (rho_k, r_k) that obeys the placement rule; it leads to residue (rho_k + r_k) mod M. They are
    every r <= M inside one group and, for flush schedules, whole outer groups r = k M >= 2 M from
    residue 0: the least r for each value of ceil(m / r), since among equal turns the fewest
    replicas have the least all-reduce. Q of every stage and combination is a function of the
    stage's sums and the combination's three bandwidths (in, out, all-reduce) alone.

    Stops worth evaluating. With t(i, j) = T[j] - T[i] (T: prefix sums of sigma times) and
    W_own(i, j) = P[j] - P[i] <= W(i, j) (P: prefix sums of parameter bytes; W adds copies of
    shared parameters, never fewer bytes), every combination's Q is at least a prefix difference:

        flush:     Q = turns_k max(t, c_in, c_out) + share_k W / bw_k >= turns_k t + share_k W_own / bw_k
        pipedream: Q = max(t + ar, c_in, c_out) / r_k >= (t + share_k W_own / bw_k) / r_k

    i.e. Q <= beta needs G_k[j] - G_k[i] <= m_k beta, G_k = a_k T + w_k P (a_k = turns_k, m_k = 1
    for flush; a_k = 1, m_k = r_k for pipedream; w_k = share_k / bw_k). The last such stop of each
    start comes from a binary search on the running minimum of G_k from the right (right for any
    signs of the sums), with a margin (relative 1e-9 of beta, 1e-12 of G's scale) far above
    rounding; only the stops up to it are evaluated, with the same formula as ever, and those with
    Q <= beta kept. Most combinations need far fewer stops than the widest one.

    Whole outer groups for pipedream. Q(r) = max(t + 2 (r - 1) / r W / bw, c) / r falls as r grows
    (r = k M, 2 <= k <= total / M; every link outermost), so the fewest r with Q(r) <= beta comes
    from bisection over k. For every beta in [low, high] it lies between the fewest at high and
    the fewest at low, and each r in between is a candidate of its own: among those with Q <= beta
    the DP's least key is the fewest (same stop and state, fewer devices). Stages whose whole inner
    group fits at low need none (r = M reaches the same residue with fewer devices).

    Reuse across bounds. A list built for [low, high] serves every bound in that range by keeping
    the entries with Q <= beta; one is built for [beta / (1 + margin), beta (1 + margin)] when beta
    is outside the held one's range or the held one has more than `_SLACK` times the entries a
    new one would evaluate, widened on the side the bound moved to by the step from the last
    build's bound (a bisection's later bounds mostly stay within it). Flush schedules have no outer
    candidates, hence no lower end.

    Ranges (pipedream without shared parameters, prefix sums nondecreasing): no list at all.
    Q = max(t + ar, c_in, c_out) / r_k <= beta exactly when each of (t + ar) / r_k, c_in / r_k and
    c_out / r_k is (rounding is monotone, so it commutes with max and with dividing by r_k); c_in
    depends on the start alone, c_out on the stop alone, and the rounded t + ar never falls as
    the stop grows. So the stops of start i that fit under k are those up to a last one J_k(i)
    (bisection below the prefix bound, bracketed by earlier bounds' J_k, which grow with beta) whose
    c_out / r_k fits, and the DP's minimum over them is a range minimum over stops of
    E[j, rho_k] stride_j + j stride_r (none where c_out does not fit): two reads of a sparse table
    (minima of 2^l consecutive stops) that grows by one stop per start. Outer groups are one
    combination per r = k M from residue 0, all leading to residue 0: the least key among them
    is the fewest r that fits, as above.
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
        n, total = pairs.num_layers, cluster.num_devices
        self.worst = total + 1  # 'no plan'; DP keys encode (devices, stop, replicas) in one integer
        self.stride_r = max(total, group) + 1
        self.stride_j = (n + 1) * self.stride_r
        self.top = float(cluster.levels[-1].bandwidth_Bps)
        self.outer = np.arange(2 * group, total + 1, group) if inputs.schedule == "pipedream" else np.zeros(0, int)
        self.outer_comm = np.maximum(pairs.cut_in, pairs.cut_out) / self.top  # both links outermost
        self.whole = int(np.nonzero((self.rho == 0) & (self.replicas == group))[0][0])
        self._whole_group_q: np.ndarray | None = None  # Q on a whole inner group, computed when first needed
        self._time = inputs.scale * inputs.arrays.compute_s
        copies_add = all(nbytes >= 0 for _, _, nbytes in inputs.arrays.shared)
        self._weight = inputs.arrays.param_bytes if copies_add else np.zeros(n + 1)
        self._held: _Candidates | None = None
        self._ranges: dict[bool, _RangeColumns | None] = {}

    def ranges(self, straight: bool) -> _RangeColumns | None:
        """Pipedream's combinations as range minima, where t + ar grows with the stop (no shared
        parameters, nondecreasing prefix sums) and the table is small enough; else None."""
        if straight not in self._ranges:
            arrays, n = self.inputs.arrays, self.pairs.num_layers
            growing = bool(np.all(np.diff(arrays.compute_s) >= 0) and np.all(np.diff(arrays.param_bytes) >= 0))
            monotone = self.inputs.schedule == "pipedream" and not arrays.shared and self.inputs.scale >= 0 and growing
            columns = len(self.columns(straight)) + (0 if straight else len(self.outer))
            small = max(n.bit_length(), 1) * columns * (n + 1) <= _RANGE_ENTRIES
            self._ranges[straight] = _RangeColumns(self, straight) if monotone and small else None
        return self._ranges[straight]

    def stage_bounds(self, pair: np.ndarray, column: int) -> np.ndarray:
        """Q of stages `pair` under one combination: turns max(t, c_in, c_out) + ar (flush) or
        max(t + ar, c_in, c_out) / r (pipedream), seconds."""
        p = self.pairs
        compute = p.both[pair]
        comm_in = p.cut_in[pair] / self.bw_in[column]
        comm_out = p.cut_out[pair] / self.bw_out[column]
        allreduce = self.share[column] * p.weights[pair] / self.bw_allreduce[column]
        if self.inputs.schedule == "pipedream":
            return np.maximum(np.maximum(compute + allreduce, comm_in), comm_out) / self.replicas[column]
        return self.turns[column] * np.maximum(np.maximum(compute, comm_in), comm_out) + allreduce

    def outer_bounds(self, pair: np.ndarray, replicas: np.ndarray) -> np.ndarray:
        """Q of pipedream stages `pair` on whole outer groups (as `_Evaluator._outer_ok` computes it)."""
        p, r = self.pairs, replicas.astype(float)
        allreduce = 2.0 * (r - 1.0) / r * p.weights[pair] / self.top
        return np.maximum(p.both[pair] + allreduce, self.outer_comm[pair]) / r

    def columns(self, straight: bool) -> np.ndarray:
        """The combinations a plan may use, ordered by the residue they lead to."""
        usable = self.replicas == 1 if straight else np.ones(len(self.rho), dtype=bool)
        order = np.argsort(self.next_rho[usable], kind="stable")
        return np.nonzero(usable)[0][order]

    def candidates(self, bound: float, straight: bool) -> _Candidates:
        """A candidate list serving `bound`: the held one, or a new one (class docstring)."""
        columns = self.columns(straight)
        use_outer = not straight and len(self.outer) > 0
        held = self._held
        if held is not None and held.straight == straight and held.low <= bound <= held.high:
            last_stops = [self._column_stops(k, bound) for k in columns]
            if use_outer:
                last_stops.append(self._outer_stops(bound))
            starts = np.arange(self.pairs.num_layers)
            if held.entries <= _SLACK * sum(int(np.maximum(stops - starts, 0).sum()) for stops in last_stops):
                return held
        # a bisection's later bounds stay within the last step of this one
        step = abs(bound - held.asked) if held is not None else 0.0
        up, down = held is not None and bound > held.asked, held is not None and bound < held.asked
        high = bound * (1.0 + _MARGIN) + (step if up else 0.0)
        low = max(bound / (1.0 + _MARGIN) - (step if down else 0.0), 0.0) if use_outer else 0.0
        self._held = self._build(columns, bound, low, high, straight)
        return self._held

    def _last_stops(self, gain_time: float, gain_weight: float, limit: float) -> np.ndarray:
        """Per start i, the last stop j with gain_time t(i, j) + gain_weight W_own(i, j) <= limit,
        up to a margin for rounding (class docstring); i or less when there is none."""
        g = gain_time * self._time + gain_weight * self._weight
        running = np.minimum.accumulate(g[::-1])[::-1]
        scale = abs(gain_time) * float(np.abs(self._time).max()) + abs(gain_weight) * float(np.abs(self._weight).max())
        reach = g[:-1] + (limit * (1.0 + 1e-9) + 1e-12 * scale)
        return np.searchsorted(running, reach, side="right") - 1

    def _column_stops(self, column: int, bound: float) -> np.ndarray:
        """`_last_stops` of a combination: necessary for Q <= bound (class docstring)."""
        gain_weight = float(self.share[column] / self.bw_allreduce[column])
        if self.inputs.schedule == "pipedream":
            return self._last_stops(1.0, gain_weight, float(self.replicas[column]) * bound)
        return self._last_stops(float(self.turns[column]), gain_weight, bound)

    def _outer_stops(self, bound: float) -> np.ndarray:
        """`_last_stops` of pipedream stages on the most outer groups, whose Q is the least (class docstring)."""
        most = float(self.outer[-1])
        return self._last_stops(1.0, 2.0 * (most - 1.0) / most / self.top, most * bound)

    def _within(self, last_stops: np.ndarray) -> np.ndarray:
        """The pairs [i, j) with j <= last_stops[i], ordered by i then j."""
        p = self.pairs
        return _runs(p.offsets[:-1], np.maximum(last_stops - np.arange(p.num_layers), 0))

    def _build(self, columns: np.ndarray, asked: float, low: float, high: float, straight: bool) -> _Candidates:
        """Every stage and combination with Q <= high, and the outer candidates for [low, high]."""
        targets, target_of = np.unique(self.next_rho[columns], return_inverse=True)
        pieces = []
        for column, target in zip(columns.tolist(), target_of.tolist()):
            pair = self._within(self._column_stops(column, high))
            q = self.stage_bounds(pair, column)
            keep = q <= high
            pieces.append(self._piece(pair[keep], q[keep], len(targets), target, column, self.replicas[column]))
        if not straight and len(self.outer) > 0:
            pieces.append(self._outer_piece(low, high, len(targets), int(np.searchsorted(targets, 0))))
        return self._assemble(pieces, len(targets), asked, low, high, straight, targets)

    def _piece(
        self, pair: np.ndarray, q: np.ndarray, num_targets: int, target: int, column: int, replicas: np.ndarray | int
    ) -> _Piece:
        """Entries for stages `pair` under combination `column` (with these replicas), leading to target `target`."""
        p, group = self.pairs, self.inputs.class_size
        stops = p.stops[pair]
        segment = p.starts[pair] * num_targets + target
        slot = stops * group + self.rho[column]
        offset = replicas * self.stride_j + stops * self.stride_r + replicas
        return segment, q, slot, offset

    def _outer_piece(self, low: float, high: float, num_targets: int, target: int) -> _Piece:
        """Pipedream stages on r = k M >= 2 M from residue 0: every r from the fewest with Q <= high
        to the fewest with Q <= low, where the whole inner group does not fit at low."""
        pair = self._within(self._outer_stops(high))
        if self._whole_group_q is None:
            self._whole_group_q = self.stage_bounds(np.arange(len(self.pairs.starts)), self.whole)
        pair = pair[self._whole_group_q[pair] > low]
        first = self._fewest_outer(pair, high, np.zeros(len(pair), dtype=np.int64))
        found = first < len(self.outer)
        pair, first = pair[found], first[found]
        last = np.minimum(self._fewest_outer(pair, low, first), len(self.outer) - 1)
        counts = last - first + 1
        pair = np.repeat(pair, counts)
        replicas = self.outer[_runs(first, counts)]
        q = self.outer_bounds(pair, replicas)
        keep = q <= high
        return self._piece(pair[keep], q[keep], num_targets, target, self.whole, replicas[keep])

    def _fewest_outer(self, pair: np.ndarray, bound: float, lowest: np.ndarray) -> np.ndarray:
        """Per pair, the least index k >= lowest into `outer` with Q <= bound (len(outer): none), by
        bisection (Q falls as r grows)."""
        low, high = lowest.copy(), np.full(len(pair), len(self.outer))
        while True:
            active = np.nonzero(low < high)[0]
            if len(active) == 0:
                return low
            middle = (low[active] + high[active]) // 2
            fits = self.outer_bounds(pair[active], self.outer[middle]) <= bound
            high[active] = np.where(fits, middle, high[active])
            low[active] = np.where(fits, low[active], middle + 1)

    def _assemble(
        self, pieces: list[_Piece], num_targets: int, asked: float, low: float, high: float, straight: bool,
        targets: np.ndarray,
    ) -> _Candidates:
        """The pieces' entries in segment order (each piece's own order kept), a sentinel closing each segment."""
        n, group = self.pairs.num_layers, self.inputs.class_size
        segments = n * num_targets
        counts = [np.bincount(piece[0], minlength=segments) for piece in pieces]
        sizes = np.sum(counts, axis=0) + 1 if counts else np.ones(segments, dtype=np.int64)
        heads = np.cumsum(sizes) - sizes
        size = int(sizes.sum())
        q = np.full(size, -np.inf)
        slot = np.full(size, (n + 1) * group, dtype=np.int64)  # the sentinel's slot, always 'no plan'
        offset = np.zeros(size, dtype=np.int64)
        free = heads.copy()  # next free entry of each segment
        for (segment, piece_q, piece_slot, piece_offset), count in zip(pieces, counts):
            run_start = np.cumsum(count) - count  # where each segment's run begins within the piece
            where = free[segment] + np.arange(len(segment)) - run_start[segment]
            q[where], slot[where], offset[where] = piece_q, piece_slot, piece_offset
            free += count
        return _Candidates(asked, low, high, straight, targets, q, slot, offset, heads)


_RANGE_ENTRIES = 4_000_000  # largest sparse table (levels x combinations x stops) the range DP builds


class _RangeColumns:
    """Pipedream's combinations as range minima over stops (`_GroupCombos` docstring, "Ranges").

    Columns are the usable combinations and, unless straight, one per outer replica count r = k M,
    ordered by the residue they lead to. Per column: rho, r, all-reduce share and bandwidth, and
    the start and stop terms c_in(i) / r and c_out(j) / r, rounded as `stage_bounds` and
    `outer_bounds` round them. The sparse table is one flat array: cell (l, k, j) holds the least
    value of column k over stops j .. j + 2^l - 1; `first_half`, `second_half` and `target_cells`
    (per stop j, levels l >= 1 by column) name the cells (l - 1, k, j + 1), (l - 1, k, j + 2^(l-1))
    and (l, k, j), so that cell (l, k, j) = min(value at j, those two).
    """

    def __init__(self, combos: _GroupCombos, straight: bool) -> None:
        pairs, group = combos.pairs, combos.inputs.class_size
        n = pairs.num_layers
        columns = combos.columns(straight)
        rho, replicas = combos.rho[columns], combos.replicas[columns]
        share, bw_allreduce = combos.share[columns], combos.bw_allreduce[columns]
        bw_in, bw_out = combos.bw_in[columns], combos.bw_out[columns]
        if not straight and len(combos.outer) > 0:
            outer = combos.outer
            r = outer.astype(float)
            top = np.full(len(outer), combos.top)
            rho = np.concatenate([rho, np.zeros(len(outer), dtype=np.int64)])
            replicas = np.concatenate([replicas, outer])
            share = np.concatenate([share, 2.0 * (r - 1.0) / r])
            bw_allreduce, bw_in, bw_out = (np.concatenate([x, top]) for x in (bw_allreduce, bw_in, bw_out))
        order = np.argsort((rho + replicas) % group, kind="stable")
        self.rho, self.replicas = rho[order], replicas[order]
        self.share, self.bw_allreduce = share[order], bw_allreduce[order]
        targets = (self.rho + self.replicas) % group
        self.targets, self.heads = np.unique(targets, return_index=True)
        cut_in = pairs.cut_in[pairs.offsets[:-1]]  # entering a stage that starts at i
        cut_out = np.concatenate([[0.0], pairs.cut_out[pairs.offsets[:-1]]])  # leaving one that stops at j
        r = self.replicas[:, None]
        self.start_term = cut_in[None, :] / bw_in[order][:, None] / r  # (columns, starts)
        self.stop_term = cut_out[None, :] / bw_out[order][:, None] / r  # (columns, stops 0..n)
        self.add = self.replicas * combos.stride_j + self.replicas  # key = V + add
        k = len(self.rho)
        self.levels = max(int(n).bit_length(), 1)
        self.width = n + 1 + (1 << self.levels)  # positions 0..n, then never-written padding
        self.size = self.levels * k * self.width + 1  # the last cell stays 'none'
        level = np.arange(1, self.levels)[:, None]
        column = np.arange(k)[None, :]
        position = np.arange(n + 1)[:, None, None]
        below = (level - 1) * k + column
        self.first_half = ((below * self.width)[None] + position + 1).reshape(n + 1, -1)
        self.second_half = ((below * self.width)[None] + position + (1 << (level - 1))[None]).reshape(n + 1, -1)
        self.target_cells = (((level * k + column) * self.width)[None] + position).reshape(n + 1, -1)
        self._known: list[tuple[float, np.ndarray]] = []  # (bound, last stops by t + ar) of earlier bounds

    def last_stops(self, combos: _GroupCombos, bound: float) -> np.ndarray:
        """(starts, columns): J_k(i), the last stop whose (t + ar) / r fits the bound, or i where
        the start term c_in / r does not fit (`_GroupCombos` docstring, "Ranges")."""
        p, n = combos.pairs, combos.pairs.num_layers
        k = len(self.rho)
        starts = np.repeat(np.arange(n), k)
        below = [(b, last) for b, last in self._known if b <= bound]
        above = [(b, last) for b, last in self._known if b >= bound]
        low = max(below, key=lambda known: known[0])[1].copy() if below else starts.copy()
        if above:
            high = min(above, key=lambda known: known[0])[1].copy()
        else:
            high = np.concatenate([
                combos._last_stops(1.0, float(s / bw), float(r) * bound)[:, None]
                for s, bw, r in zip(self.share, self.bw_allreduce, self.replicas)
            ], axis=1).ravel()
        high = np.maximum(high, low)
        column = np.tile(np.arange(k), n)
        while True:
            active = np.nonzero(low < high)[0]
            if len(active) == 0:
                break
            middle = (low[active] + high[active] + 1) // 2
            at, c = starts[active], column[active]
            pair = p.offsets[at] + middle - at - 1
            allreduce = self.share[c] * p.weights[pair] / self.bw_allreduce[c]
            fits = (p.both[pair] + allreduce) / self.replicas[c] <= bound
            low[active] = np.where(fits, middle, low[active])
            high[active] = np.where(fits, high[active], middle - 1)
        self._known.append((bound, low))
        return np.where(self.start_term.T <= bound, low.reshape(n, k), np.arange(n)[:, None])


def _solve_ranges(combos: _GroupCombos, ranges: _RangeColumns, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """The DP of `_solve_unlimited` by range minima: keys (starts + 1, targets) and the targets.

    Per start i and column k, the stops i + 1 .. J_k(i) are read as two overlapping runs of 2^l
    stops (l = floor(log2(J_k(i) - i))); then stop i joins the table (its value, and its cells at
    every level from those of stops i + 1 and i + 2^(l-1)).
    """
    n, group = combos.pairs.num_layers, combos.inputs.class_size
    worst, stride_r, stride_j = combos.worst, combos.stride_r, combos.stride_j
    none = np.iinfo(np.int64).max // 4
    k = len(ranges.rho)
    last = ranges.last_stops(combos, bound)
    length = last - np.arange(n)[:, None]
    levels = max(int(length.max()).bit_length(), 1)
    level = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)  # largest l with 2^l <= length
    base = (level * k + np.arange(k)[None, :]) * ranges.width
    starts = np.arange(n)[:, None]
    first = np.where(length > 0, base + starts + 1, ranges.size - 1)
    second = np.where(length > 0, base + last - (1 << level) + 1, ranges.size - 1)
    stop_ok = ranges.stop_term.T <= bound  # (stops, columns)
    minima = np.full(ranges.size, none, dtype=np.int64)
    cells = (levels - 1) * k
    best = np.full((n + 1, group), worst, dtype=np.int64)
    best[n, 0] = 0
    keys = np.full((n + 1, len(ranges.targets)), worst * stride_j, dtype=np.int64)
    level_zero = minima[: k * ranges.width].reshape(k, ranges.width)
    targets = slice(None) if len(ranges.targets) == group else ranges.targets
    for position in range(n, -1, -1):
        if position < n:
            row = np.minimum(minima.take(first[position]), minima.take(second[position]))
            row += ranges.add
            row = np.minimum.reduceat(row, ranges.heads)
            keys[position] = row
            best[position, targets] = np.minimum(row // stride_j, worst)
        value = best[position].take(ranges.rho) * stride_j + position * stride_r
        value = np.where(stop_ok[position], value, none)
        level_zero[:, position] = value
        if cells:
            upper = np.minimum(minima.take(ranges.first_half[position, :cells]),
                               minima.take(ranges.second_half[position, :cells]))
            upper = np.minimum(upper.reshape(levels - 1, k), value).ravel()
            minima[ranges.target_cells[position, :cells]] = upper
    return keys, ranges.targets


def _solve_unlimited(evaluator: _Evaluator, combos: _GroupCombos, bound: float, straight: bool) -> list[Stage] | None:
    """`_solve` without a memory limit: one state per (layer, residue), the fewest devices.

    E[i, rho'] = min over stops j and combinations k with next_rho_k = rho' of E[j, rho_k] + r_k
    over stages with Q <= bound; stages on whole outer groups (pipedream: r = k M >= 2 M, only
    from residue 0, every link outermost, the fewest r that fits) add E[j, 0] + r. Ties go to the
    shortest stage, then the fewest replicas: the least key (devices, stop, replicas). Pipedream
    takes each minimum over j as a range minimum (`_RangeColumns`) where its Q allows; otherwise
    the candidates (stop, combination) of each start come from `_GroupCombos.candidates`. Both
    drop no stage with Q <= bound (`_GroupCombos` docstring). With no bound every stage fits, and
    the one plan on one device is the fewest devices.
    """
    n, group = evaluator.pairs.num_layers, evaluator.inputs.class_size
    if bound == math.inf:
        return [(0, n, 1, False)]
    ranges = combos.ranges(straight)
    if ranges is not None:
        keys, targets = _solve_ranges(combos, ranges, bound)
    else:
        keys, targets = _solve_candidates(combos, combos.candidates(bound, straight), bound)
    best = np.full(group, combos.worst, dtype=np.int64)
    best[targets] = np.minimum(keys[0] // combos.stride_j, combos.worst)
    residues = np.nonzero(best <= evaluator.inputs.cluster.num_devices)[0]
    if len(residues) == 0:
        return None
    target_of = np.zeros(group, dtype=np.int64)
    target_of[targets] = np.arange(len(targets))
    state = int(residues[np.argmin(best[residues])])
    stages, start = [], 0
    while start < n:
        code = int(keys[start, target_of[state]])
        stop, r = (code // combos.stride_r) % (n + 1), code % combos.stride_r
        stages.append((start, stop, r, False))
        start, state = stop, (state - r) % group
    return stages


def _solve_candidates(combos: _GroupCombos, held: _Candidates, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """The DP of `_solve_unlimited` over a candidate list: keys (starts + 1, targets) and the targets."""
    n, group = combos.pairs.num_layers, combos.inputs.class_size
    worst, stride_j = combos.worst, combos.stride_j
    keep = held.q <= bound  # sentinels (-inf) always stay
    slot, offset = held.slot[keep], held.offset[keep]
    targets = held.targets
    sizes = np.add.reduceat(keep, held.heads, dtype=np.int64).reshape(n, len(targets))
    heads = (np.cumsum(sizes) - sizes.ravel()).reshape(n, len(targets))
    local = heads - heads[:, :1]  # segment heads within each start's entries
    first, last = heads[:, 0].tolist(), (heads[:, 0] + sizes.sum(axis=1)).tolist()
    scaled = np.full((n + 1) * group + 1, worst * stride_j, dtype=np.int64)  # E[j, rho] stride_j, then 'no plan'
    table = scaled[:-1].reshape(n + 1, group)
    table[n, 0] = 0
    columns = slice(None) if len(targets) == group else targets
    keys = np.full((n + 1, len(targets)), worst * stride_j, dtype=np.int64)
    for start in np.nonzero(sizes.sum(axis=1) > len(targets))[0][::-1].tolist():  # starts with a candidate
        candidate = scaled.take(slot[first[start]:last[start]])
        candidate += offset[first[start]:last[start]]
        row = np.minimum.reduceat(candidate, local[start])
        keys[start] = row
        table[start, columns] = np.minimum(row // stride_j, worst) * stride_j
    return keys, targets


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
