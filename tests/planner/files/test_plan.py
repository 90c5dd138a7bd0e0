"""planner.files.plan's `replan_command`: the partition command that made a plan, with another schedule or flags,
and the command a plan of the Python API implies; `command` round-trips through the file."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from planner.files.cluster import make_cluster
from planner.files.plan import load_plan, replan_command
from planner.files.profile import load_profile
from planner.planning.partition import partition

REPO = Path(__file__).resolve().parents[3]
PROFILE = str(REPO / "profiles" / "mlp.json")


def mlp_plan(**options: object) -> object:
    """The planner's plan of the shipped mlp profile on 2 GPUs, its profile path recorded."""
    return partition(load_profile(PROFILE), make_cluster(2, memory="8GB"), profile_path=PROFILE, **options)


def test_the_recorded_command_is_repeated_with_only_the_schedule_changed() -> None:
    words = ("planner", "partition", "p.json", "--cluster", "my cluster.yaml", "--memory", "2GB", "--schedule",
             "interleaved-1f1b", "--microbatches", "8", "--straight")
    plan = dataclasses.replace(mlp_plan(straight=True, microbatches=8), command=words)
    assert shlex.split(replan_command(plan, "1f1b")) == [*words[:8], "1f1b", *words[9:]]
    assert replan_command(plan) == shlex.join(words)
    assert shlex.split(replan_command(plan, add=["--straight", "--no-recompute"])) == [*words, "--no-recompute"]


def test_a_command_without_a_schedule_gets_one() -> None:
    plan = dataclasses.replace(mlp_plan(), command=("planner", "partition", "p.json", "--gpus", "2"))
    assert replan_command(plan, "gpipe") == "planner partition p.json --gpus 2 --schedule gpipe"


def test_a_plan_of_the_python_api_gives_the_command_of_its_own_fields() -> None:
    plan = mlp_plan(straight=True, microbatches=4, optimizer="sgd", schedule="gpipe")
    assert plan.command == ()
    assert shlex.split(replan_command(plan, "1f1b")) == [
        "planner", "partition", PROFILE, "--gpus", "2", "--memory", f"{plan.cluster.memory_bytes}B",
        "--optimizer", "sgd", "--straight", "--microbatch-size", str(plan.microbatch_size), "--microbatches", "4",
        "--schedule", "1f1b"]


def test_the_command_round_trips_through_the_file(tmp_path: Path) -> None:
    plan = dataclasses.replace(mlp_plan(), command=("planner", "partition", PROFILE, "--gpus", "2"))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path).command == plan.command


def test_a_mismatch_offers_the_kept_profile_as_the_command_can_take_it(tmp_path: Path) -> None:
    """`planner train` has no --profile: its error says to move the kept profile back instead."""
    from planner.files.fileformat import kept_path
    from planner.files.plan import PlanProfileMismatchError

    profile = tmp_path / "mlp.json"
    expected = "ab" * 32
    kept_path(str(profile), expected).write_text("{}")
    offered = str(PlanProfileMismatchError("p.json", str(profile), expected, "cd" * 32))
    assert f"give that one (`--profile {tmp_path / ('mlp.' + 'ab' * 6 + '.json')}`, or move it back)" in offered
    moved = str(PlanProfileMismatchError("p.json", str(profile), expected, "cd" * 32, profile_option=False))
    assert "--profile" not in moved
    assert f"move it back (`mv {tmp_path / ('mlp.' + 'ab' * 6 + '.json')} {profile}`)" in moved
