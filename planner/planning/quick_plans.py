"""Plans made without a search, whose largest term bounds a memory-limited search from above (pure).

A memory-limited `optimize` first finds the least max Q(s) of any plan within the limit in one pass of its
dynamic program (`optimizer._least_bound`). That pass prunes a candidate stage once a floor under the largest
term of any plan through it exceeds a bound; with no bound it prunes nothing on time, and every long stage that
fits in memory is priced. Any plan that fits gives a bound: the least max Q is at most its own. These are
cheap to make (tens to hundreds of stage costs, 0.02-0.1 s) and within 1.0-1.5x of the least in the 36 binding
cases of six PipeDream profiles on 8 and 16 GPUs at 4 and 8 GB where equal compute alone gave 1.1-1.9x or no
plan (the pass took 8.9 s there in all against 20.5 s):

- k stages of equal shares (cuts where a running sum crosses j / k of its total) on `devices / k` replicas each, for
  every k that divides the devices (not in a straight search), and on one device each for k = 1 .. devices; the
  shares of compute, of saved activation bytes (what binds memory under gpipe: densenet121 on 16 GPUs at 8 GB,
  64 microbatches, no equal-compute plan fits and two stages of equal bytes on 8 replicas each reach 1.24x the
  least), and of the two, each as a fraction of its total, summed (1.13x there);
- the caller's own (the best plan without the limit, which does not fit it);
- each with its stages recomputing where they do not fit without (if the schedule allows recompute).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import numpy as np

from planner.costs.schedule_cost import CostInputs, Stage, StageMemo, plan_fits, stage_costs


def equal_share_cuts(running: np.ndarray, stages: int) -> list[int] | None:
    """The first layer of each of `stages` stages of about equal shares of a per-layer quantity, then the layer
    count: [0, ..., n], cut where its running sum (`running`, cumulative, running[0] = 0: `compute_s`,
    `saved_bytes`) first reaches j / stages of its total; None where two cuts fall on one layer (too few layers,
    or one layer holds most of it)."""
    layers = len(running) - 1
    targets = running[-1] * np.arange(1, stages) / stages
    cuts = [0, *np.clip(np.searchsorted(running, targets), 1, layers - 1).tolist(), layers]
    return cuts if all(a < b for a, b in zip(cuts, cuts[1:])) else None


def _running_sums(inputs: CostInputs) -> list[np.ndarray]:
    """The running sums whose equal shares the quick plans cut at: compute, saved activation bytes (where the
    profile has them), and the two as fractions of their totals, summed (where both totals are positive)."""
    compute, saved = inputs.arrays.compute_s, inputs.arrays.saved_bytes
    if saved is None or not np.isfinite(saved[-1]) or saved[-1] <= 0.0:
        return [compute]
    if not np.isfinite(compute[-1]) or compute[-1] <= 0.0:
        return [compute, saved]
    return [compute, saved, compute / compute[-1] + saved / saved[-1]]


def quick_plans(inputs: CostInputs, straight: bool, recompute: bool, own: Sequence[Sequence[Stage]] = (),
                memo: StageMemo | None = None) -> list[list[Stage]]:
    """The plans of the module docstring that fit the memory limit and the placement rule; `own`: the caller's;
    `memo` as in `stage_costs` (no stage's terms depend on the memory limit, so one serves with and without it)."""
    devices, layers = inputs.cluster.num_devices, inputs.arrays.num_layers
    shapes = [(k, 1) for k in range(1, min(devices, layers) + 1)]
    if not straight:
        shapes += [(k, devices // k) for k in range(1, min(devices, layers)) if devices % k == 0]
    plans = [list(plan) for plan in own]
    for running in _running_sums(inputs):
        for count, replicas in shapes:
            cuts = equal_share_cuts(running, count)
            if cuts is None:
                continue
            plan = [Stage(start, stop, replicas, False) for start, stop in zip(cuts, cuts[1:])]
            if plan not in plans:  # (the shares often cut alike: one stage always does)
                plans.append(plan)
    if recompute and inputs.memory_bytes is not None:  # each stage recomputes where it does not fit without
        unlimited = replace(inputs, memory_bytes=None)
        plans = [[Stage(start, stop, replicas, cost.memory_bytes > inputs.memory_bytes)
                  for (start, stop, replicas, _), cost in zip(plan, stage_costs(unlimited, plan, memo))] for plan in plans]
    return [plan for plan in plans if plan_fits(inputs, plan, memo)]


def quick_bound(inputs: CostInputs, straight: bool, recompute: bool, own: Sequence[Sequence[Stage]] = (),
                slack: float = 0.0) -> float:
    """The least max Q(s) of `quick_plans`, times 1 + `slack` (the caller's rounding); inf where none fits."""
    memo: StageMemo = {}  # (the plans share stages, and each kept plan was priced to check that it fits)
    plans = quick_plans(inputs, straight, recompute, own, memo)
    return min((max(cost.bound_s for cost in stage_costs(inputs, plan, memo)) for plan in plans), default=math.inf) * \
        (1.0 + slack)
