"""partition() and `planner partition`: plans on the real PipeDream profiles, checked independently."""

from __future__ import annotations

import dataclasses

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from planner.cli import app
from planner.errors import InfeasiblePlanError, PlannerError
from planner.files.cluster import make_cluster
from planner.costs.schedule_cost import CostInputs, Stage, samples_per_s
import planner.planning.optimizer as optimizer_module
import planner.planning.partition as partition_module
from planner.planning.partition import (
    AUTO_MICROBATCH_SHARE, CHUNKED_MARGIN, MICROBATCH_CHOICES, _auto_microbatches, partition, predicted_iteration_s,
    throughput_ceiling,
)
from planner.files.pipedream import import_pipedream
from planner.files.plan import PlanProfileMismatchError, load_plan
from planner.files.profile import BatchCoupling, LayerProfile, Profile, SizeTimes, load_profile
from tests.planner.layer_strategies import layer_arrays
from tests.conftest import PROFILES_V1

REPO = Path(__file__).resolve().parents[3]
PIPEDREAM_DIR = Path(__file__).resolve().parents[4] / "shared" / "pipedream-profiles"
PIPEDREAM_FILES = sorted(PIPEDREAM_DIR.glob("*.txt")) if PIPEDREAM_DIR.is_dir() else []
SKIP_GRAPH = Path(__file__).resolve().parents[2] / "data" / "pipedream_skip.txt"
BANDWIDTH_BPS = 10e9


def bottleneck_from_file(plan_path: Path, profile: Profile) -> float:
    """PipeDream's objective recomputed from the plan file's stages and the profile's layers alone."""
    plan = json.loads(plan_path.read_text())
    bandwidth = plan["cluster"]["levels"][0]["bandwidth_Bps"]
    layers = profile.layers
    worst = 0.0
    for stage in plan["stages"]:
        start, stop = stage["layers"]
        r = stage["replicas"]
        compute = sum(layer.fwd_ms + layer.bwd_ms for layer in layers[start:stop]) / 1000.0
        params = sum(layer.param_bytes for layer in layers[start:stop])
        cut_in = layers[start - 1].cut_bytes if start > 0 else 0
        cut_out = layers[stop - 1].cut_bytes if stop < len(layers) else 0
        stage_time = (compute + 4 * (r - 1) * params / (bandwidth * r)) / r
        worst = max(worst, stage_time, 2 * cut_in / (bandwidth * r), 2 * cut_out / (bandwidth * r))
    return worst


def _check_plan(plan_path: Path, profile: Profile, gpus: int, straight: bool) -> None:
    plan = load_plan(plan_path)
    assert plan.predicted.bottleneck_s == pytest.approx(bottleneck_from_file(plan_path, profile), rel=1e-12)
    assert plan.stages[0].start == 0 and plan.stages[-1].stop == profile.num_layers
    assert all(a.stop == b.start for a, b in zip(plan.stages, plan.stages[1:]))
    assert sum(stage.replicas for stage in plan.stages) == plan.predicted.devices_used <= gpus
    assert not straight or all(stage.replicas == 1 for stage in plan.stages)
    ranks = [rank for stage in plan.stages for rank in stage.ranks]
    assert ranks == list(range(len(ranks)))


@pytest.mark.skipif(not PIPEDREAM_FILES, reason="../shared/pipedream-profiles is not present")
@pytest.mark.parametrize("graph", PIPEDREAM_FILES, ids=lambda path: path.stem)
def test_every_pipedream_profile_is_planned_for_4_8_16_gpus(graph: Path, tmp_path: Path) -> None:
    profile = import_pipedream(graph)
    for gpus in (4, 8, 16):
        for straight in (False, True):
            plan = partition(profile, make_cluster(gpus, bandwidths=[BANDWIDTH_BPS]), cost_model="pipedream",
                             straight=straight)
            path = plan.save(tmp_path / f"{gpus}-{straight}.json")
            _check_plan(path, profile, gpus, straight)


def test_cli_partition_writes_a_plan_that_matches_its_profile(tmp_path: Path) -> None:
    runner = CliRunner()
    profile_path = tmp_path / "skip.json"
    assert runner.invoke(app, ["import-pipedream", str(SKIP_GRAPH), "-o", str(profile_path)]).exit_code == 0
    plan_path = tmp_path / "plan.json"
    result = runner.invoke(app, ["partition", str(profile_path), "--gpus", "4", "--bandwidth", "10GB/s",
                                 "--cost-model", "pipedream", "--out", str(plan_path)])
    assert result.exit_code == 0, result.output
    assert "ms per microbatch" in result.stdout and "stage" in result.stdout
    profile = load_profile(profile_path)
    _check_plan(plan_path, profile, 4, straight=False)
    load_plan(plan_path).check_profile(profile)


def test_a_plan_refuses_another_profile(tmp_path: Path) -> None:
    profile = import_pipedream(SKIP_GRAPH)
    plan = partition(profile, make_cluster(2, bandwidths=[BANDWIDTH_BPS]))
    other = import_pipedream(SKIP_GRAPH, batch_size=64)
    with pytest.raises(PlanProfileMismatchError, match="re-run `planner partition"):
        plan.check_profile(other, "plan.json", "other.json")


def test_plan_round_trips_exactly(tmp_path: Path) -> None:
    plan = partition(import_pipedream(SKIP_GRAPH, batch_size=32), make_cluster(3, bandwidths=["25Gbit/s"]))
    assert load_plan(plan.save(tmp_path / "p.json")) == plan


def test_a_saved_plan_finds_its_profile_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # partitioned in tmp (profiles/skip.json, plans/skip.json), then used from tmp/elsewhere: the recorded path is
    # relative to tmp, so it used to be "not there" (planner train then chose threads blind, simulate needed --profile)
    (tmp_path / "profiles").mkdir()
    (tmp_path / "elsewhere").mkdir()
    profile = import_pipedream(SKIP_GRAPH)
    profile.save(tmp_path / "profiles" / "skip.json")
    monkeypatch.chdir(tmp_path)
    plan = partition(load_profile("profiles/skip.json"), make_cluster(2, bandwidths=[BANDWIDTH_BPS]),
                     profile_path="profiles/skip.json")
    plan.save(tmp_path / "plans" / "skip.json")
    assert load_plan("plans/skip.json") == plan  # from where it was made: as recorded
    monkeypatch.chdir(tmp_path / "elsewhere")
    moved = load_plan("../plans/skip.json")
    assert moved.profile.path == "../profiles/skip.json" and moved.simulate().iteration_s() > 0
    assert dataclasses.replace(moved, profile=plan.profile) == plan  # nothing else changed
    (tmp_path / "profiles" / "skip.json").unlink()
    assert load_plan("../plans/skip.json").profile.path == "profiles/skip.json"  # gone: as recorded, for the error


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["--gpus", "0"], "--gpus must be at least 1"),
        (["--gpus", "8", "--gpus-per-node", "3"], "does not divide"),
        (["--gpus", "4", "--bandwidth", "-5GB/s"], "must be positive"),
        (["--gpus", "4", "--bandwidth", "fast"], "cannot read bandwidth 'fast'"),
        (["--gpus", "4", "--cost-model", "magic"], "unknown cost model 'magic'"),
        ([], "give --gpus"),
        (["--gpus", "4", "--global-batch-size", "60", "--microbatch-size", "8"], "give a multiple of 8"),
        (["--gpus", "4", "--global-batch-size", "64", "--microbatches", "6"], "not 6 microbatches"),
        (["--gpus", "4", "--global-batch-size", "64", "--microbatches", "4", "--microbatch-size", "8"],
         "give 4 x 8 = 32"),
        (["--gpus", "4", "--global-batch-size", "0"], "at least 1"),
        (["--gpus", "4", "--global-batch-size", "64", "--schedule", "pipedream"], "pipedream updates the weights"),
    ],
)
def test_cli_partition_bad_values_are_one_line(tmp_path: Path, arguments: list[str], fragment: str) -> None:
    profile_path = import_pipedream(SKIP_GRAPH).save(tmp_path / "skip.json")
    result = CliRunner().invoke(app, ["partition", str(profile_path), *arguments, "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and fragment in result.stderr
    assert not (tmp_path / "p.json").exists()


def _chain_graph(tmp_path: Path, layers: int = 6) -> Path:
    """A PipeDream-format chain of `layers` layers with GB-scale weights and activations."""
    lines = ["node0 -- Input -- forward_compute_time=0, backward_compute_time=0, activation_size=1e8, parameter_size=0"]
    for index in range(1, layers + 1):
        lines.append(f"node{index} -- Linear -- forward_compute_time={10 * index}, backward_compute_time={20 * index}, "
                     f"activation_size={index}e8, parameter_size={layers + 1 - index}e8")
    lines += [f"\tnode{index} -- node{index + 1}" for index in range(layers)]
    path = tmp_path / "chain.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "pipedream"])
def test_a_profiles_library_bytes_are_in_every_devices_memory_and_its_limit(schedule: str) -> None:
    """A GPU profile's library bytes (L: cuBLAS workspaces) are in each stage's predicted memory once, chunked
    schedules' devices of two stages included, and a device's limit must hold them too: at the memory the plan
    without them needed, every stage of the plan with them fits under that limit (or none is found, and the
    smallest memory named is more). PipeDream's cost model counts them as the planner's does."""
    profile = load_profile(REPO / "profiles" / "gpt.json")
    held = dataclasses.replace(profile, library_bytes=64 << 20)
    options: dict = dict(straight=True, schedule=schedule, microbatches=4)
    if schedule == "pipedream":
        options = dict(straight=True, cost_model="pipedream")
    free = partition(profile, make_cluster(2), **options)
    plan = partition(held, make_cluster(2), **options)
    assert [stage.memory_bytes for stage in plan.stages] == \
        pytest.approx([stage.memory_bytes + (64 << 20) for stage in free.stages], abs=1)
    limit = max(stage.memory_bytes for stage in free.stages)
    try:
        tight = partition(held, make_cluster(2, memory=limit), **options)
    except InfeasiblePlanError as exc:
        assert exc.smallest_memory_bytes > limit
    except PlannerError as exc:  # chunked schedules name the chunk counts tried instead
        assert f"no {schedule} plan" in str(exc) and "fits in" in str(exc)
    else:
        assert all(stage.memory_bytes <= limit for stage in tight.stages)


@pytest.mark.parametrize("gpus", [1, 2])
def test_no_plan_within_memory_names_the_least_memory_of_every_schedule_and_count_tried(
        gpus: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt at 100 MB fails for every schedule and microbatch count on 1 and 2 GPUs: the error raised names the least
    of the failures' own smallest memories, found when first read (raising it searches nothing) and without
    bisecting every failure."""
    seen: list[list[InfeasiblePlanError]] = []
    least_of = partition_module._least_memory_failure

    def recorded(failures: list[InfeasiblePlanError]) -> InfeasiblePlanError:
        seen.append(list(failures))
        return least_of(failures)

    searches: list[float] = []  # each search's `below`: inf for a whole bisection
    smallest = optimizer_module._smallest_memory

    def counted(*args: object) -> float:
        searches.append(float(args[3]) if len(args) > 3 else math.inf)  # type: ignore[arg-type]
        return smallest(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(partition_module, "_least_memory_failure", recorded)
    monkeypatch.setattr(optimizer_module, "_smallest_memory", counted)
    with pytest.raises(InfeasiblePlanError) as raised:
        partition(load_profile(REPO / "profiles" / "gpt.json"), make_cluster(gpus, memory="100MB"))
    (failures,) = seen
    assert len(failures) > 1 and searches == []
    message = str(raised.value)
    assert len(searches) == len(failures) and searches.count(math.inf) == 1  # the first's only
    monkeypatch.setattr(optimizer_module, "_smallest_memory", smallest)
    least = min(failure.smallest_memory_bytes for failure in failures)  # (each failure's own bisection)
    assert raised.value.smallest_memory_bytes == least and raised.value.memory_bytes == 100e6
    assert message == str(next(failure for failure in failures if failure.smallest_memory_bytes == least))


def test_memory_limit_shapes_the_plan_and_is_reported(tmp_path: Path) -> None:
    profile = import_pipedream(_chain_graph(tmp_path), batch_size=32)
    free = partition(profile, make_cluster(8, bandwidths=["10GB/s"]), cost_model="pipedream")
    limit = int(free.predicted.peak_memory_bytes * 0.8)  # 20% less than the unconstrained plan needs
    tight = partition(profile, make_cluster(8, bandwidths=["10GB/s"], memory=limit), cost_model="pipedream")
    assert tight.predicted.peak_memory_bytes <= limit
    assert all(stage.memory_bytes <= limit for stage in tight.stages)
    assert tight.predicted.bottleneck_s >= free.predicted.bottleneck_s
    assert [stage.replicas for stage in tight.stages] != [stage.replicas for stage in free.stages]


@pytest.mark.parametrize(("cost_model", "memory", "smallest"), [("pipedream", "4GB", "5 GB"), ("planner", "3GB", "4 GB")])
def test_cli_memory_too_small_names_the_smallest_that_works(
    tmp_path: Path, cost_model: str, memory: str, smallest: str
) -> None:
    # two layers of 1 GB weights, Adam. PipeDream's model: the best split needs 1 x 3 + 2 x 1 = 5 GB
    # on the first device (weights, Adam state, two stashed versions); the planner's model:
    # weights + gradients + two Adam copies = 4 GB per layer on its own device (pipedream schedule
    # on the last stage or any flush schedule keeps no stashed version)
    graph = tmp_path / "big.txt"
    graph.write_text(
        "node1 -- Input -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0\n"
        "node2 -- Linear -- forward_compute_time=5, backward_compute_time=5, activation_size=0, parameter_size=1e9\n"
        "node3 -- Linear -- forward_compute_time=5, backward_compute_time=5, activation_size=0, parameter_size=1e9\n"
        "\tnode1 -- node2\n\tnode2 -- node3\n"
    )
    profile_path = import_pipedream(graph).save(tmp_path / "big.json")
    result = CliRunner().invoke(app, ["partition", str(profile_path), "--gpus", "2", "--bandwidth", "10GB/s",
                                      "--memory", memory, "--cost-model", cost_model, "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"error: no plan fits in {memory[:-2]} GB per device; the smallest memory that admits a plan is {smallest}"
    ), result.stderr
    assert not (tmp_path / "p.json").exists()


def planner_iteration_from_file(plan_path: Path, profile: Profile) -> float:
    """The planner cost model's objective recomputed from the plan file and the profile alone, in seconds:
    flush: sum of stage compute + max over stages of (ceil(m/r) - 1) max(t, c_in, c_out) + all-reduce;
    pipedream: max over stages of max(t + all-reduce, c_in, c_out) / r."""
    plan = json.loads(plan_path.read_text())
    levels = plan["cluster"]["levels"]
    sizes = [1]
    for level in levels:
        sizes.append(sizes[-1] * level["size"])

    def bandwidth(a: int, b: int) -> float:
        return next(level["bandwidth_Bps"] for level, size in zip(levels, sizes[1:]) if a // size == b // size)

    sigma = plan["microbatch_size"] / (profile.batch_size or 1) if plan["microbatch_size"] else 1.0
    m = plan["microbatches"] or 1
    stages, layers = plan["stages"], profile.layers
    fill, worst = 0.0, 0.0
    for index, stage in enumerate(stages):
        start, stop = stage["layers"]
        r, first = stage["replicas"], stage["ranks"][0]
        last = stage["ranks"][-1]
        fwd = sigma * sum(layer.fwd_ms for layer in layers[start:stop]) / 1000.0
        t = sigma * sum(layer.fwd_ms + layer.bwd_ms for layer in layers[start:stop]) / 1000.0
        t += fwd if stage["recompute"] else 0.0
        fill += t
        c_in = sigma * layers[start - 1].cut_bytes / bandwidth(first - 1, first) if index > 0 else 0.0
        c_out = sigma * layers[stop - 1].cut_bytes / bandwidth(last, last + 1) if index < len(stages) - 1 else 0.0
        weights = sum(layer.param_bytes for layer in layers[start:stop])
        allreduce = 2 * (r - 1) / r * weights / bandwidth(first, last) if r > 1 else 0.0
        if plan["schedule"] == "pipedream":
            worst = max(worst, max(t + allreduce, c_in, c_out) / r)
        else:
            worst = max(worst, (math.ceil(m / r) - 1) * max(t, c_in, c_out) + allreduce)
    return worst if plan["schedule"] == "pipedream" else fill + worst


@pytest.mark.skipif(not PIPEDREAM_FILES, reason="../shared/pipedream-profiles is not present")
@pytest.mark.parametrize("graph", PIPEDREAM_FILES, ids=lambda path: path.stem)
def test_planner_cost_model_plans_every_pipedream_profile(graph: Path, tmp_path: Path) -> None:
    profile = import_pipedream(graph, batch_size=32)
    if profile.shared_params:
        pytest.skip("independent recomputation here does not model shared parameter copies")
    for gpus, per_node in ((4, None), (16, 8)):
        for schedule in ("1f1b", "pipedream"):
            cluster = make_cluster(gpus, per_node, ["100GB/s", "10GB/s"])
            plan = partition(profile, cluster, schedule=schedule, microbatches=8)
            path = plan.save(tmp_path / f"{gpus}-{schedule}.json")
            assert plan.predicted.objective_ms / 1000.0 == pytest.approx(
                planner_iteration_from_file(path, profile), rel=1e-9
            )
            used = [rank for stage in plan.stages for rank in stage.ranks]
            assert used == sorted(used) and len(set(used)) == len(used) and used[-1] < gpus


@pytest.mark.parametrize("gpus,per_node,bandwidths", [(2, None, ["10GB/s"]), (16, 8, ["10GB/s", "1GB/s"])])
def test_plan_is_never_slower_than_data_parallel_in_simulation(gpus: int, per_node: int | None,
                                                                bandwidths: list[str]) -> None:
    """The closed form can rank a pipeline ahead of data parallelism that simulates faster (gpt on
    2 GPUs at 10 GB/s: 55.86 against 55.44 ms); plans are judged by simulation, so data
    parallelism wins there."""
    gpt = load_profile(Path(__file__).resolve().parents[3] / "profiles" / "gpt.json")
    plan = partition(gpt, make_cluster(gpus, per_node, bandwidths))
    assert plan.predicted.speedup_vs_data_parallel >= 1.0 - 1e-9


def test_auto_schedule_is_synchronous_even_where_pipedream_is_faster() -> None:
    """pipedream trains with stale weights: a different algorithm, used only when asked for by name."""
    # without the optimizer step (which pipedream pays after every microbatch) and the tied embedding (whose
    # all-reduce it would pay too; the engine refuses it), pipedream predicts faster here
    gpt = dataclasses.replace(load_profile(Path(__file__).resolve().parents[3] / "profiles" / "gpt.json"),
                              optimizer_step_ms={}, optimizer_scratch_bytes={}, shared_params=())
    cluster = make_cluster(8, 4, ["300GB/s", "25GB/s"], memory="100MB")
    auto = partition(gpt, cluster)
    asked = partition(gpt, cluster, schedule="pipedream")
    assert auto.schedule in ("gpipe", "1f1b")
    assert asked.schedule == "pipedream" and asked.predicted.samples_per_s > auto.predicted.samples_per_s
    (weighed,) = [note for note in auto.notes if note.startswith(f"--schedule auto chose {auto.schedule} (")]
    assert "pipedream" not in weighed and "is not simulated" not in weighed  # one stage per GPU: nothing to add
    assert any("stale weights" in note for note in asked.notes)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0.5, 100.0)), min_size=len(MICROBATCH_CHOICES),
                max_size=len(MICROBATCH_CHOICES)),
       st.lists(st.sampled_from([0.0, 0.01, 0.05, 0.3, 2.0, math.inf]), min_size=len(MICROBATCH_CHOICES),
                max_size=len(MICROBATCH_CHOICES)))
def test_auto_microbatches_chooses_what_planning_every_count_chooses(
        throughputs: list[float | None], slack: list[float]) -> None:
    """The count `--microbatches auto` picks, planning only the counts its ceilings cannot settle, is the
    one planning every count picks (the fewest within 5% of the best); ceilings at or above each
    count's throughput (`slack` above it, equal included), any pattern of counts that do not fit."""
    candidates = {count: None if value is None else SimpleNamespace(samples_per_s=value, count=count)
                  for count, value in zip(MICROBATCH_CHOICES, throughputs)}
    ceilings = {count: (100.0 if value is None else value) * (1.0 + extra)
                for count, value, extra in zip(MICROBATCH_CHOICES, throughputs, slack)}
    planned: list[int] = []

    def run(count: int) -> SimpleNamespace | None:
        assert count not in planned, "a count was planned twice"
        planned.append(count)
        return candidates[count]

    found = [candidate for candidate in candidates.values() if candidate is not None]
    expected = None
    if found:
        best = max(candidate.samples_per_s for candidate in found)
        expected = next(c for c in found if c.samples_per_s >= AUTO_MICROBATCH_SHARE * best)
    assert _auto_microbatches(MICROBATCH_CHOICES, run, ceilings.__getitem__) is expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_arrays(), st.integers(1, 4), st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
       st.sampled_from([1, 2, 3, 8]), st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([1.0, 1.5]),
       st.data())
def test_throughput_ceiling_bounds_every_simulated_plan(arrays, gpus: int, schedule: str, microbatches: int,
                                                         scale: float, ratio: float, data: st.DataObject) -> None:
    """No plan simulates more samples/s than `throughput_ceiling` (any cut, replicas and recompute, a
    split backward's cost included), so `--microbatches auto` may skip counts whose ceiling is low."""
    arrays = dataclasses.replace(arrays, split_backward_ratio=ratio).for_schedule(schedule)
    n = arrays.num_layers
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=min(n - 1, gpus - 1))) if n > 1 else [])
    bounds = [0, *cuts, n]
    stages = len(bounds) - 1
    replicas = data.draw(st.lists(st.integers(1, gpus), min_size=stages, max_size=stages).filter(
        lambda counts: sum(counts) <= gpus))
    recompute = schedule != "zb-h1" and data.draw(st.booleans())
    plan = [Stage(start, stop, r, recompute) for start, stop, r in zip(bounds, bounds[1:], replicas)]
    inputs = CostInputs(arrays, make_cluster(gpus, None, ["10GB/s"]), schedule, microbatches, scale, 1e6,
                        step_s_per_byte=1e-10)
    ceiling = throughput_ceiling(inputs, 4)
    simulated = samples_per_s(inputs, predicted_iteration_s(inputs, plan), 4)
    assert simulated <= ceiling * (1.0 + 1e-9)


GPT = Path(__file__).resolve().parents[3] / "profiles" / "gpt.json"


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_a_global_batch_is_what_every_plan_trains(gpus: int, tmp_path: Path) -> None:
    """--global-batch-size B: the plan on any number of GPUs trains B samples per step (microbatch size x
    microbatches), chosen as planning every divisor of B as a fixed count would choose (the fewest
    microbatches within 5% of the best throughput), and the plan file says so."""
    gpt = load_profile(GPT)
    cluster = make_cluster(gpus, None, ["10GB/s"])
    plan = partition(gpt, cluster, global_batch_size=32)
    assert plan.global_batch_size == plan.microbatch_size * plan.microbatches == 32
    each = {count: partition(gpt, cluster, microbatches=count, global_batch_size=32) for count in (1, 2, 4, 8, 16, 32)}
    assert all(other.microbatch_size * count == 32 for count, other in each.items())
    best = max(other.predicted.samples_per_s for other in each.values())
    expected = next(count for count, other in each.items() if other.predicted.samples_per_s >= AUTO_MICROBATCH_SHARE * best)
    assert plan.microbatches == expected
    assert plan.predicted.samples_per_s == pytest.approx(each[expected].predicted.samples_per_s, rel=1e-12)
    assert json.loads(plan.save(tmp_path / "p.json").read_text())["global_batch_size"] == 32


def test_microbatch_sizes_the_profile_could_not_run_the_model_at_are_left_out_of_a_global_batchs_choice() -> None:
    """(Batch norm over one sample raises in training: the profile records the size it could not time at.) The
    planner chooses among the other counts and says so; where none is left it plans as before."""
    gpt = load_profile(GPT)
    cluster = make_cluster(4, None, ["10GB/s"])
    free = partition(gpt, cluster, straight=True, schedule="1f1b", global_batch_size=8)
    size = free.microbatch_size
    assert size < 8
    failed = dataclasses.replace(gpt, settings={**gpt.settings, "batch_sizes_not_timed": {str(size): "it raised"}})
    plan = partition(failed, cluster, straight=True, schedule="1f1b", global_batch_size=8)
    assert plan.microbatch_size != size and plan.global_batch_size == 8
    assert f"microbatches of {size} sample{'s' if size > 1 else ''} left out: the profile could not run the model " \
           "at that size (its notes say why)" in plan.notes
    every = dataclasses.replace(gpt, settings={**gpt.settings, "batch_sizes_not_timed": {
        str(other): "it raised" for other in range(1, 9)}})
    alone = partition(every, cluster, straight=True, schedule="1f1b", global_batch_size=8)
    assert alone.microbatch_size == size and not any("left out" in note for note in alone.notes)
    fixed = partition(failed, cluster, straight=True, schedule="1f1b", microbatches=8 // size, global_batch_size=8)
    assert fixed.microbatch_size == size  # asked for by count: as asked


def test_a_global_batch_with_a_fixed_microbatch_size_fixes_the_count() -> None:
    gpt = load_profile(GPT)
    plan = partition(gpt, make_cluster(4, None, ["10GB/s"]), straight=True, microbatch_size=8, global_batch_size=64)
    assert (plan.microbatches, plan.microbatch_size, plan.global_batch_size) == (8, 8, 64)
    without = partition(gpt, make_cluster(4, None, ["10GB/s"]), straight=True, microbatch_size=8, microbatches=8)
    assert without.stages == plan.stages and without.predicted == plan.predicted
    assert "a global batch of 64 per optimizer step" in " ".join(plan.notes)


def test_a_plan_says_what_its_microbatches_change_where_the_samples_of_a_batch_are_coupled() -> None:
    """Batch norm found by the profiler: a plan that cuts the batch into microbatches says each is normalised on
    its own (with the sizes); one that does not cut it, and a profile without batch norm, say nothing."""
    gpt = load_profile(GPT)
    coupled = dataclasses.replace(gpt, batch_coupling=BatchCoupling(("transformer.h.0.bn",), None))
    plan = partition(coupled, make_cluster(2, None, ["10GB/s"]), straight=True, schedule="1f1b", microbatches=4)
    assert ("batch norm (1 module: transformer.h.0.bn) normalises each microbatch of 8 samples with that "
            "microbatch's statistics, and moves running statistics once per microbatch: training differs from plain "
            "PyTorch on batches of 32") in plan.notes
    whole = partition(coupled, make_cluster(1), schedule="gpipe", microbatches=1)
    assert not any("batch norm" in note for note in whole.notes)
    plain = partition(dataclasses.replace(gpt, batch_coupling=BatchCoupling()), make_cluster(2, None, ["10GB/s"]),
                      straight=True, schedule="1f1b", microbatches=4)
    assert plain.notes == tuple(note for note in plan.notes if "batch norm" not in note)


def test_a_profile_of_several_batch_sizes_prices_a_microbatch_between_them_by_interpolation() -> None:
    """Measured at 2 samples in half the time of 8 (not a quarter): a microbatch of 4 costs a third of the way
    from 2's time to 8's, under 1f1b and, its backward scaled by the split's cost (but the first stage's), under
    zb-h1; 8 as before."""
    mlp = load_profile(PROFILES_V1 / "mlp.json")  # one size measured, no split backward
    fwd_ms, bwd_ms = sum(layer.fwd_ms for layer in mlp.layers), sum(layer.bwd_ms for layer in mlp.layers)
    half = SizeTimes(batch_size=2, fwd_ms=tuple(0.5 * layer.fwd_ms for layer in mlp.layers),
                     bwd_ms=tuple(0.5 * layer.bwd_ms for layer in mlp.layers))
    sized = dataclasses.replace(mlp, size_times=(half,), split_backward_ratio=1.25)
    at_4 = 0.5 + (1.0 - 0.5) * (4 - 2) / (8 - 2)  # share of 8's times

    plan = partition(sized, make_cluster(1, None, ["10GB/s"]), microbatch_size=4, microbatches=1)
    assert plan.stages[0].compute_ms == pytest.approx(at_4 * (fwd_ms + bwd_ms), rel=1e-12)
    assert "times interpolated between measured batch sizes 2 and 8 for 4 (measured: 2, 8)" in plan.notes
    split = partition(sized, make_cluster(2, None, ["10GB/s"]), schedule="zb-h1", straight=True, microbatch_size=4,
                      microbatches=4)
    first_bwd_ms = sum(layer.bwd_ms for layer in mlp.layers[:split.stages[0].stop])  # run whole: no input gradient
    assert sum(stage.compute_ms for stage in split.stages) == pytest.approx(
        at_4 * (fwd_ms + first_bwd_ms + 1.25 * (bwd_ms - first_bwd_ms)), rel=1e-12)

    linear = partition(mlp, make_cluster(1, None, ["10GB/s"]), microbatch_size=4, microbatches=1)
    assert linear.stages[0].compute_ms == pytest.approx(0.5 * (fwd_ms + bwd_ms), rel=1e-12)
    assert "times scaled linearly from the profiled batch of 8 to 4" in linear.notes
    for size in (8, 16):  # at and beyond the largest measured size: 8's times scaled linearly, as without sizes
        with_sizes, without = (partition(profile, make_cluster(2, None, ["10GB/s"]), microbatch_size=size)
                               for profile in (sized, dataclasses.replace(mlp, split_backward_ratio=1.25)))
        assert with_sizes.stages == without.stages and with_sizes.predicted == without.predicted


def test_auto_takes_a_chunked_schedule_where_it_simulates_faster_at_the_count_of_the_best_other() -> None:
    """gpt straight on 2 GPUs at 10 GB/s: auto's plan is interleaved-1f1b, tried at the microbatch count the best
    plan of one stage per GPU chose, and it simulates faster than each of those schedules' own best plan there;
    the plan says the chunked schedules were tried at that count only."""
    gpt = load_profile(GPT)
    cluster = make_cluster(2, None, ["10GB/s"])
    plan = partition(gpt, cluster, straight=True)
    assert plan.schedule == "interleaved-1f1b" and plan.chunks > 1
    for schedule in ("gpipe", "1f1b", "zb-h1", "zbv"):  # the profile measured the split backward: zb too
        other = partition(gpt, cluster, straight=True, schedule=schedule, microbatches=plan.microbatches)
        assert plan.predicted.samples_per_s > other.predicted.samples_per_s
        assert not any("auto chose" in note for note in other.notes)  # a named schedule weighed no others
    # the plan says what auto weighed; interleaved-1f1b won by less than CHUNKED_MARGIN over zb-h1 (2.5%), so it also
    # says that the ops it has more of cost more than simulated
    (weighed,) = [note for note in plan.notes if note.startswith("--schedule auto chose interleaved-1f1b (")]
    slower = {name: float(share) for name, share in re.findall(r"(\S+) (\d+\.\d)% slower", weighed)}
    assert set(slower) == {"gpipe", "1f1b", "zb-h1", "zbv"} and min(slower.values()) > 0
    nearest = min(slower[name] for name in ("gpipe", "1f1b", "zb-h1"))
    assert nearest < 100 * (1 - 1 / CHUNKED_MARGIN) and "runs 2 times the forwards and backwards of zb-h1" in weighed
    assert any(note.startswith("--schedule auto tried interleaved-1f1b, zbv at one microbatch count") for note in
               plan.notes)
    fixed = partition(gpt, cluster, straight=True, microbatches=plan.microbatches)
    assert fixed.schedule == plan.schedule and not any("at one microbatch count" in note for note in fixed.notes)


def test_auto_compares_chunked_plans_after_their_cuts_are_refined() -> None:
    """gpt2-medium profiled on an H200 (B and W measured apart, 1.00x a whole backward), 4 GPUs straight, 8
    microbatches of 8: zbv's plan refines from 270.3 to 262.7 ms, past interleaved-1f1b's 266.0; auto, which once
    compared them unrefined, picks zbv, and no schedule named alone simulates faster."""
    profile = load_profile(REPO / "tests" / "data" / "profiles-h200" / "gpt2-medium.json")
    cluster = make_cluster(4)
    plan = partition(profile, cluster, straight=True, microbatches=8, microbatch_size=8)
    assert plan.schedule == "zbv"
    for schedule in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv"):
        other = partition(profile, cluster, straight=True, schedule=schedule, microbatches=8, microbatch_size=8)
        assert plan.predicted.samples_per_s >= other.predicted.samples_per_s * (1 - 1e-9), schedule


def test_a_plan_the_final_choice_did_not_prove_fastest_is_refined_by_local_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The frozen CPU gpt profile straight on 8 GPUs, gpipe, 8 microbatches, with the final choice's search given
    no budget (as on a profile too deep for its bounds): the dynamic program's 5 stages simulate 548.3 ms; moving
    cuts and splitting stages (`local_search.refine_plan`) reaches 8 stages and 539.0 ms, which the plan states."""
    profile = load_profile(REPO / "tests" / "data" / "profiles-cpu" / "gpt.json")
    capped = partition_module.best_simulated
    monkeypatch.setattr(partition_module, "best_simulated",
                        lambda *args: capped(*args, max_simulations=0, max_expansions=0))
    plan = partition(profile, make_cluster(8), straight=True, schedule="gpipe", microbatches=8)
    monkeypatch.setattr(partition_module, "refine_plan", lambda inputs, start, start_s, *flags: (start, start_s, 0))
    unrefined = partition(profile, make_cluster(8), straight=True, schedule="gpipe", microbatches=8)
    assert len(unrefined.stages) == 5 and len(plan.stages) == 8
    assert plan.predicted.iteration_ms < 0.99 * unrefined.predicted.iteration_ms
    counted = re.search(r"The plan is the fastest of (\d+) simulated, .*then a local search \(cuts moved and stages "
                        r"split and merged: (\d+) more plans simulated\) found this faster plan", " ".join(plan.notes))
    assert counted, plan.notes
    assert int(counted.group(1)) == 1 and int(counted.group(2)) > 8  # the search's one (its budget was 0), then more
    assert any("0 more plans simulated) found no faster plan" in note for note in unrefined.notes)


def test_an_unproven_plan_states_how_far_from_the_fastest_it_can_be(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frozen CPU gpt profile straight on 4 GPUs, 1f1b, 8 microbatches, the final choice capped at 2 partial
    plans: its notes give the search's lower bound and the plan's time over it; the uncapped search's plan (proven
    the fastest) simulates no faster than that bound."""
    profile = load_profile(REPO / "tests" / "data" / "profiles-cpu" / "gpt.json")
    uncapped = partition(profile, make_cluster(4), straight=True, schedule="1f1b", microbatches=8)
    assert any("no other plan simulates faster" in note and "at its cap" not in note for note in uncapped.notes)
    capped = partition_module.best_simulated
    monkeypatch.setattr(partition_module, "best_simulated",
                        lambda *args: capped(*args, max_simulations=0, max_expansions=2))
    plan = partition(profile, make_cluster(4), straight=True, schedule="1f1b", microbatches=8)
    stated = re.search(r"none simulates faster than ([\d.]+) ms\).*at most x([\d.]+) from the fastest",
                       " ".join(plan.notes))
    assert stated, plan.notes
    bound_ms, ratio = float(stated.group(1)), float(stated.group(2))
    assert 0 < bound_ms <= plan.predicted.iteration_ms
    assert ratio == pytest.approx(plan.predicted.iteration_ms / bound_ms, abs=2e-3)
    assert uncapped.predicted.iteration_ms >= bound_ms * (1 - 1e-3)  # the bound printed to 4 digits


def test_a_zero_bubble_plan_of_a_profile_without_the_split_backward_says_how_it_priced_it() -> None:
    """A profile made before the split was measured, or of a model checkpointed reentrantly (which left it None)."""
    mlp = load_profile(PROFILES_V1 / "mlp.json")  # no split backward measured
    plan = partition(mlp, make_cluster(2, None, ["10GB/s"]), schedule="zb-h1", straight=True, microbatches=4)
    assert any("zb-h1's backwards are priced as whole ones" in note for note in plan.notes)
    measured = partition(dataclasses.replace(mlp, split_backward_ratio=1.1), make_cluster(2, None, ["10GB/s"]),
                         schedule="zb-h1", straight=True, microbatches=4)
    assert not any("priced as whole" in note for note in measured.notes)


def test_a_zero_bubble_plan_says_when_its_profile_did_not_measure_what_b_holds() -> None:
    """A profile without the per-layer B measurement (as the shipped ones predate it; `./dev.sh demo` replaces
    profiles/gpt.json with one that has it, so it is taken out here): the plan says its memory is the bound;
    measured (here: each layer's workspace as B's), it says nothing of it."""
    gpt = dataclasses.replace(load_profile(REPO / "profiles" / "gpt.json"), input_workspace_bytes=())
    note = "did not measure what a split backward's B holds"
    plan = partition(gpt, make_cluster(2), schedule="zb-h1", straight=True, microbatches=4)
    assert any(note in line for line in plan.notes)
    measured = dataclasses.replace(gpt, input_workspace_bytes=gpt.workspace_bytes)
    plan = partition(measured, make_cluster(2), schedule="zb-h1", straight=True, microbatches=4)
    assert not any(note in line for line in plan.notes)
    assert not any(note in line for line in partition(gpt, make_cluster(2), schedule="1f1b", microbatches=4).notes)


def test_progress_is_told_each_step_of_the_search_as_it_starts() -> None:
    """A memory-limited search can take many seconds: `progress` hears each schedule at each microbatch count it
    plans, each final choice and local search, in order, and changes nothing of the plan."""
    gpt = load_profile(REPO / "profiles" / "gpt.json")
    steps: list[str] = []
    plan = partition(gpt, make_cluster(2), schedule="1f1b", microbatches=4, progress=steps.append)
    assert steps == ["1f1b, 4 microbatches", "1f1b, 4 microbatches: simulating"]
    assert plan == partition(gpt, make_cluster(2), schedule="1f1b", microbatches=4)
    steps.clear()
    partition(gpt, make_cluster(4, memory="1GB"), progress=steps.append)
    planned = [step for step in steps if not step.endswith(("simulating", "local search"))]
    assert {"1f1b, 4 microbatches", "gpipe, 4 microbatches", "zb-h1, 1 microbatch"} <= set(planned)
    assert len(planned) == len(set(planned))  # each (schedule, count) planned once
    assert all(steps.index(f"{name}, 4 microbatches") < steps.index(f"{name}, 4 microbatches: simulating")
               for name in ("1f1b", "gpipe"))


def test_gpipe_and_1f1b_under_a_memory_limit_share_one_search_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their best plan without the limit is one (`test_optimizer`), so partition finds it once per microbatch count
    for both, and gives each schedule's limited search the same plan as before."""
    gpt = load_profile(REPO / "profiles" / "gpt.json")
    cluster = make_cluster(4, memory="1GB")
    expected = partition(gpt, cluster, schedule="gpipe", microbatches=4)
    unlimited: list[tuple[str, int]] = []
    search = optimizer_module.optimize

    def counted(inputs: CostInputs, *args, **kwargs):
        if inputs.memory_bytes is None and inputs.cluster.num_devices == 4:
            unlimited.append((inputs.schedule, inputs.microbatches))
        return search(inputs, *args, **kwargs)

    monkeypatch.setattr(optimizer_module, "optimize", counted)
    monkeypatch.setattr(partition_module, "optimize", counted)
    partition(gpt, cluster, microbatches=4)  # every schedule
    assert [count for schedule, count in unlimited if schedule in ("gpipe", "1f1b")] == [4]
    unlimited.clear()
    assert partition(gpt, cluster, schedule="gpipe", microbatches=4) == expected
    assert unlimited == [("gpipe", 4)]


def test_a_zero_bubble_plan_states_the_memory_it_was_fitted_to_and_the_simulator_plays() -> None:
    """gpt's straight zb-h1 plan on 2 GPUs, 4 microbatches: each stage's stated memory is the closed form the search
    fits to the limit, and the simulator plays the same peak (a B holding its workspace and the gradients it keeps,
    a W no workspace but on the first stage), so a limit at the stated peak admits the same plan."""
    from planner.costs.schedule_cost import stage_costs
    from planner.simulation.plan_simulation import plan_cost_inputs, plan_stages, simulate

    gpt = load_profile(GPT)
    free = partition(gpt, make_cluster(2, None, ["10GB/s"]), schedule="zb-h1", straight=True, microbatches=4)
    peaks = simulate(free, gpt).peak_memory()
    assert [stage.memory_bytes for stage in free.stages] == [int(peaks[s]) for s in range(len(free.stages))]
    bounds = [cost.memory_bytes for cost in stage_costs(plan_cost_inputs(gpt, free), plan_stages(free))]
    assert [stage.memory_bytes for stage in free.stages] == [int(bound) for bound in bounds]
    limit = free.predicted.peak_memory_bytes + 1
    tight = partition(gpt, make_cluster(2, None, ["10GB/s"], memory=limit), schedule="zb-h1", straight=True,
                      microbatches=4)
    assert plan_stages(tight) == plan_stages(free)


def test_a_stage_before_a_faster_one_states_the_gradients_that_wait_for_it() -> None:
    """gpipe on 2 stages, 8 microbatches, 1 MiB cut between them, the second stage's backward twice as fast: its
    gradients arrive faster than the first stage's backwards take them, and the receiver thread posts the next two
    receives as each arrives: the first stage peaks at its third backward, 6 microbatches of 1 byte held, its 2 MiB
    workspace and 5 gradient buffers, above the closed form's 8 + 2 MiB + 2 buffers (`schedule_cost.ahead_terms`).
    The plan states the simulated peak, the larger; on equal stages the closed form, which is then exact."""
    import numpy as np

    from planner.costs.layer_arrays import LayerArrays
    from planner.costs.schedule_cost import stage_costs

    cut = float(2**20)

    def inputs(second_s: float) -> CostInputs:
        prefix = lambda values: np.concatenate([[0.0], np.cumsum(values)])  # noqa: E731
        arrays = LayerArrays(compute_s=prefix([0.75, second_s]), param_bytes=np.zeros(3), cut_bytes=np.array([cut, 0.0]),
                             saved_bytes=prefix([1.0, 1.0]), fwd_s=prefix([0.25, second_s / 3]),
                             workspace_bytes=np.array([2 * cut, 2 * cut]))
        return CostInputs(arrays, make_cluster(2, None, ["4MiB/s"]), "gpipe", 8, optimizer_copies=0)

    plan: list[Stage] = [(0, 1, 1, False), (1, 2, 1, False)]
    for second_s, first_peak in ((0.75, 8 + 2 * cut + 2 * cut), (0.375, 6 + 2 * cut + 5 * cut)):
        closed = [cost.memory_bytes for cost in stage_costs(inputs(second_s), plan)]
        assert closed[0] == 8 + 2 * cut + 2 * cut
        stated = partition_module._simulated_peaks(inputs(second_s), plan, closed)
        assert stated == [first_peak, closed[1]]


def test_the_memory_note_names_the_stages_above_their_closed_form() -> None:
    """Stage 1 states 1.2 GB against its closed form's 1.0: named, with its figures; no stage above its closed
    form, no note."""
    note = partition_module._memory_note([5e8, 1.2e9], [5e8, 1e9])
    assert note is not None and note.startswith("memory/GPU of stage 1 is the simulated peak")
    assert "(stage 1: 1200 MB against 1000)" in note
    assert partition_module._memory_note([5e8, 1e9], [5e8, 1e9]) is None


def waiting_gradients_profile(first_saved_bytes: int, last_workspace_bytes: int) -> Profile:
    """Two layers, the second twice as fast: under gpipe on 2 GPUs with 8 microbatches (4 MiB/s links) the first
    stage's gradients wait in receive buffers (test_a_stage_before_a_faster_one_states_the_gradients_that_wait_for_it):
    its simulated peak is 1 MiB above its closed form. Layer a sends 1 MiB, saves `first_saved_bytes` a
    microbatch and holds a 2 MiB workspace; layer b saves 1 KiB and holds `last_workspace_bytes`."""
    mib = 2**20
    layers = (LayerProfile("a", "Linear", 250.0, 500.0, mib, mib, 0, first_saved_bytes),
              LayerProfile("b", "Linear", 125.0, 250.0, 8, 0, 0, 1024))
    return Profile("waiting", "waiting.py", "cpu", "cpu", "2.13.0", "float32", 8, 1, "2026-11-28", layers, 1125.0, 0,
                   "live-tensors", 1000, workspace_bytes=(2 * mib, last_workspace_bytes))


@pytest.mark.parametrize("recompute", [True, False])
def test_a_plan_whose_simulated_peak_exceeds_the_limit_is_searched_again_within_less(recompute: bool) -> None:
    """At a limit equal to the 2-stage plan's closed form, that plan peaks 1 MiB above it in simulation: partition
    searches again within the limit less that, and its plan (the first stage recomputing, or with recompute off
    the whole model on one GPU) states and simulates a peak within the limit; a note says what happened."""
    from planner.costs.schedule_cost import stage_costs
    from planner.simulation.plan_simulation import plan_cost_inputs, plan_stages, simulate

    profile = waiting_gradients_profile(2**20, 64 * 1024)
    cluster = lambda memory: make_cluster(2, None, ["4MiB/s"], memory=memory)  # noqa: E731
    free = partition(profile, cluster(None), schedule="gpipe", straight=True, microbatches=8, optimizer="sgd")
    closed = [cost.memory_bytes for cost in stage_costs(plan_cost_inputs(profile, free), plan_stages(free))]
    limit = int(closed[0])
    assert [stage.memory_bytes for stage in free.stages][0] == limit + 2**20 and closed[1] < limit
    tight = partition(profile, cluster(limit), schedule="gpipe", straight=True, microbatches=8, optimizer="sgd",
                      recompute=recompute)
    expected = [(0, 1, True), (1, 2, False)] if recompute else [(0, 2, False)]
    assert [(stage.start, stage.stop, stage.recompute) for stage in tight.stages] == expected
    simulated = simulate(tight, profile).peak_memory().tolist()
    assert max(simulated) <= limit and [stage.memory_bytes for stage in tight.stages] == [int(v) for v in simulated]
    notes = [note for note in tight.notes if note.startswith("memory: the fastest plan")]
    assert len(notes) == 1 and f"peaked at {(limit + 2**20) / 1e9:.4g} GB in simulation" in notes[0]
    # the first search limit is the limit less the excess; its plan fits, and halving the gap to the limit twice
    # finds none faster, so the plan and the note name it
    tried = [limit - 2**20, limit - 2**19, limit - 2**18]
    assert f"the search ran again within {', '.join(f'{v / 1e9:.4g}' for v in tried[:2])} and " \
           f"{tried[2] / 1e9:.4g} GB" in notes[0], notes[0]
    assert f"is the search's plan within {tried[0] / 1e9:.4g} GB" in notes[0]


def test_a_plan_of_one_stage_within_the_limit_is_found_where_the_lowered_limit_leaves_it_out() -> None:
    """(A review's case.) The profile of the next test, at a limit of the whole model's peak on one GPU (14.51 MiB):
    the 2-stage plan fits it in the closed form (14 MiB) and peaks at 15 MiB in simulation, so the search runs again
    within 13.51 MiB, where no plan fits; the one-GPU plan, left out by the lowered limit, fits the real one and is
    the plan, with a note saying how it was found."""
    profile = waiting_gradients_profile(5 * 2**18, 9 * 2**19)
    options = dict(schedule="gpipe", straight=True, microbatches=8, optimizer="sgd", recompute=False)
    alone = partition(profile, make_cluster(1, None, ["4MiB/s"]), **options)
    limit = alone.stages[0].memory_bytes
    assert limit == 14 * 2**20 + 2**19 + 8 * 1024 + 8 * 1000  # + 8 microbatches of the batch's 1000 bytes
    plan = partition(profile, make_cluster(2, None, ["4MiB/s"], memory=limit), **options)
    assert [(stage.start, stage.stop, stage.replicas) for stage in plan.stages] == [(0, 2, 1)]
    assert plan.stages[0].memory_bytes == limit and plan.predicted.devices_used == 1
    notes = [note for note in plan.notes if note.startswith("memory: the fastest plan")]
    assert len(notes) == 1 and "is a plan of one stage, simulated alone" in notes[0]


def test_no_plan_within_the_limit_once_waiting_messages_count_is_one_line_naming_them() -> None:
    """As above without recompute, but layer a saves 1.25 MiB a microbatch and layer b holds a 4.5 MiB workspace, so
    that the whole model on one GPU (14.5 MiB) does not fit the 2-stage plan's closed form (14 MiB) either: no plan
    is left within the limit less the excess, and the error says why and at what memory the plan found fits."""
    from planner.costs.schedule_cost import stage_costs
    from planner.simulation.plan_simulation import plan_cost_inputs, plan_stages

    profile = waiting_gradients_profile(5 * 2**18, 9 * 2**19)
    free = partition(profile, make_cluster(2, None, ["4MiB/s"]), schedule="gpipe", straight=True, microbatches=8,
                     optimizer="sgd")
    limit = int(stage_costs(plan_cost_inputs(profile, free), plan_stages(free))[0].memory_bytes)
    assert limit == 14 * 2**20 + 8 * 1000  # the first stage's 8 microbatches of the batch (1000 bytes each)
    with pytest.raises(InfeasiblePlanError) as raised:
        partition(profile, make_cluster(2, None, ["4MiB/s"], memory=limit), schedule="gpipe", straight=True,
                  microbatches=8, optimizer="sgd", recompute=False)
    message = str(raised.value)
    assert message.startswith(f"no plan fits in {limit / 1e9:.4g} GB per device once the messages waiting in "
                              "receive buffers are counted"), message
    assert message.endswith("or an optimizer with less state") and "nor does any plan of one stage" in message
    assert f"peaks at {(limit + 2**20) / 1e9:.4g} GB in simulation" in message
    assert raised.value.smallest_memory_bytes == limit + 2**20 and "\n" not in message


@pytest.mark.skipif(not (PIPEDREAM_DIR / "vgg16.txt").is_file(), reason="../shared/pipedream-profiles is not present")
def test_a_first_search_limit_within_which_nothing_fits_does_not_end_the_refit() -> None:
    """PipeDream's vgg16 on 4 GPUs (10 GB/s), gpipe, 8 microbatches, at 8.448 GB: the fastest plan fitting the closed
    form peaks at 9.172 GB in simulation, and within 8.448 - 0.724 = 7.724 GB no plan fits at all. That ended the
    search (partition refused) while a plan peaking at 8.119 GB fits; the search now goes on between the two
    limits, and its plan's simulated peaks are within the limit."""
    from planner.simulation.plan_simulation import simulate

    profile = import_pipedream(PIPEDREAM_DIR / "vgg16.txt")
    limit = 8.448e9
    plan = partition(profile, make_cluster(4, bandwidths=[10e9], memory=int(limit)), straight=False, schedule="gpipe",
                     microbatches=8)
    simulated = simulate(plan, profile).peak_memory().tolist()
    assert max(simulated) <= limit and max(stage.memory_bytes for stage in plan.stages) <= limit
    notes = [note for note in plan.notes if note.startswith("memory: the fastest plan")]
    assert len(notes) == 1 and "peaked at 9.172 GB in simulation" in notes[0], plan.notes
    assert "the search ran again within 7.724, 8.086 and " in notes[0], notes[0]


def test_the_limits_a_refit_tried_are_named_with_the_digits_that_tell_them_apart() -> None:
    """(GPT-2 within 137.7 MB: at 4 digits the three limits all read 0.1376 or 0.1377 GB.)"""
    assert partition_module._limits_text([7.724e9]) == "7.724 GB"
    assert partition_module._limits_text([7.724e9, 8.086e9, 8.267e9]) == "7.724, 8.086 and 8.267 GB"
    assert partition_module._limits_text([137.5564e6, 137.6282e6, 137.6641e6]) == "0.13756, 0.13763 and 0.13766 GB"
    assert partition_module._limits_text([1e9, 1e9]) == "1 and 1 GB"  # equal limits stay at 4 digits


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_the_plans_idle_share_is_its_simulated_iterations(schedule: str) -> None:
    """(partition said 22.1% idle where simulate said 20.1%.) The plan states the simulated iteration's idle share of
    device time, all-reduces and optimizer steps counted busy as the simulation and a run report count them."""
    from planner.simulation.plan_simulation import simulate

    gpt = load_profile(REPO / "profiles" / "gpt.json")
    plan = partition(gpt, make_cluster(2), straight=True, schedule=schedule, microbatches=4)
    assert plan.predicted.bubble_fraction == pytest.approx(simulate(plan, gpt).idle_fraction(), abs=1e-9)
    assert 0 < plan.predicted.bubble_fraction < 1


def test_a_global_batch_the_search_chose_is_named_with_the_option_that_fixes_it() -> None:
    """Without --global-batch-size or --microbatches the microbatch count, so the global batch, is the search's
    choice for this cluster; a note says so, once, and is left out where the user fixed the batch."""
    gpt = load_profile(REPO / "profiles" / "gpt.json")
    auto = partition(gpt, make_cluster(2), straight=True, schedule="1f1b")
    notes = [note for note in auto.notes if note.startswith("global batch")]
    assert len(notes) == 1, auto.notes
    assert notes[0].startswith(f"global batch {auto.global_batch_size} = {auto.microbatches} microbatch")
    assert notes[0].endswith(f"x {auto.microbatch_size} samples: it may change with --gpus or --memory; "
                             "--global-batch-size fixes it")
    for fixed in (dict(microbatches=4), dict(global_batch_size=32)):
        plan = partition(gpt, make_cluster(2), straight=True, schedule="1f1b", **fixed)
        assert not any(note.startswith("global batch") for note in plan.notes), fixed
