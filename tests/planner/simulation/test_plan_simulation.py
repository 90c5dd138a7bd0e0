"""simulate(plan, profile): the plan's stated iteration time agrees with a simulation of its file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from planner.files.cluster import make_cluster
from planner.errors import PlannerError
from planner.planning.partition import partition
from planner.files.pipedream import import_pipedream
from planner.files.plan import load_plan
from planner.simulation.plan_simulation import simulate
from planner.files.profile import Profile, SizeTimes, load_profile
from planner.schedules.schedule import BACKWARD, FORWARD

REPO = Path(__file__).resolve().parents[3]
EXAMPLE_PROFILES = sorted((REPO / "profiles").glob("*.json"))
PIPEDREAM_DIR = REPO.parent / "shared" / "pipedream-profiles"
PIPEDREAM_FILES = sorted(PIPEDREAM_DIR.glob("*.txt")) if PIPEDREAM_DIR.is_dir() else []
AGREEMENT = 0.02  # the bound on |predicted / simulated - 1|


def check_agreement(profile: Profile, tmp_path: Path, gpus: int, per_node: int | None, schedule: str) -> None:
    """Plan, save, load, simulate the file: the stated iteration time is the simulated one (within 2%),
    and the simulation did every forward and backward of every stage replica's share."""
    cluster = make_cluster(gpus, per_node, ["100GB/s", "10GB/s"])
    plan = partition(profile, cluster, schedule=schedule, microbatches=8)
    loaded = load_plan(plan.save(tmp_path / f"{profile.model_name}-{gpus}-{schedule}.json"))
    timeline = simulate(loaded, profile)
    assert timeline.iteration_s() * 1000.0 == pytest.approx(plan.predicted.iteration_ms, rel=AGREEMENT)
    compute = timeline.events[timeline.events["op"].isin((FORWARD, BACKWARD))]
    per_stage = compute.groupby("stage").size()
    assert per_stage.tolist() == [2 * timeline.microbatches * timeline.iterations] * len(plan.stages)


@pytest.mark.parametrize("path", EXAMPLE_PROFILES, ids=lambda path: path.stem)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_examples_agree_with_their_simulation(path: Path, schedule: str, tmp_path: Path) -> None:
    for gpus, per_node in ((4, None), (8, 4)):
        check_agreement(load_profile(path), tmp_path, gpus, per_node, schedule)


@pytest.mark.skipif(not PIPEDREAM_FILES, reason="../shared/pipedream-profiles is not present")
@pytest.mark.parametrize("graph", PIPEDREAM_FILES, ids=lambda path: path.stem)
def test_pipedream_profiles_agree_with_their_simulation(graph: Path, tmp_path: Path) -> None:
    profile = import_pipedream(graph, batch_size=32)
    for schedule in ("gpipe", "1f1b", "pipedream"):
        check_agreement(profile, tmp_path, 8, None, schedule)


def test_simulate_refuses_another_profile(tmp_path: Path) -> None:
    gpt, mlp = (load_profile(REPO / "profiles" / name) for name in ("gpt.json", "mlp.json"))
    plan = partition(gpt, make_cluster(2, None, ["100GB/s"]))
    with pytest.raises(PlannerError, match="digest"):
        simulate(plan, mlp)


def test_a_plan_of_a_profile_of_several_batch_sizes_simulates_at_its_interpolated_times(tmp_path: Path) -> None:
    """mlp measured at 2 samples in half the time of 8: a plan of microbatches of 4 states what `simulate` of its
    file gives (both price 4 between the measured sizes, not linearly from 8)."""
    mlp = load_profile(REPO / "profiles" / "mlp.json")
    half = SizeTimes(batch_size=2, fwd_ms=tuple(0.5 * layer.fwd_ms for layer in mlp.layers),
                     bwd_ms=tuple(0.5 * layer.bwd_ms for layer in mlp.layers))
    sized = dataclasses.replace(mlp, size_times=(half,))
    plan = partition(sized, make_cluster(2, None, ["10GB/s"]), straight=True, microbatch_size=4, microbatches=4)
    timeline = simulate(load_plan(plan.save(tmp_path / "sized.json")), sized)
    assert timeline.iteration_s() * 1000.0 == pytest.approx(plan.predicted.iteration_ms, rel=1e-12)
