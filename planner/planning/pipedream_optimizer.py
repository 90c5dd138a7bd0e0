"""Optimizers: choose stage boundaries and per-stage replication for a profile (pure functions).

PipeDream's objective (see `pipedream_cost`) is a bottleneck: minimise max over stages of value(s),
optionally with every device's memory within a limit. It is solved exactly by a search over
the bottleneck T*:

- feasible(T*) asks whether some partition fits in G devices with every stage's value <= T*
  (and memory <= M). For a stage [i, j) the fewest replicas meeting T* come in closed form: the
  comm terms need r >= 2 max(cut_in, cut_out) / (B T*); stage_time(r) <= T* is the quadratic
  T* r^2 - (T + a) r + a >= 0 with a = 4P/B, which holds for r <= r- or r >= r+ =
  ((T + a) + sqrt((T + a)^2 - 4 T* a)) / (2 T*). Memory falls as r grows (fewer mini-batches
  in flight per replica), so it adds a lower bound on r that depends on the devices D used by
  the stages after [i, j). A dynamic program over suffixes, E[i] = min_j r(i, j, E[j]) + E[j],
  gives the fewest devices for layers [i, L); feasible(T*) iff E[0] <= G. The fewest replicas
  and the fewest downstream devices are optimal choices because devices are the only resource
  stages share and memory only grows with downstream devices.
- T* is bisected between T_total / G (no plan beats perfect division of the work) and the
  one-device time, to a relative width of 1e-3; then, from the best plan found, T* is set just
  below that plan's own objective until no plan is feasible: the last plan is optimal (to a
  relative `bound_search.TIE` = 1e-9: objectives closer than that count as equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.planning.bound_search import TIE, Solution, smallest_bound
from planner.costs.layer_arrays import OPTIMIZER_STATE_COPIES, LayerArrays, stage_pairs
from planner.costs.pipedream_cost import (
    PipeDreamStage,
    pipedream_bottleneck_s, pipedream_time_from_units, pipedream_unit_terms, pipedream_value_from_units,
)
from planner.errors import InfeasiblePlanError, PlannerError

_NO_PLAN = 1 << 40  # 'no replica count works'; far above any device count, far below int64 overflow


class _PairTable:
    """Every candidate stage [i, j), i < j, as flat arrays ordered by i then j."""

    def __init__(self, arrays: LayerArrays, bandwidth_Bps: float) -> None:
        n = arrays.num_layers
        starts, stops, offsets = stage_pairs(n)
        self.num_layers = n
        self.offsets = offsets  # pairs starting at i occupy [offsets[i], offsets[i+1])
        self.starts, self.stops = starts, stops
        self.compute_s = arrays.compute_s[stops] - arrays.compute_s[starts]
        self.param_bytes = arrays.param_bytes[stops] - arrays.param_bytes[starts]
        cut = np.concatenate([arrays.cut_bytes, [0.0]])
        self.cut_in = np.where(starts > 0, cut[starts - 1], 0.0)
        self.cut_out = np.where(stops < n, cut[stops - 1], 0.0)
        # a = 4P/B and comm = 2 max(cut) / B: the terms at one replica (also what the closed forms invert in r)
        self.allreduce_s, self.comm_s = pipedream_unit_terms(self.param_bytes, self.cut_in, self.cut_out, bandwidth_Bps)
        weights = arrays.pair_weight_bytes(starts, stops)  # with copies of shared parameters
        self.weight_bytes = weights
        saved = arrays.saved_bytes
        self.saved_bytes = np.zeros(len(starts)) if saved is None else saved[stops] - saved[starts]

    def stage_time(self, replicas: np.ndarray, where: slice = slice(None)) -> np.ndarray:
        """stage_time(i, j, r) of the pairs in `where` (`pipedream_time_from_units`)."""
        return pipedream_time_from_units(self.compute_s[where], self.allreduce_s[where], replicas)

    def value(self, replicas: np.ndarray, where: slice = slice(None)) -> np.ndarray:
        """value(i, j, r) of the pairs in `where` (`pipedream_value_from_units`)."""
        return pipedream_value_from_units(self.compute_s[where], self.allreduce_s[where], self.comm_s[where], replicas)

    def fewest_replicas(
        self, bound_s: float, max_replicas: int, straight: bool, at_least: np.ndarray | None = None,
        where: slice = slice(None),
    ) -> np.ndarray:
        """Smallest r >= at_least per pair in `where` with value(r) <= bound_s, else _NO_PLAN.

        The comm terms need r >= r_c = ceil(2 max(cut_in, cut_out) / (B bound)). With r0 = max(r_c,
        at_least), the answer is r0 when stage_time(r0) <= bound, else the first integer >= r+.
        """
        with np.errstate(divide="ignore", invalid="ignore"):  # bound 0 or infinite terms: masked below
            return self._fewest_replicas(bound_s, max_replicas, straight, at_least, where)

    def _fewest_replicas(
        self, bound_s: float, max_replicas: int, straight: bool, at_least: np.ndarray | None, where: slice
    ) -> np.ndarray:
        comm = self.comm_s[where]
        lowest = np.ones_like(comm) if at_least is None else np.maximum(at_least.astype(float), 1.0)
        if straight:
            ones = np.ones_like(comm)
            fits = (self.value(ones, where) <= bound_s) & (lowest <= 1.0)
            return np.where(fits, 1, _NO_PLAN).astype(np.int64)
        t, a = self.compute_s[where], self.allreduce_s[where]
        r = np.maximum(np.ceil(comm / bound_s), 1.0)
        r = np.where(comm / r <= bound_s, r, r + 1.0)  # ceil() of a rounded quotient
        r = np.maximum(r, lowest)
        root = ((t + a) + np.sqrt(np.maximum((t + a) ** 2 - 4.0 * bound_s * a, 0.0))) / (2.0 * bound_s)
        r = np.where(self.stage_time(r, where) <= bound_s, r, np.maximum(r, np.ceil(root)))
        r = np.where(self.value(r, where) <= bound_s, r, r + 1.0)  # ceil() of a rounded root
        below = np.maximum(r - 1.0, 1.0)  # ... or one above the true answer
        r = np.where((below >= lowest) & (self.value(below, where) <= bound_s), below, r)
        bad = ~np.isfinite(r) | (r > max_replicas) | ~(self.value(r, where) <= bound_s)
        fewest = np.where(bad, _NO_PLAN, np.minimum(np.nan_to_num(r), _NO_PLAN)).astype(np.int64)
        return fewest


@dataclass(frozen=True)
class _MemoryLimit:
    """Device memory and optimizer state copies, for the memory bound on replicas."""

    memory_bytes: float
    optimizer_copies: int

    def fewest_replicas(self, table: _PairTable, where: slice, downstream: np.ndarray) -> np.ndarray:
        """Smallest r with W (1 + k) + (1 + ceil(D / r)) (W + A) <= M per pair, else _NO_PLAN.

        With q = floor((M - W (1 + k)) / (W + A)) - 1 allowed extra mini-batches, ceil(D / r) <= q
        iff r >= ceil(D / q); q < 0 fits nothing, q = 0 fits only the last stage (D = 0).
        """
        weights, saved = table.weight_bytes[where], table.saved_bytes[where]
        per_flight = weights + saved
        spare = self.memory_bytes - weights * (1 + self.optimizer_copies)
        with np.errstate(divide="ignore", invalid="ignore"):
            extra = np.where(per_flight > 0, np.floor(spare / per_flight) - 1.0, np.inf)
            extra = np.where(spare < 0, -1.0, extra)
            r = np.where(downstream == 0, 1.0, np.ceil(downstream / extra))
        r = np.where((extra < 0) | ((extra == 0) & (downstream > 0)), np.inf, np.maximum(r, 1.0))
        return np.minimum(r, _NO_PLAN).astype(np.int64)


def _fewest_devices(
    table: _PairTable, bound_s: float, devices: int, straight: bool, memory: _MemoryLimit | None
) -> tuple[int, np.ndarray, np.ndarray]:
    """E[0] (fewest devices for the whole model), and per start i the chosen stop and replicas.

    E[i] = min over stops j of r(i, j, E[j]) + E[j], E[L] = 0; ties go to the shortest stage.
    """
    n = table.num_layers
    best = np.full(n + 1, _NO_PLAN, dtype=np.int64)
    best[n] = 0
    chosen_stop = np.zeros(n + 1, dtype=np.int64)
    chosen_replicas = np.zeros(n + 1, dtype=np.int64)
    unlimited = None if memory is not None else table.fewest_replicas(bound_s, devices, straight)
    for start in range(n - 1, -1, -1):
        where = slice(int(table.offsets[start]), int(table.offsets[start + 1]))
        downstream = best[start + 1:]
        if memory is None:
            replicas = unlimited[where]
        else:
            at_least = memory.fewest_replicas(table, where, downstream)
            replicas = table.fewest_replicas(bound_s, devices, straight, at_least, where)
        totals = np.minimum(replicas + downstream, _NO_PLAN)
        index = int(np.argmin(totals))
        best[start] = totals[index]
        chosen_stop[start] = start + 1 + index
        chosen_replicas[start] = replicas[index]
    return int(best[0]), chosen_stop, chosen_replicas


def _stages(chosen_stop: np.ndarray, chosen_replicas: np.ndarray, num_layers: int) -> list[PipeDreamStage]:
    stages, start = [], 0
    while start < num_layers:
        stop = int(chosen_stop[start])
        stages.append(PipeDreamStage(start, stop, int(chosen_replicas[start])))
        start = stop
    return stages


def optimize_pipedream(
    arrays: LayerArrays, devices: int, bandwidth_Bps: float, straight: bool = False,
    memory_bytes: float | None = None, optimizer: str = "adam",
) -> Solution:
    """The plan minimising PipeDream's bottleneck on at most `devices` devices (fewest devices on ties).

    With `memory_bytes`, every device's memory (see `pipedream_cost`) must fit; InfeasiblePlanError
    names the smallest memory per device that admits a plan.
    """
    if devices < 1:
        raise PlannerError(f"need at least one device, got {devices}")
    if arrays.num_layers < 1:
        raise PlannerError("the profile has no layers")
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise PlannerError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE_COPIES)}")
    table = _PairTable(arrays, bandwidth_Bps)
    copies = OPTIMIZER_STATE_COPIES[optimizer]
    memory = None if memory_bytes is None else _MemoryLimit(float(memory_bytes), copies)

    def solve(bound_s: float) -> list[PipeDreamStage] | None:
        used, chosen_stop, chosen_replicas = _fewest_devices(table, bound_s, devices, straight, memory)
        return _stages(chosen_stop, chosen_replicas, arrays.num_layers) if used <= devices else None

    best = solve(math.inf)  # with no bound on time, only memory can make this fail
    if best is None:
        raise InfeasiblePlanError(memory_bytes or 0, lambda: _smallest_memory(table, devices, straight, copies))
    low = float(arrays.compute_s[-1]) / devices * (1.0 - 1e-9)  # no plan beats perfect division of the work
    best, best_value = smallest_bound(solve, lambda plan: pipedream_bottleneck_s(arrays, plan, bandwidth_Bps), best, low)
    # Among plans within the floating-point tie tolerance of the optimum, take the fewest devices:
    # stage sums come from prefix differences, so equal stages may differ in the last bit.
    fewest = solve(best_value * (1.0 + TIE))
    if fewest is not None and sum(stage.replicas for stage in fewest) < sum(stage.replicas for stage in best):
        best, best_value = fewest, pipedream_bottleneck_s(arrays, fewest, bandwidth_Bps)
    return Solution(tuple(best), best_value)


def _smallest_memory(table: _PairTable, devices: int, straight: bool, copies: int) -> float:
    """The least device memory, to the MB above, at which some plan fits (bisection on the memory)."""
    low, high = 0.0, float(np.max(table.weight_bytes * (2 + copies) + table.saved_bytes)) * (devices + 2)
    for _ in range(100):
        middle = (low + high) / 2
        if _fewest_devices(table, math.inf, devices, straight, _MemoryLimit(middle, copies))[0] <= devices:
            high = middle
        else:
            low = middle
        if high - low <= 1e5:
            break
    return math.ceil(high / 1e6) * 1e6  # rounded up to a whole MB, so that it still admits a plan
