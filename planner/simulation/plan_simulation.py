"""A saved plan simulated: its cost inputs (`plan_cost_inputs`), stages, and `simulate`; `resolve_profile` finds its profile file."""

from __future__ import annotations

from pathlib import Path

from planner.costs.layer_arrays import OPTIMIZER_STATE_COPIES, LayerArrays, optimizer_terms
from planner.costs.schedule_cost import CostInputs
from planner.errors import PlannerError
from planner.files.plan import Plan
from planner.files.profile import Profile, load_profile
from planner.files.timeline import Timeline
from planner.simulation.simulator import simulate_stages


def plan_cost_inputs(profile: Profile, plan: Plan, optimizer: str | None = None) -> CostInputs:
    """The planner cost model's inputs for a saved plan: its cluster, schedule, microbatches, microbatch
    scale (pipedream plans: one microbatch of the profiled batch) with times at the microbatch size
    interpolated between the profile's measured sizes as `partition` priced them, and chunks per rank;
    `optimizer` overrides the plan's own."""
    profiled = profile.batch_size or 1
    size = plan.microbatch_size or profiled
    memory = plan.cluster.memory_bytes
    return CostInputs(
        LayerArrays.at_batch_size(profile, size).for_schedule(plan.schedule), plan.cluster, plan.schedule,
        plan.microbatches or 1, size / profiled, float(profile.input_bytes),
        OPTIMIZER_STATE_COPIES[optimizer or plan.optimizer], None if memory is None else float(memory),
        chunks=plan.chunks, library_bytes=float(profile.library_bytes),
        **optimizer_terms(profile, optimizer or plan.optimizer),
    )


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
