"""Plans made without a search, whose largest term bounds a memory-limited search from above (pure).

A memory-limited `optimize` first finds the least max Q(s) of any plan within the limit in one pass of its
dynamic program (`optimizer._least_bound`). That pass prunes a candidate stage once a floor under the largest
term of any plan through it exceeds a bound; with no bound it prunes nothing on time, and every long stage that
fits in memory is priced. Any plan that fits gives a bound: the least max Q is at most its own. These are
cheap to make (tens of stage costs) and often within 1.1-1.9x of the least:

- k stages of equal compute (cuts where the running compute crosses j T / k) on `devices / k` replicas each, for
  every k that divides the devices (not in a straight search), and on one device each for k = 1 .. devices;
- the caller's own (the best plan without the limit, which does not fit it);
- each with its stages recomputing where they do not fit without (if the schedule allows recompute).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import numpy as np

from planner.costs.schedule_cost import CostInputs, Stage, plan_fits, stage_costs


def equal_compute_cuts(compute_s: np.ndarray, stages: int) -> list[int] | None:
    """The first layer of each of `stages` stages of about equal compute, then the layer count: [0, ..., n],
    cut where the running compute (`compute_s`, cumulative, compute_s[0] = 0) first reaches j T / stages; None
    where two cuts fall on one layer (too few layers, or one layer holds most of the compute)."""
    layers = len(compute_s) - 1
    targets = compute_s[-1] * np.arange(1, stages) / stages
    cuts = [0, *np.clip(np.searchsorted(compute_s, targets), 1, layers - 1).tolist(), layers]
    return cuts if all(a < b for a, b in zip(cuts, cuts[1:])) else None


def quick_plans(inputs: CostInputs, straight: bool, recompute: bool,
                own: Sequence[Sequence[Stage]] = ()) -> list[list[Stage]]:
    """The plans of the module docstring that fit the memory limit and the placement rule; `own`: the caller's."""
    devices, layers = inputs.cluster.num_devices, inputs.arrays.num_layers
    shapes = [(k, 1) for k in range(1, min(devices, layers) + 1)]
    if not straight:
        shapes += [(k, devices // k) for k in range(1, min(devices, layers)) if devices % k == 0]
    plans = [list(plan) for plan in own]
    for count, replicas in shapes:
        cuts = equal_compute_cuts(inputs.arrays.compute_s, count)
        if cuts is not None:
            plans.append([Stage(start, stop, replicas, False) for start, stop in zip(cuts, cuts[1:])])
    if recompute and inputs.memory_bytes is not None:  # each stage recomputes where it does not fit without
        unlimited = replace(inputs, memory_bytes=None)
        plans = [[Stage(start, stop, replicas, cost.memory_bytes > inputs.memory_bytes)
                  for (start, stop, replicas, _), cost in zip(plan, stage_costs(unlimited, plan))] for plan in plans]
    return [plan for plan in plans if plan_fits(inputs, plan)]


def quick_bound(inputs: CostInputs, straight: bool, recompute: bool, own: Sequence[Sequence[Stage]] = (),
                slack: float = 0.0) -> float:
    """The least max Q(s) of `quick_plans`, times 1 + `slack` (the caller's rounding); inf where none fits."""
    plans = quick_plans(inputs, straight, recompute, own)
    return min((max(cost.bound_s for cost in stage_costs(inputs, plan)) for plan in plans), default=math.inf) * \
        (1.0 + slack)
