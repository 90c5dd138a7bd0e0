"""simulate(plan, profile): the simulator run on a saved plan; resolve_profile finds the plan's profile file."""

from __future__ import annotations

from pathlib import Path

from planner.errors import PlannerError
from planner.partition import plan_cost_inputs
from planner.plan import Plan
from planner.profile import Profile, load_profile
from planner.simulator import Timeline, simulate_stages


def plan_stages(plan: Plan) -> list[tuple[int, int, int, bool]]:
    """The plan's stages as cost-model tuples (start, stop, replicas, recompute)."""
    return [(stage.start, stage.stop, stage.replicas, stage.recompute) for stage in plan.stages]


def simulate(plan: Plan, profile: Profile, iterations: int = 1) -> Timeline:
    """Simulate `iterations` of `plan` with op durations from `profile` (the planner cost model's
    terms; a plan of the pipedream cost model is simulated as the pipedream schedule)."""
    plan.check_profile(profile)
    return simulate_stages(plan_cost_inputs(profile, plan), plan_stages(plan), iterations)


def resolve_profile(plan: Plan, profile: Profile | None = None, plan_path: str = "<plan>",
                    profile_path: str | None = None) -> Profile:
    """`profile` if given, else the profile file the plan names (`plan.profile.path`); either way
    checked against the plan's digest (PlanProfileMismatchError naming both files)."""
    if profile is None:
        path = Path(plan.profile.path)
        if not plan.profile.path or not path.is_file():
            raise PlannerError(f"{plan_path}: its profile {plan.profile.path or '(no path recorded)'} is not there; "
                               f"give the profile file it was made from (--profile PATH, or a loaded Profile)")
        profile, profile_path = load_profile(path), plan.profile.path
    plan.check_profile(profile, plan_path, profile_path or "<profile>")
    return profile
