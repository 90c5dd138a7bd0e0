"""The optimizer's dynamic program without a memory limit: one state per (layer, residue) (pure).

`solve_unlimited(combos, beta, straight)` returns the plan with every Q(s) <= beta on the fewest
devices (see `GroupCombos` for which stages are evaluated and why that is exact); `optimize` in
`planner.planning.optimizer` searches beta.

Why one module of ~500 lines: the recurrence and the bounds that prune it are one proof of exactness;
apart they could drift (a bound looser or tighter than the recurrence it prunes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.costs.schedule_cost import (
    CostInputs, Stage, accumulate_terms, allreduce_s, allreduce_terms, both_terms, link_terms, step_terms,
    time_terms, transfer_s,
)
from planner.schedules.schedule import FLUSH_SCHEDULES
from planner.costs.stage_sums import Pairs


@dataclass
class Candidates:
    """The candidate stages of `solve_unlimited` for every bound in [low, high], in segments.

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


class GroupCombos:
    """Stage shapes for plans without a memory limit, by combination of residue and replicas, and
    the candidate stages of `solve_unlimited` at a bound.

    A state (layer j, rho) holds the fewest devices D with D mod M = rho used by layers [j, L);
    a stage [i, j) with r replicas on top of it ends at rank total - D, whose residue fixes every
    link the stage sees (shifting ranks by M changes no bandwidth). Combination k is a pair
    (rho_k, r_k) that obeys the placement rule; it leads to residue (rho_k + r_k) mod M. They are
    every r <= M inside one group and, for flush schedules, whole outer groups r = k M >= 2 M from
    residue 0: the least r for each value of ceil(m / r), since among equal turns the fewest
    replicas have the least all-reduce. Q of every stage and combination is a function of the
    stage's sums and the combination's three bandwidths (in, out, all-reduce) alone.

    Stops worth evaluating. With t(i, j) = T[j] - T[i] (T: prefix sums of sigma times) and
    W_own(i, j) = P[j] - P[i] <= W'(i, j) <= W(i, j) (P: prefix sums of the bytes of parameters no
    other layer shares; W' what the replicas all-reduce, W what the stage steps: they add shared
    parameters, never fewer bytes), every combination's Q is at least a prefix difference:

        flush:     Q = turns_k max(t, c_in, c_out) + share_k W' / bw_k >= turns_k t + share_k W_own / bw_k
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

    def __init__(self, inputs: CostInputs, pairs: Pairs) -> None:
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
        self.bw_in, self.lat_in = link_terms(cluster, first - 1, first)
        self.bw_out, self.lat_out = link_terms(cluster, end - 1, end)
        self.bw_allreduce, self.lat_allreduce = allreduce_terms(cluster, first, end - 1)
        self.turns = (-(-inputs.microbatches // self.replicas) - 1).astype(float)
        self.share = 2.0 * (self.replicas - 1.0) / self.replicas  # ring all-reduce traffic per weight byte
        n, total = pairs.num_layers, cluster.num_devices
        self.worst = total + 1  # 'no plan'; DP keys encode (devices, stop, replicas) in one integer
        self.stride_r = max(total, group) + 1
        self.stride_j = (n + 1) * self.stride_r
        self.top, self.top_latency = float(cluster.levels[-1].bandwidth_Bps), float(cluster.levels[-1].latency_s)
        self.ar_top = float(cluster.levels[-1].reduce_bandwidth_Bps)  # all-reduces over outer groups
        self.ar_top_latency = float(cluster.levels[-1].reduce_latency_s)
        self.outer = np.arange(2 * group, total + 1, group) if inputs.schedule == "pipedream" else np.zeros(0, int)
        self.outer_comm = np.maximum(  # both links outermost
            transfer_s(pairs.cut_in, self.top, self.top_latency, pairs.starts > 0),
            transfer_s(pairs.cut_out, self.top, self.top_latency, pairs.stops < n))
        self.whole = int(np.nonzero((self.rho == 0) & (self.replicas == group))[0][0])
        self._whole_group_q: np.ndarray | None = None  # Q on a whole inner group, computed when first needed
        self._time = inputs.scale * inputs.arrays.compute_s
        stops = np.arange(pairs.num_layers + 1)
        from_start = both_terms(inputs, np.zeros_like(stops), stops)  # stages from layer 0
        self._first_time = None if np.array_equal(from_start, self._time) else from_start
        copies_add = all(nbytes >= 0 for _, _, nbytes in inputs.arrays.shared)
        # a lower bound of both what a stage steps and what its replicas all-reduce
        self._weight = inputs.arrays.unshared_param_bytes() if copies_add else np.zeros(n + 1)
        self._step_tensors = inputs.step_s_per_tensor * inputs.arrays.param_tensors  # own tensors (copies add)
        self._held: Candidates | None = None
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
        """Q of stages `pair` under one combination: turns max(t + acc, c_in, c_out) + ar + opt (flush) or
        max(t + ar + opt, c_in, c_out) / r (pipedream), seconds (`schedule_cost.time_terms`)."""
        p = self.pairs
        compute = p.both[pair]
        comm_in = transfer_s(p.cut_in[pair], self.bw_in[column], self.lat_in[column], p.starts[pair] > 0)
        comm_out = transfer_s(p.cut_out[pair], self.bw_out[column], self.lat_out[column], p.stops[pair] < p.num_layers)
        allreduce = allreduce_s(p.replicated[pair], self.replicas[column], self.bw_allreduce[column],
                                self.lat_allreduce[column])
        return time_terms(self.inputs.schedule, self.inputs.microbatches, self.replicas[column], compute, comm_in,
                          comm_out, allreduce, step_terms(self.inputs, p.weights[pair], p.tensors[pair]),
                          accumulate_terms(self.inputs, p.weights[pair]), p.weight[pair])[1]

    def outer_bounds(self, pair: np.ndarray, replicas: np.ndarray) -> np.ndarray:
        """Q of pipedream stages `pair` on whole outer groups (as the optimizer's `_Evaluator._outer_ok` computes it)."""
        p, comm = self.pairs, self.outer_comm[pair]
        allreduce = allreduce_s(p.replicated[pair], replicas, self.ar_top, self.ar_top_latency)
        return time_terms("pipedream", self.inputs.microbatches, replicas, p.both[pair], comm, comm, allreduce,
                          step_terms(self.inputs, p.weights[pair], p.tensors[pair]))[1]

    def columns(self, straight: bool) -> np.ndarray:
        """The combinations a plan may use, ordered by the residue they lead to."""
        usable = self.replicas == 1 if straight else np.ones(len(self.rho), dtype=bool)
        order = np.argsort(self.next_rho[usable], kind="stable")
        return np.nonzero(usable)[0][order]

    def candidates(self, bound: float, straight: bool) -> Candidates:
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
        """Per start i, the last stop j with gain_time t(i, j) + gain_weight W_own(i, j) + the optimizer
        step's time per tensor x n_own(i, j) <= limit, up to a margin for rounding (class docstring); i
        or less when there is none."""
        def last(time: np.ndarray) -> np.ndarray:
            g = gain_time * time + gain_weight * self._weight + self._step_tensors
            running = np.minimum.accumulate(g[::-1])[::-1]
            scale = (abs(gain_time) * float(np.abs(time).max()) + abs(gain_weight) * float(np.abs(self._weight).max())
                     + float(np.abs(self._step_tensors).max()))
            reach = g[:-1] + (limit * (1.0 + 1e-9) + 1e-12 * scale)
            return np.searchsorted(running, reach, side="right") - 1

        found = last(self._time)
        if self._first_time is not None:  # a zero-bubble first stage's unsplit backward (`schedule_cost.first_terms`)
            found[0] = last(self._first_time)[0]
        return found

    def _column_stops(self, column: int, bound: float) -> np.ndarray:
        """`_last_stops` of a combination: necessary for Q <= bound (class docstring; the all-reduce's
        latencies, 2 (r - 1) lat, are a constant taken off the limit)."""
        gain_weight = float(self.share[column] / self.bw_allreduce[column]) + self.inputs.step_s_per_byte
        r = float(self.replicas[column])
        latencies = 2.0 * (r - 1.0) * float(self.lat_allreduce[column])
        if self.inputs.schedule == "pipedream":
            return self._last_stops(1.0, gain_weight, r * bound - latencies)
        return self._last_stops(float(self.turns[column]), gain_weight, bound - latencies)

    def _outer_stops(self, bound: float) -> np.ndarray:
        """`_last_stops` of pipedream stages on the most outer groups, whose Q is the least (class docstring)."""
        most = float(self.outer[-1])
        return self._last_stops(1.0, 2.0 * (most - 1.0) / most / self.ar_top + self.inputs.step_s_per_byte,
                                most * bound - 2.0 * (most - 1.0) * self.ar_top_latency)

    def _within(self, last_stops: np.ndarray) -> np.ndarray:
        """The pairs [i, j) with j <= last_stops[i], ordered by i then j."""
        p = self.pairs
        return _runs(p.offsets[:-1], np.maximum(last_stops - np.arange(p.num_layers), 0))

    def _build(self, columns: np.ndarray, asked: float, low: float, high: float, straight: bool) -> Candidates:
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
    ) -> Candidates:
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
        return Candidates(asked, low, high, straight, targets, q, slot, offset, heads)


_RANGE_ENTRIES = 4_000_000  # largest sparse table (levels x combinations x stops) the range DP builds


class _RangeColumns:
    """Pipedream's combinations as range minima over stops (`GroupCombos` docstring, "Ranges").

    Columns are the usable combinations and, unless straight, one per outer replica count r = k M,
    ordered by the residue they lead to. Per column: rho, r, all-reduce share and bandwidth, and
    the start and stop terms c_in(i) / r and c_out(j) / r, rounded as `stage_bounds` and
    `outer_bounds` round them. The sparse table is one flat array: cell (l, k, j) holds the least
    value of column k over stops j .. j + 2^l - 1; `first_half`, `second_half` and `target_cells`
    (per stop j, levels l >= 1 by column) name the cells (l - 1, k, j + 1), (l - 1, k, j + 2^(l-1))
    and (l, k, j), so that cell (l, k, j) = min(value at j, those two).
    """

    def __init__(self, combos: GroupCombos, straight: bool) -> None:
        pairs, group = combos.pairs, combos.inputs.class_size
        n = pairs.num_layers
        columns = combos.columns(straight)
        rho, replicas = combos.rho[columns], combos.replicas[columns]
        share, bw_allreduce = combos.share[columns], combos.bw_allreduce[columns]
        bw_in, bw_out = combos.bw_in[columns], combos.bw_out[columns]
        lat_allreduce, lat_in, lat_out = combos.lat_allreduce[columns], combos.lat_in[columns], combos.lat_out[columns]
        if not straight and len(combos.outer) > 0:
            outer = combos.outer
            r = outer.astype(float)
            top, top_latency = np.full(len(outer), combos.top), np.full(len(outer), combos.top_latency)
            ar_top, ar_top_latency = np.full(len(outer), combos.ar_top), np.full(len(outer), combos.ar_top_latency)
            rho = np.concatenate([rho, np.zeros(len(outer), dtype=np.int64)])
            replicas = np.concatenate([replicas, outer])
            share = np.concatenate([share, 2.0 * (r - 1.0) / r])
            bw_in, bw_out = (np.concatenate([x, top]) for x in (bw_in, bw_out))
            lat_in, lat_out = (np.concatenate([x, top_latency]) for x in (lat_in, lat_out))
            bw_allreduce = np.concatenate([bw_allreduce, ar_top])
            lat_allreduce = np.concatenate([lat_allreduce, ar_top_latency])
        order = np.argsort((rho + replicas) % group, kind="stable")
        self.rho, self.replicas = rho[order], replicas[order]
        self.share, self.bw_allreduce = share[order], bw_allreduce[order]
        self.lat_allreduce = lat_allreduce[order]
        self.allreduce_latencies = 2.0 * (self.replicas - 1.0) * self.lat_allreduce  # 2 (r - 1) lat per column
        targets = (self.rho + self.replicas) % group
        self.targets, self.heads = np.unique(targets, return_index=True)
        cut_in = pairs.cut_in[pairs.offsets[:-1]]  # entering a stage that starts at i
        cut_out = np.concatenate([[0.0], pairs.cut_out[pairs.offsets[:-1]]])  # leaving one that stops at j
        r = self.replicas[:, None]
        has_in, has_out = np.arange(n) > 0, np.arange(n + 1) < n
        self.start_term = transfer_s(cut_in[None, :], bw_in[order][:, None], lat_in[order][:, None],
                                     has_in[None, :]) / r  # (columns, starts)
        self.stop_term = transfer_s(cut_out[None, :], bw_out[order][:, None], lat_out[order][:, None],
                                    has_out[None, :]) / r  # (columns, stops 0..n)
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

    def last_stops(self, combos: GroupCombos, bound: float) -> np.ndarray:
        """(starts, columns): J_k(i), the last stop whose (t + ar) / r fits the bound, or i where
        the start term c_in / r does not fit (`GroupCombos` docstring, "Ranges")."""
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
                combos._last_stops(1.0, float(s / bw) + combos.inputs.step_s_per_byte,
                                   float(r) * bound - float(latencies))[:, None]
                for s, bw, r, latencies in zip(self.share, self.bw_allreduce, self.replicas, self.allreduce_latencies)
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
            allreduce = allreduce_s(p.replicated[pair], self.replicas[c], self.bw_allreduce[c], self.lat_allreduce[c])
            step = step_terms(combos.inputs, p.weights[pair], p.tensors[pair])
            fits = (p.both[pair] + allreduce + step) / self.replicas[c] <= bound
            low[active] = np.where(fits, middle, low[active])
            high[active] = np.where(fits, high[active], middle - 1)
        self._known.append((bound, low))
        return np.where(self.start_term.T <= bound, low.reshape(n, k), np.arange(n)[:, None])


def _solve_ranges(combos: GroupCombos, ranges: _RangeColumns, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """The DP of `solve_unlimited` by range minima: keys (starts + 1, targets) and the targets.

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


def solve_unlimited(combos: GroupCombos, bound: float, straight: bool) -> list[Stage] | None:
    """The optimizer's solve(beta) without a memory limit: one state per (layer, residue), the fewest devices.

    E[i, rho'] = min over stops j and combinations k with next_rho_k = rho' of E[j, rho_k] + r_k
    over stages with Q <= bound; stages on whole outer groups (pipedream: r = k M >= 2 M, only
    from residue 0, every link outermost, the fewest r that fits) add E[j, 0] + r. Ties go to the
    shortest stage, then the fewest replicas: the least key (devices, stop, replicas). Pipedream
    takes each minimum over j as a range minimum (`_RangeColumns`) where its Q allows; otherwise
    the candidates (stop, combination) of each start come from `GroupCombos.candidates`. Both
    drop no stage with Q <= bound (`GroupCombos` docstring). With no bound every stage fits, and
    the one plan on one device is the fewest devices.
    """
    n, group = combos.pairs.num_layers, combos.inputs.class_size
    if bound == math.inf:
        return [Stage(0, n, 1, False)]
    ranges = combos.ranges(straight)
    if ranges is not None:
        keys, targets = _solve_ranges(combos, ranges, bound)
    else:
        keys, targets = _solve_candidates(combos, combos.candidates(bound, straight), bound)
    best = np.full(group, combos.worst, dtype=np.int64)
    best[targets] = np.minimum(keys[0] // combos.stride_j, combos.worst)
    residues = np.nonzero(best <= combos.inputs.cluster.num_devices)[0]
    if len(residues) == 0:
        return None
    target_of = np.zeros(group, dtype=np.int64)
    target_of[targets] = np.arange(len(targets))
    state = int(residues[np.argmin(best[residues])])
    stages, start = [], 0
    while start < n:
        code = int(keys[start, target_of[state]])
        stop, r = (code // combos.stride_r) % (n + 1), code % combos.stride_r
        stages.append(Stage(start, stop, r, False))
        start, state = stop, (state - r) % group
    return stages


def _solve_candidates(combos: GroupCombos, held: Candidates, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """The DP of `solve_unlimited` over a candidate list: keys (starts + 1, targets) and the targets."""
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
