"""Exact minimisation of a plan's max term by bisection on a bound, shared by both optimizers (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

Plan = TypeVar("Plan")

@dataclass(frozen=True)
class Solution:
    """What either optimizer returns: its stages (named tuples with a `replicas` field: the planner's
    `schedule_cost.Stage`, PipeDream's `pipedream_cost.PipeDreamStage`) and its objective, seconds."""

    stages: tuple[Any, ...]
    objective_s: float

    @property
    def devices(self) -> int:
        """Devices the plan uses: the sum of its replicas."""
        return sum(stage.replicas for stage in self.stages)


TIE = 1e-9  # objectives within this relative distance count as equal
MAX_STEPS = 200  # bisection and descent steps: far more than the ~60 needed to exhaust a float
NEAR = 0.05  # relative width of the bisection's interval below which a plan found is first tested for optimality
NEAR_TESTS = 3  # tests in a row (each finding a better plan) before the bisection goes on
PROBES = 6  # bounds tried just above `low` before the bisection: up to 3.2% above it


def smallest_bound(
    solve: Callable[[float], Plan | None], value: Callable[[Plan], float], best: Plan, low: float,
    probes: int = PROBES,
) -> tuple[Plan, float]:
    """The plan of least `value` among those `solve(bound)` can return, and that value.

    `solve(bound)` returns a plan whose value is at most `bound`, or None when none exists, and
    must be monotone (a larger bound never loses a plan); `best` is any plan, `low` a bound no
    plan beats. When low > 0, bounds low (1 + 1e-3 2^k), k = 0, ..., `probes` - 1, are tried first (optima often
    lie just above such a bound: fewer probes where the caller knows better); then the bound is bisected to a
    relative width of 1e-3, at the geometric mean of the interval's ends when low > 0 (a memory limit can put
    the optimum two orders of magnitude above the best plan without it: nasnetalarge on 8 GPUs under 1f1b at 8
    GB, 0.406 s against 0.00215; doubling the probes' step until one found a plan took 19 solves, 23 in all
    against 15 now), then set just below the best plan's own value until nothing is found: the last plan is
    optimal to a relative TIE. Once the interval is narrower than NEAR, a plan found by bisection is tested at
    once (the bound just below its value): where nothing is found it is optimal, and the bisection's last steps,
    which would only have confirmed that (6 solves of 18 in a memory-limited resnet50 plan), are saved; a better
    plan found so is tested in turn, up to NEAR_TESTS in a row, then the bisection goes on.
    """
    best_value = value(best)
    high = best_value
    base, step = low, 1e-3
    for _ in range(probes):
        probe = base * (1.0 + step)
        if not 0 < probe < high:
            break
        plan = solve(probe)
        if plan is not None:
            best, best_value = plan, value(plan)
            high = min(best_value, probe)
            break
        low, step = probe, 2.0 * step
    tests = 0  # the best plan may be tested for optimality (tests left in a row)
    for _ in range(MAX_STEPS):
        if high - low <= 1e-3 * high:
            break
        if tests > 0 and high - low <= NEAR * high and best_value > 0:
            tests -= 1
            plan = solve(best_value * (1.0 - TIE))
            if plan is None:  # nothing below the best plan's value: it is optimal
                return best, best_value
            best, best_value = plan, value(plan)
            high = min(best_value, high)
            continue
        middle = math.sqrt(low * high) if low > 0 else (low + high) / 2
        plan = solve(middle)
        if plan is None:
            low = middle
        else:
            best, best_value = plan, value(plan)
            high = min(best_value, middle)
            tests = NEAR_TESTS
    for _ in range(MAX_STEPS):
        if best_value <= 0:
            break
        plan = solve(best_value * (1.0 - TIE))
        if plan is None or value(plan) >= best_value:
            break
        best, best_value = plan, value(plan)
    return best, best_value
