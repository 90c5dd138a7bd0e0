"""simulate(plan, profile): the simulator run on a saved plan (loads nothing; the caller passes both)."""

from __future__ import annotations

from planner.partition import plan_cost_inputs
from planner.plan import Plan
from planner.profile import Profile
from planner.simulator import Timeline, simulate_stages


def plan_stages(plan: Plan) -> list[tuple[int, int, int, bool]]:
    """The plan's stages as cost-model tuples (start, stop, replicas, recompute)."""
    return [(stage.start, stage.stop, stage.replicas, stage.recompute) for stage in plan.stages]


def simulate(plan: Plan, profile: Profile, iterations: int = 1) -> Timeline:
    """Simulate `iterations` of `plan` with op durations from `profile` (the planner cost model's
    terms; a plan of the pipedream cost model is simulated as the pipedream schedule)."""
    plan.check_profile(profile)
    return simulate_stages(plan_cost_inputs(profile, plan), plan_stages(plan), iterations)
