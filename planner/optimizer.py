"""Optimizers: choose stage boundaries and per-stage replication for a profile (pure functions).

PipeDream's objective (see `costmodel`) is a bottleneck: minimise max over stages of value(s).
It is solved exactly by a search over the bottleneck T*:

- feasible(T*) asks whether some partition fits in G devices with every stage's value <= T*.
  For a stage [i, j) the fewest replicas meeting T* are found in closed form: the comm terms
  need r >= 2 max(cut_in, cut_out) / (B T*); stage_time(r) <= T* is the quadratic
  T* r^2 - (T + a) r + a >= 0 with a = 4P/B, whose solutions for r >= 1 are r = 1 when
  T <= T*, else r >= r+ = ((T + a) + sqrt((T + a)^2 - 4 T* a)) / (2 T*). A dynamic program
  D[j] = min_i D[i] + r_min(i, j) then gives the fewest devices for layers [0, j); feasible(T*)
  iff D[L] <= G. Using the fewest replicas per stage is optimal because devices are the only
  resource stages share.
- T* is bisected between T_total / G (no plan beats perfect division of the work) and T_total
  (one stage, one device) to a relative width of 1e-3, then the exact optimum is found among
  the candidate values value(i, j, r) inside that interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.costmodel import LayerArrays, pipedream_bottleneck_s, pipedream_stage_value_s
from planner.errors import PlannerError

_NO_PLAN = 1 << 40  # 'no replica count works'; sums of thousands of these stay far from overflow


@dataclass(frozen=True)
class Solution:
    """Stages as (start, stop, replicas) over layer indices [start, stop), and the objective."""

    stages: tuple[tuple[int, int, int], ...]
    objective_s: float

    @property
    def devices(self) -> int:
        return sum(replicas for _, _, replicas in self.stages)


class _PairTable:
    """Every candidate stage [i, j), i < j, as flat arrays ordered by j then i."""

    def __init__(self, arrays: LayerArrays, bandwidth_Bps: float) -> None:
        n = arrays.num_layers
        stops = np.repeat(np.arange(1, n + 1), np.arange(1, n + 1))
        offsets = np.concatenate([[0], np.cumsum(np.arange(1, n + 1))])
        starts = np.arange(len(stops)) - offsets[stops - 1]
        self.num_layers = n
        self.offsets = offsets  # pairs ending at j occupy [offsets[j-1], offsets[j])
        self.starts, self.stops = starts, stops
        self.compute_s = arrays.compute_s[stops] - arrays.compute_s[starts]
        a = 4.0 * (arrays.param_bytes[stops] - arrays.param_bytes[starts]) / bandwidth_Bps
        self.allreduce_s = a
        cut = np.concatenate([arrays.cut_bytes, [0.0]])
        cut_in = np.where(starts > 0, cut[starts - 1], 0.0)
        cut_out = np.where(stops < n, cut[stops - 1], 0.0)
        self.comm_s = 2.0 * np.maximum(cut_in, cut_out) / bandwidth_Bps

    def stage_time(self, replicas: np.ndarray) -> np.ndarray:
        """stage_time(i, j, r) = (T + a (r - 1) / r) / r of every pair, a = 4P/B."""
        return (self.compute_s + self.allreduce_s * (replicas - 1.0) / replicas) / replicas

    def value(self, replicas: np.ndarray) -> np.ndarray:
        """value(i, j, r) of every pair for per-pair replica counts (vectorised `pipedream_stage_value_s`)."""
        return np.maximum(self.stage_time(replicas), self.comm_s / replicas)

    def fewest_replicas(self, bound_s: float, max_replicas: int, straight: bool) -> np.ndarray:
        """Smallest r per pair with value(r) <= bound_s, or _NO_PLAN where none <= max_replicas.

        The comm terms need r >= r_c = ceil(2 max(cut_in, cut_out) / (B bound)). stage_time(r) <= bound
        holds for r <= r- or r >= r+ (roots of bound r^2 - (T + a) r + a); so the answer is r_c when
        stage_time(r_c) <= bound, else the first integer >= r+.
        """
        if straight:
            ones = np.ones_like(self.compute_s)
            return np.where(self.value(ones) <= bound_s, 1, _NO_PLAN).astype(np.int64)
        t, a = self.compute_s, self.allreduce_s
        r = np.maximum(np.ceil(self.comm_s / bound_s), 1.0)
        r = np.where(self.comm_s / r <= bound_s, r, r + 1.0)  # ceil() of a rounded quotient
        root = ((t + a) + np.sqrt(np.maximum((t + a) ** 2 - 4.0 * bound_s * a, 0.0))) / (2.0 * bound_s)
        r = np.where(self.stage_time(r) <= bound_s, r, np.maximum(r, np.ceil(root)))
        r = np.where(self.value(r) <= bound_s, r, r + 1.0)  # ceil() of a rounded root
        fewest = r.astype(np.int64)
        fewest[(r > max_replicas) | (self.value(r) > bound_s)] = _NO_PLAN
        return fewest


def _fewest_devices(table: _PairTable, replicas: np.ndarray) -> tuple[int, np.ndarray]:
    """D[L] and the best start of the last stage for each j: D[j] = min_i D[i] + replicas(i, j)."""
    n = table.num_layers
    best = np.full(n + 1, _NO_PLAN, dtype=np.int64)
    best[0] = 0
    choice = np.zeros(n + 1, dtype=np.int64)
    for stop in range(1, n + 1):
        totals = best[:stop] + replicas[table.offsets[stop - 1]:table.offsets[stop]]
        start = int(np.argmin(totals))  # ties: the earliest start, i.e. the longest last stage
        best[stop] = totals[start]
        choice[stop] = start
    return int(best[n]), choice


def _stages(table: _PairTable, replicas: np.ndarray, choice: np.ndarray) -> list[tuple[int, int, int]]:
    stages, stop = [], table.num_layers
    while stop > 0:
        start = int(choice[stop])
        stages.append((start, stop, int(replicas[table.offsets[stop - 1] + start])))
        stop = start
    return stages[::-1]


def optimize_pipedream(
    arrays: LayerArrays, devices: int, bandwidth_Bps: float, straight: bool = False
) -> Solution:
    """The plan minimising PipeDream's bottleneck on at most `devices` devices (fewest devices on ties)."""
    if devices < 1:
        raise PlannerError(f"need at least one device, got {devices}")
    if arrays.num_layers < 1:
        raise PlannerError("the profile has no layers")
    table = _PairTable(arrays, bandwidth_Bps)
    total_s = float(arrays.compute_s[-1])
    if total_s <= 0:
        return Solution(((0, arrays.num_layers, 1),), 0.0)

    def feasible(bound_s: float) -> bool:
        return _fewest_devices(table, table.fewest_replicas(bound_s, devices, straight))[0] <= devices

    low, high = total_s / devices * (1.0 - 1e-12), total_s  # feasible(high); low is a lower bound
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        if feasible(middle):
            high = middle
        else:
            low = middle
    # Exact finish: the optimum is the value of some stage, inside (low, high].
    candidates = _candidate_values(table, low, high, devices, straight)
    lo_index, hi_index = 0, len(candidates) - 1  # candidates[-1] == high, feasible
    while lo_index < hi_index:
        middle = (lo_index + hi_index) // 2
        if feasible(float(candidates[middle])):
            hi_index = middle
        else:
            lo_index = middle + 1
    bound = float(candidates[hi_index])
    replicas = table.fewest_replicas(bound, devices, straight)
    _, choice = _fewest_devices(table, replicas)
    stages = _stages(table, replicas, choice)
    return Solution(tuple(stages), pipedream_bottleneck_s(arrays, stages, bandwidth_Bps))


def _candidate_values(table: _PairTable, low: float, high: float, devices: int, straight: bool) -> np.ndarray:
    """Sorted distinct values value(i, j, r) in (low, high] for the r that can meet a bound there, plus high."""
    r_high = table.fewest_replicas(high, devices, straight)
    r_low = table.fewest_replicas(low, devices, straight) if not straight else r_high
    r_low = np.where(r_low == _NO_PLAN, devices, r_low)
    usable = r_high != _NO_PLAN
    values = [np.array([high])]
    r = np.where(usable, r_high, 1).astype(float)
    stop_r = np.where(usable, r_low, 0).astype(float)
    active = usable.copy()
    while active.any():
        value = table.value(r)
        inside = active & (value > low) & (value <= high)
        values.append(value[inside])
        active &= r < stop_r
        r = r + 1.0
    return np.unique(np.concatenate(values))


def brute_force_pipedream(arrays: LayerArrays, devices: int, bandwidth_Bps: float, straight: bool = False) -> float:
    """The optimum by enumerating every partition and replica assignment (tiny inputs only; tests)."""
    n = arrays.num_layers
    best = float("inf")

    def search(start: int, left: int, worst: float) -> None:
        nonlocal best
        if start == n:
            best = min(best, worst)
            return
        for stop in range(start + 1, n + 1):
            for replicas in ([1] if straight else range(1, left + 1)):
                if replicas > left:
                    break
                value = pipedream_stage_value_s(
                    float(arrays.compute_s[stop] - arrays.compute_s[start]),
                    float(arrays.param_bytes[stop] - arrays.param_bytes[start]),
                    arrays.cut_before(start), arrays.cut_after(stop), replicas, bandwidth_Bps,
                )
                search(stop, left - replicas, max(worst, value))

    search(0, devices, 0.0)
    return best
