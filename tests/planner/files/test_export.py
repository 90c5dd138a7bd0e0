"""planner.files.export and `planner export`: split_spec and parts from real plans, the snippet runs against torch's
API, refusals (pipedream, unequal replicas, uneven microbatches), files written, one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from planner.cli import app
from planner.files.cluster import make_cluster
from planner.errors import FileProblemError
from planner.files.export import (
    DEEPSPEED_FORMAT, PIPPY_FORMAT, ExportError, deepspeed_export, export_paths, pippy_export,
)
from planner.planning.partition import partition
from planner.files.plan import Plan
from planner.files.profile import Profile, load_profile

REPO = Path(__file__).resolve().parents[3]
runner = CliRunner()


def profile_of(model: str) -> Profile:
    return load_profile(REPO / "profiles" / f"{model}.json")


def straight_plan(model: str, gpus: int, schedule: str = "1f1b", microbatches: int = 4) -> Plan:
    """The planner's straight plan of a shipped profile (the profile path recorded, for the CLI)."""
    return partition(profile_of(model), make_cluster(gpus), straight=True, schedule=schedule,
                     microbatches=microbatches, profile_path=str(REPO / "profiles" / f"{model}.json"))


def with_replicas(plan: Plan, replicas: list[int], microbatches: int = 4) -> Plan:
    """`plan` with these replica counts per stage, ranks contiguous stage by stage."""
    stages, first = [], 0
    for stage, count in zip(plan.stages, replicas):
        stages.append(dataclasses.replace(stage, replicas=count, ranks=tuple(range(first, first + count))))
        first += count
    return dataclasses.replace(plan, stages=tuple(stages), microbatches=microbatches)


@pytest.mark.parametrize("model, gpus", [("gpt", 4), ("mlp", 2), ("gpt", 3)])
def test_split_spec_names_the_profile_layer_that_begins_each_later_stage(model: str, gpus: int) -> None:
    plan, names = straight_plan(model, gpus), [layer.name for layer in profile_of(model).layers]
    exported = pippy_export(plan, "p.json")
    assert len(plan.stages) == gpus
    assert exported.split_spec == {names[stage.start]: "SplitPoint.BEGINNING" for stage in plan.stages[1:]}
    assert exported.schedule_class == "Schedule1F1B" and exported.num_stages == gpus
    assert exported.replicas == 1 and exported.n_microbatches == 4
    assert exported.ranks == (tuple(range(gpus)),)
    body = exported.to_dict()
    assert json.loads(json.dumps(body)) == body  # plain JSON


@pytest.mark.parametrize("model, gpus", [("gpt", 4), ("mlp", 2), ("gpt", 3)])
def test_deepspeed_parts_slice_the_profile_layers_into_the_plans_stages(model: str, gpus: int) -> None:
    plan, profile = straight_plan(model, gpus), profile_of(model)
    names = [layer.name for layer in profile.layers]
    exported = deepspeed_export(plan, profile, "p.json")
    parts = exported.parts
    assert parts[0] == 0 and parts[-1] == len(names) and len(parts) == gpus + 1
    slices = [names[parts[s]:parts[s + 1]] for s in range(gpus)]
    assert [list(layers) for layers in exported.stage_layers] == slices
    assert sum(slices, []) == names
    assert [(layers[0], layers[-1]) for layers in slices] == [(s.first_layer, s.last_layer) for s in plan.stages]
    assert exported.data_parallel == 1 and exported.gradient_accumulation_steps == 4
    assert exported.config()["train_batch_size"] == plan.microbatch_size * 4


def test_gpt_deepspeed_export_lists_the_tied_embedding_and_its_stages() -> None:
    plan = straight_plan("gpt", 2)
    exported = deepspeed_export(plan, profile_of("gpt"), "p.json")
    assert exported.tied == ((("transformer.wte.weight", "lm_head.weight"), (0, 16), (0, 1)),)
    text = exported.instructions()
    assert f"parts = {list(exported.parts)}" in text
    assert "transformer.wte.weight = lm_head.weight: layers [0, 16], stages [0, 1]" in text
    assert "pipeline_module(model, plan, loss_fn=loss_fn, example_inputs=example_microbatch)" in text
    assert "_partition_layers" not in text  # no private DeepSpeed method is overridden any more


def test_equal_replicas_give_a_mesh_of_pipelines_and_a_data_parallel_degree() -> None:
    plan = with_replicas(straight_plan("mlp", 2), [2, 2], microbatches=8)
    pippy = pippy_export(plan)
    assert pippy.replicas == 2 and pippy.n_microbatches == 4 and pippy.microbatches_per_step == 8
    assert pippy.ranks == ((0, 2), (1, 3))  # pipeline k = replica k of every stage
    assert pippy.stage_ranks == ((0, 1), (2, 3)) and pippy.world_size == 4
    deepspeed = deepspeed_export(plan, profile_of("mlp"))
    assert deepspeed.data_parallel == 2 and deepspeed.gradient_accumulation_steps == 4
    assert deepspeed.train_batch_size == plan.microbatch_size * 8  # the plan's mini-batch
    assert deepspeed.stage_ranks == deepspeed.deepspeed_stage_ranks()


def test_unequal_replication_is_refused_with_the_counts_and_the_fix() -> None:
    plan = with_replicas(straight_plan("mlp", 2), [2, 1])
    exports = (lambda: pippy_export(plan, "plans/m.json"),
               lambda: deepspeed_export(plan, profile_of("mlp"), "plans/m.json"))
    for export in exports:
        with pytest.raises(ExportError) as caught:
            export()
        message = str(caught.value)
        assert message.startswith("plans/m.json: ") and "[2, 1] replicas" in message
        assert "--straight" in message and "Engine.from_plan" in message


def test_pipedream_is_refused_with_a_synchronous_replan() -> None:
    plan = dataclasses.replace(straight_plan("mlp", 2), schedule="pipedream", microbatches=None)
    for export in (lambda: pippy_export(plan, "p.json"), lambda: deepspeed_export(plan, profile_of("mlp"), "p.json")):
        with pytest.raises(ExportError, match="'pipedream'.*--gpus 2 --straight .*--schedule 1f1b`"):
            export()


def test_microbatches_that_do_not_split_over_the_pipelines_are_refused() -> None:
    plan = with_replicas(straight_plan("mlp", 2), [2, 2], microbatches=3)
    with pytest.raises(ExportError, match="3 microbatches per step do not split evenly over its 2 pipelines"):
        pippy_export(plan)


def test_zb_h1_maps_to_the_zero_bubble_class_and_needs_whole_rounds() -> None:
    plan = dataclasses.replace(straight_plan("mlp", 2), schedule="zb-h1", microbatches=8)
    three = dataclasses.replace(plan, stages=plan.stages + (plan.stages[-1],))  # only the counts matter here
    export = pippy_export(plan)
    assert (export.schedule_class, export.n_microbatches) == ("ScheduleInterleavedZeroBubble", 8)
    assert "ScheduleInterleavedZeroBubble(stages," in export.snippet()
    with pytest.raises(ExportError, match="7 microbatches per pipeline on 3 stages make 2.*--microbatches 8"):
        pippy_export(dataclasses.replace(three, microbatches=7))


def test_interleaved_maps_to_the_interleaved_class_on_each_ranks_chunks() -> None:
    """interleaved-1f1b: p ranks (not p x v), torch's ScheduleInterleaved1F1B given the rank's stages; DeepSpeed,
    which has no interleaved schedule, refuses it in one line."""
    plan = straight_plan("gpt", 2, schedule="interleaved-1f1b")
    export = pippy_export(plan)
    assert (export.schedule_class, export.world_size, export.chunks) == ("ScheduleInterleaved1F1B", 2, plan.chunks)
    assert export.num_stages == 2 * plan.chunks and export.ranks == (tuple(s % 2 for s in range(export.num_stages)),)
    assert export.to_dict()["chunks"] == plan.chunks and "ScheduleInterleaved1F1B(stages," in export.snippet()
    with pytest.raises(ExportError, match="has no schedule for"):
        deepspeed_export(plan, profile_of("gpt"))


def test_gpipe_maps_to_schedule_gpipe() -> None:
    assert pippy_export(straight_plan("mlp", 2, schedule="gpipe")).schedule_class == "ScheduleGPipe"


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.export inside pipeline()
def test_the_snippet_runs_and_its_settings_are_torch_objects() -> None:
    """Executing the snippet imports torch's API; its SPLIT_SPEC then splits the model with pipeline()."""
    import torch
    from torch.distributed.pipelining import SplitPoint

    from planner.profiling.model_file import load_model_file

    plan = straight_plan("mlp", 2)
    namespace: dict[str, object] = {}
    exec(compile(pippy_export(plan, "plans/mlp.json").snippet(), "snippet.py", "exec"), namespace)
    assert namespace["SPLIT_SPEC"] == {plan.stages[1].first_layer: SplitPoint.BEGINNING}
    assert namespace["PIPELINES"] == [[0, 1]] and namespace["N_MICROBATCHES"] == 4 and namespace["NUM_STAGES"] == 2
    assert namespace["PLAN"] == "plans/mlp.json"
    torch.manual_seed(0)
    source = load_model_file(REPO / "examples" / "mlp.py")
    model = source.build_model()
    pipe = namespace["pipeline"](model, mb_args=(source.example_batch(2)[0],), split_spec=namespace["SPLIT_SPEC"])
    assert pipe.num_stages == 2
    for index, stage in enumerate(plan.stages):  # each traced stage holds the parameters of the plan's layers
        layers = {layer.name for layer in profile_of("mlp").layers[stage.start:stage.stop]}
        expected = {name for name, _ in model.named_parameters() if name.split(".")[0] in layers}
        assert {name for name, _ in pipe.get_stage_module(index).named_parameters()} == expected


def test_export_paths_default_next_to_the_plan_and_refuse_a_py_out(tmp_path: Path) -> None:
    assert export_paths("plans/gpt-2gpu.json", "pippy") == (Path("plans/gpt-2gpu.pippy.json"),
                                                             Path("plans/gpt-2gpu.pippy.py"))
    assert export_paths("a/b.json", "deepspeed", "c/d.json") == (Path("c/d.json"), Path("c/d.txt"))
    with pytest.raises(FileProblemError, match="ending in .json"):
        export_paths("a/b.json", "pippy", "c/d.py")


def invoke(*args: str | Path) -> Result:
    return runner.invoke(app, [str(arg) for arg in args])


def assert_one_line_error(result: Result, *fragments: str) -> None:
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


def test_cli_pippy_writes_json_and_snippet_next_to_the_plan(tmp_path: Path) -> None:
    plan_path = straight_plan("gpt", 2).save(tmp_path / "gpt-2gpu.json")
    result = invoke("export", plan_path, "--to", "pippy")
    assert result.exit_code == 0, result.output
    json_path, snippet_path = tmp_path / "gpt-2gpu.pippy.json", tmp_path / "gpt-2gpu.pippy.py"
    document = json.loads(json_path.read_text())
    assert document["format"] == PIPPY_FORMAT and document["version"] == 1
    assert document["split_spec"] == pippy_export(straight_plan("gpt", 2)).split_spec
    assert document["ranks"] == [[0, 1]] and document["n_microbatches"] == 4
    snippet = snippet_path.read_text()
    compile(snippet, str(snippet_path), "exec")
    assert snippet in result.stdout and f"wrote {json_path} and {snippet_path}" in result.stdout


def test_cli_deepspeed_writes_json_and_instructions_where_asked(tmp_path: Path) -> None:
    plan = straight_plan("gpt", 2)
    plan_path = plan.save(tmp_path / "gpt-2gpu.json")
    out = tmp_path / "exports" / "ds.json"
    result = invoke("export", plan_path, "--to", "deepspeed", "--out", out,
                    "--profile", REPO / "profiles" / "gpt.json")
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["format"] == DEEPSPEED_FORMAT
    assert document["parts"] == [0, plan.stages[1].start, 17] and document["num_stages"] == 2
    text = (tmp_path / "exports" / "ds.txt").read_text()
    assert "runtime.deepspeed" in text and text in result.stdout


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    assert_one_line_error(invoke("export", tmp_path / "missing.json", "--to", "pippy"), "missing.json", "no such file")
    plan_path = with_replicas(straight_plan("mlp", 2), [2, 1]).save(tmp_path / "mixed.json")
    assert_one_line_error(invoke("export", plan_path, "--to", "deepspeed"), "mixed.json", "[2, 1] replicas")
    assert_one_line_error(invoke("export", plan_path, "--to", "megatron"), "--to must be one of pippy, deepspeed")
    assert not list(tmp_path.glob("mixed.*.json"))  # nothing written for a refused plan


def test_cli_refusal_repeats_the_partition_command_with_a_schedule_deepspeed_runs(tmp_path: Path) -> None:
    """An interleaved plan made with --straight, --cluster and --memory: the deepspeed refusal's re-plan keeps them
    (without them the 1f1b plan it suggested was a different one, e.g. data-parallel)."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("levels:\n  - {name: node, size: 2, bandwidth: 10GB/s, latency: 50us}\n")
    plan_path = tmp_path / "gpt.json"
    profile = str(REPO / "profiles" / "gpt.json")
    made = invoke("partition", profile, "--cluster", cluster, "--memory", "8GB", "--straight",
                  "--schedule", "interleaved-1f1b", "--microbatches", "8", "-o", plan_path)
    assert made.exit_code == 0, made.output
    result = invoke("export", plan_path, "--to", "deepspeed")
    assert_one_line_error(result, "has no schedule for", f"`planner partition {profile} --cluster {cluster} "
                          "--memory 8GB --schedule 1f1b --microbatches 8 --straight`")


def test_counts_read_in_the_singular_where_there_is_one() -> None:
    plan = straight_plan("mlp", 2)
    assert "2 stages (1 per rank) x 1 pipeline = 2 processes;" in pippy_export(plan).snippet()
    text = deepspeed_export(plan, profile_of("mlp"), "p.json").instructions()
    assert "2 stages x 1 data-parallel replica = 2 processes." in text and "replica(s)" not in text
