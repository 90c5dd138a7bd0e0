"""Exports of a plan to other pipeline runtimes: torch.distributed.pipelining ("pippy") and DeepSpeed.

Both take only synchronous plans (gpipe, 1f1b, zb-h1, and for pippy interleaved-1f1b and zbv; DeepSpeed
runs zb-h1 as its 1F1B) whose stages all have the same number of replicas R: torch.distributed.pipelining
runs on a pipeline x data-parallel mesh of S stages by R pipelines, DeepSpeed takes the data-parallel
degree as world size / S. A plan's mini-batch is `microbatches` microbatches, microbatch i on replica i mod R, so each of the R pipelines runs
microbatches / R of them per step (which must be whole).

- pippy: `split_spec` ({first layer of every stage but the first: "SplitPoint.BEGINNING"}),
  `schedule_class`, `n_microbatches` (per pipeline), `num_stages`, `replicas`, `ranks` (per
  pipeline, stage by stage), and a Python file for the user's training script
  (`PippyExport.snippet`).
- deepspeed: `parts` (PipelineModule's partition list: stage s runs layers[parts[s]:parts[s+1]]
  of the flat layer list, the profile's layers in order), `num_stages`, the layer names per
  stage, the batch settings of the DeepSpeed config, and instructions
  (`DeepSpeedExport.instructions`) that build the module with `runtime.deepspeed.pipeline_module`
  (one PipelineModule layer per stage, so DeepSpeed's `uniform` partition is the plan's).

Pure: no torch.distributed; `write_export` writes the JSON and the text file.

Why one module of ~460 lines: both exports check the plan the same way (synchronous schedule, equal
replicas) and write the same pair of files (a JSON spec and a Python file or instructions); the
generated Python and instructions are a third of the length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from planner.errors import FileProblemError, PlannerError
from planner.files.fileformat import write_atomically, write_versioned_json
from planner.files.plan import Plan, replan_command
from planner.files.profile import Profile
from planner.schedules.schedule import CHUNKED_SCHEDULES
from planner.units import name_range, plural

__all__ = [
    "TARGETS", "PIPPY_SCHEDULE_CLASSES", "ExportError", "PippyExport", "DeepSpeedExport", "Export",
    "data_parallel_degree", "pippy_export", "deepspeed_export", "export_plan", "export_paths", "write_export",
]

TARGETS = ("pippy", "deepspeed")
PIPPY_SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble",
                          "interleaved-1f1b": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble"}
# take a list of this rank's stages (one for zb-h1, the plan's chunks for interleaved-1f1b and zbv)
PIPPY_MULTI_STAGE_CLASSES = ("ScheduleInterleavedZeroBubble", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble")
PIPPY_FORMAT = "pipeline-planner/pippy-export"
DEEPSPEED_FORMAT = "pipeline-planner/deepspeed-export"
EXPORT_VERSION = 1
_TARGET_NAMES = {"pippy": "torch.distributed.pipelining", "deepspeed": "DeepSpeed's PipelineModule"}


class ExportError(FileProblemError):
    """A plan that the chosen runtime cannot run as planned; names the plan file, the values and the fix."""


@dataclass(frozen=True)
class PippyExport:
    """A plan as torch.distributed.pipelining settings; see the module docstring.

    `ranks[k]`: the ranks of pipeline k (data-parallel replica k), stage by stage;
    `stage_ranks[s]`: the ranks of stage s, pipeline by pipeline. `n_microbatches` is per
    pipeline and step: `microbatches_per_step / replicas`. `chunks`: stages per rank (interleaved-1f1b:
    stage s on rank s mod (num_stages / chunks), as torch's ScheduleInterleaved1F1B places them; zbv: 2 in
    a V, rank r holding stages r and 2p - 1 - r, as ScheduleZBVZeroBubble places them).
    """

    plan_path: str
    model_name: str
    split_spec: dict[str, str]
    schedule_class: str
    n_microbatches: int
    microbatches_per_step: int
    microbatch_size: int | None
    num_stages: int
    replicas: int
    ranks: tuple[tuple[int, ...], ...]
    stage_ranks: tuple[tuple[int, ...], ...]
    first_layers: tuple[str, ...]
    last_layers: tuple[str, ...]
    recompute: tuple[bool, ...]
    chunks: int = 1

    target: ClassVar[str] = "pippy"
    file_format: ClassVar[str] = PIPPY_FORMAT
    text_suffix: ClassVar[str] = ".py"

    @property
    def world_size(self) -> int:
        """Processes the job needs: num_stages / chunks x replicas."""
        return self.num_stages // self.chunks * self.replicas

    def to_dict(self) -> dict[str, Any]:
        """The JSON body written by `write_export`."""
        return {
            "target": self.target, "plan": self.plan_path, "model": self.model_name,
            "split_spec": dict(self.split_spec), "schedule_class": self.schedule_class,
            "n_microbatches": self.n_microbatches, "microbatches_per_step": self.microbatches_per_step,
            "microbatch_size": self.microbatch_size, "num_stages": self.num_stages, "replicas": self.replicas,
            "world_size": self.world_size, "chunks": self.chunks, "ranks": [list(group) for group in self.ranks],
            "stage_ranks": [list(group) for group in self.stage_ranks],
            "stages": [{"first_layer": first, "last_layer": last, "recompute": recompute}
                       for first, last, recompute in zip(self.first_layers, self.last_layers, self.recompute)],
        }

    def text(self) -> str:
        """The Python snippet (`snippet`)."""
        return self.snippet()

    def snippet(self) -> str:
        """A Python file to paste into a training script: the tracer route and the runtime.pippy route."""
        spec = ", ".join(f"{name!r}: SplitPoint.BEGINNING" for name in self.split_spec)
        pipelines = repr([list(group) for group in self.ranks])
        recomputed = [index for index, flag in enumerate(self.recompute) if flag]
        recompute_note = (
            f"# The plan recomputes activations on stage(s) {recomputed}: pipelining does not; wrap those stages'\n"
            "# layers in torch.utils.checkpoint yourself, or expect more activation memory than planned.\n"
            if recomputed else "")
        stages_arg = "stages" if self.schedule_class in PIPPY_MULTI_STAGE_CLASSES else "stages[0]"
        return f'''"""torch.distributed.pipelining set-up for plan {self.plan_path} (model {self.model_name}).

{plural(self.num_stages, "stage")} ({self.chunks} per rank) x {plural(self.replicas, "pipeline")} = {plural(self.world_size, "process", "processes")}; {self.schedule_class} with
{self.n_microbatches} microbatches per pipeline and step (the plan's {self.microbatches_per_step} over {self.replicas}).
Launch: torchrun --nproc-per-node {self.world_size} train.py

Every rank builds the whole model (same seed) and reads the same mini-batch; pipeline k takes
the k-th of {self.replicas} equal slices of it (dim 0), and splits that into microbatches.
Route A, `traced_route`: torch.distributed.pipelining.pipeline() traces the model with torch.export
  and splits it at SPLIT_SPEC; you then all-reduce tied weights' and replicas' gradients yourself.
  torch.export does not trace every model (data-dependent control flow; a user's transformers Qwen2 model
  file failed inside it); where pipeline() raises, use Route B, which trained that model.
Route B, `planner_route`: runtime.pippy.build() splits with this project's runtime.stages
  (torch.fx: also models torch.export cannot trace) and its finish_gradients() sums tied
  weights' gradients over their stages and averages the pipelines' gradients.
"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining import {self.schedule_class}, SplitPoint, pipeline

PLAN = {self.plan_path!r}
SPLIT_SPEC = {{{spec}}}
NUM_STAGES = {self.num_stages}
PIPELINES = {pipelines}  # ranks of pipeline k (data-parallel replica k), stage by stage
N_MICROBATCHES = {self.n_microbatches}  # per pipeline and step
{recompute_note}

def this_pipeline() -> int:
    """The pipeline (data-parallel replica) this rank belongs to."""
    return next(k for k, ranks in enumerate(PIPELINES) if dist.get_rank() in ranks)


def pipeline_share(batch: torch.Tensor) -> torch.Tensor:
    """This pipeline's slice of the whole mini-batch (dim 0); keep the batch a multiple of
    len(PIPELINES) * N_MICROBATCHES so every microbatch has the same size."""
    return batch.tensor_split(len(PIPELINES))[this_pipeline()]


def traced_route(model, example_microbatch, loss_fn, device):
    """Route A: (stages, schedule) of this rank from pipeline(), stages the list of this rank's stages (one, or
    its chunks); call on every rank (it creates groups)."""
    groups = [dist.new_group(sorted(set(ranks))) for ranks in PIPELINES]  # every rank creates every group, in order
    replica = this_pipeline()
    mine = [s for s, rank in enumerate(PIPELINES[replica]) if rank == dist.get_rank()]  # this rank's stages
    pipe = pipeline(model, mb_args=(example_microbatch,), split_spec=SPLIT_SPEC)
    stages = [pipe.build_stage(s, device, group=groups[replica] if len(PIPELINES) > 1 else None) for s in mine]
    # scale_grads=True (the default) divides gradients by N_MICROBATCHES: the mean loss of the pipeline's share
    return stages, {self.schedule_class}({stages_arg}, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)


def planner_route(model, example_microbatch, loss_fn, device):
    """Route B: runtime.pippy.build; unpacks as (stage, schedule) and has finish_gradients()."""
    from planner.files.plan import load_plan
    from runtime.pippy import build

    return build(model, load_plan(PLAN), example_microbatch, loss_fn=loss_fn, device=device)


def run_schedule(stages, schedule, inputs, target):
    """One step of this pipeline's share: the rank of the first stage feeds inputs, that of the last the target;
    returns its losses."""
    losses = []
    args = (inputs,) if any(stage.is_first for stage in stages) else ()
    kwargs = {{"target": target, "losses": losses}} if any(stage.is_last for stage in stages) else {{}}
    schedule.step(*args, **kwargs)
    return losses


# In the training script (every rank):
#   dist.init_process_group()                          # torchrun sets the environment
#   model = build_model()                              # the same seed on every rank (inputs by name: the model of
#                                                      #   planner.profiling.model_file.load_model_file(PATH).build_model()
#                                                      #   takes them by position, in example_batch's dict order)
#   example = pipeline_share(first_inputs).tensor_split(N_MICROBATCHES)[0]   # the inputs of one microbatch
#   built = planner_route(model, example, loss_fn, device)                     # or: traced_route(...)
#   stages, schedule = built.stages, built.schedule    # route A: stages, schedule = traced_route(...)
#   optimizer = torch.optim.AdamW(list({{id(p): p for stage in stages for p in stage.submod.parameters()}}.values()))
#   for inputs, target in batches:                     # the whole mini-batch, the same on every rank
#       losses = run_schedule(stages, schedule, pipeline_share(inputs), pipeline_share(target))
#       built.finish_gradients()                       # route A: all-reduce tied and replicated gradients yourself
#       optimizer.step()
#       optimizer.zero_grad()
'''


@dataclass(frozen=True)
class DeepSpeedExport:
    """A plan as DeepSpeed PipelineModule settings; see the module docstring.

    `parts`: stage s runs layers[parts[s]:parts[s + 1]] (the last entry is the layer count);
    `stage_layers[s]`: the names of those layers; `tied[i]`: (parameter names, layer indices,
    stages) of a parameter several layers use; `config`: the batch settings for the DeepSpeed
    config (None where the plan does not know the microbatch size).
    """

    plan_path: str
    model_name: str
    schedule: str
    parts: tuple[int, ...]
    num_stages: int
    data_parallel: int
    stage_layers: tuple[tuple[str, ...], ...]
    stage_ranks: tuple[tuple[int, ...], ...]
    recompute: tuple[bool, ...]
    tied: tuple[tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]], ...]
    train_micro_batch_size_per_gpu: int | None
    gradient_accumulation_steps: int

    target: ClassVar[str] = "deepspeed"
    file_format: ClassVar[str] = DEEPSPEED_FORMAT
    text_suffix: ClassVar[str] = ".txt"

    @property
    def world_size(self) -> int:
        """Processes the job needs: num_stages x data_parallel."""
        return self.num_stages * self.data_parallel

    @property
    def train_batch_size(self) -> int | None:
        """DeepSpeed's train_batch_size = micro batch x gradient accumulation steps x data-parallel degree."""
        if self.train_micro_batch_size_per_gpu is None:
            return None
        return self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * self.data_parallel

    def config(self) -> dict[str, int | None]:
        """The batch settings of the DeepSpeed config."""
        return {"train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "train_batch_size": self.train_batch_size}

    def deepspeed_stage_ranks(self) -> tuple[tuple[int, ...], ...]:
        """Where DeepSpeed puts the stages: PipeDataParallelTopology (axes pipe, data, row-major) gives
        stage s the ranks s * D .. s * D + D - 1, D = data_parallel."""
        return tuple(tuple(range(s * self.data_parallel, (s + 1) * self.data_parallel))
                     for s in range(self.num_stages))

    def to_dict(self) -> dict[str, Any]:
        """The JSON body written by `write_export`."""
        return {
            "target": self.target, "plan": self.plan_path, "model": self.model_name,
            "parts": list(self.parts), "num_stages": self.num_stages, "data_parallel": self.data_parallel,
            "world_size": self.world_size, "stage_layers": [list(names) for names in self.stage_layers],
            "stage_ranks": [list(group) for group in self.stage_ranks], "recompute": list(self.recompute),
            "tied": [{"names": list(names), "layers": list(layers), "stages": list(stages)}
                     for names, layers, stages in self.tied],
            "config": self.config(),
        }

    def text(self) -> str:
        """The instructions (`instructions`)."""
        return self.instructions()

    def instructions(self) -> str:
        """How to impose this partition on DeepSpeed's PipelineModule, step by step."""
        parts = list(self.parts)
        lines = [
            (f"DeepSpeed pipeline partition for plan {self.plan_path} (model {self.model_name}): {self.num_stages} "
             f"stages x {plural(self.data_parallel, 'data-parallel replica')} = "
             f"{plural(self.world_size, 'process', 'processes')}."),
            "",
            f"parts = {parts}   # stage s runs layers[parts[s]:parts[s + 1]]",
        ]
        for stage, names in enumerate(self.stage_layers):
            lines.append(f"  stage {stage}: layers {parts[stage]}..{parts[stage + 1] - 1} "
                         f"({name_range(names[0], names[-1])}, {plural(len(names), 'layer')})")
        lines += [
            "",
            "1. The module. runtime.deepspeed.pipeline_module builds DeepSpeed's PipelineModule on these",
            "   boundaries: it splits the model as this project's runtime does (nn.Sequential slices, torch.fx,",
            "   or torch.export for models fx cannot trace, e.g. transformers models) and gives DeepSpeed one",
            "   layer per stage with partition_method='uniform', so DeepSpeed's partition is the plan's. On every",
            "   rank, after deepspeed.init_distributed():",
            "",
            "       import deepspeed",
            "       from planner.files.plan import load_plan",
            "       from runtime.deepspeed import deepspeed_config, pipeline_module",
            "",
            f"       plan = load_plan({self.plan_path!r})",
            "       module = pipeline_module(model, plan, loss_fn=loss_fn, example_inputs=example_microbatch)",
            "       engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),",
            "                                         config={**deepspeed_config(plan), \"optimizer\": ...})",
            "       loss = engine.train_batch(data_iter)   # yields (inputs, target) microbatches",
            "",
            "   example_microbatch: the inputs of one microbatch, at the shapes you train with.",
            "",
            "2. The layer list, for a hand-written PipelineModule instead (stage s runs layers[parts[s]:parts[s+1]];",
            "   PipelineModule's partition_method cannot take given boundaries):",
        ]
        index = 0
        for names in self.stage_layers:
            for name in names:
                lines.append(f"     {index:3d}  {name}")
                index += 1
        lines.append("")
        lines += self._tied_lines()
        config = ", ".join(f'"{key}": {"null" if value is None else value}' for key, value in self.config().items())
        lines += [
            "4. The DeepSpeed config (deepspeed_config(plan) gives it, with gradient_clipping 0.0: DeepSpeed",
            "   clips at norm 1.0 by default, which the plan's training does not): {" + config + "}",
            "   gradient_accumulation_steps is the number of microbatches each pipeline runs per train_batch();",
            f"   the data-parallel degree is world size / num_stages = {self.data_parallel}; train_batch_size =",
            "   micro batch x gradient_accumulation_steps x data-parallel degree.",
        ]
        if self.train_micro_batch_size_per_gpu is None:
            lines.append("   The plan does not know its microbatch size: set train_micro_batch_size_per_gpu yourself.")
        lines.append(f"   Launch {plural(self.world_size, 'process', 'processes')} (deepspeed --num_gpus {self.world_size} train.py, "
                     "or torchrun).")
        if self.stage_ranks != self.deepspeed_stage_ranks():
            placed = [list(group) for group in self.deepspeed_stage_ranks()]
            planned = [list(group) for group in self.stage_ranks]
            lines.append(f"   DeepSpeed places stage s on ranks s*{self.data_parallel} .. s*{self.data_parallel}+"
                         f"{self.data_parallel - 1} ({placed}), not the plan's {planned}: the plan's placement "
                         "on the cluster is not kept.")
        lines += [
            "",
            "5. Schedule and recomputation. DeepSpeed's pipeline engine runs its own synchronous 1F1B-style",
            "   schedule (TrainSchedule)"
            + ("; the plan assumed gpipe, whose bubble is the same." if self.schedule == "gpipe" else
               "; the plan assumed zb-h1, whose deferred weight gradients DeepSpeed does not run: expect 1F1B's\n"
               "   bubble (`planner partition ... --schedule 1f1b` predicts it)." if self.schedule == "zb-h1" else "."),
        ]
        recomputed = [stage for stage, flag in enumerate(self.recompute) if flag]
        if recomputed:
            lines += [
                f"   The plan recomputes activations on stage(s) {recomputed}. DeepSpeed has one setting for all",
                "   stages, PipelineModule(activation_checkpoint_interval=N): N > 0 checkpoints every N layers on",
                "   every stage (more recomputation than planned elsewhere); 0 (the default) recomputes nothing",
                "   (more activation memory than planned on those stages).",
            ]
        else:
            lines.append("   The plan recomputes nothing: keep activation_checkpoint_interval=0 (the default).")
        return "\n".join(lines) + "\n"

    def _tied_lines(self) -> list[str]:
        """Step 3: tied weights."""
        if not self.tied:
            return ["3. Tied weights: the profile lists none.", ""]
        lines = ["3. Tied weights. pipeline_module sums these across the stages using them (DeepSpeed itself does",
                 "   only for TiedLayerSpec layers with one common key; a hand-written module needs those):"]
        for names, layers, stages in self.tied:
            lines.append(f"   {' = '.join(names)}: layers {list(layers)}, stages {list(stages)}")
        lines.append("")
        return lines


Export = PippyExport | DeepSpeedExport


def data_parallel_degree(plan: Plan, target: str, source: str = "<plan>") -> int:
    """R, the replicas of every stage, after checking `plan` can run on `target` (pippy, deepspeed).

    ExportError for the asynchronous pipedream schedule, for stages with different replica
    counts, and for microbatches that do not split evenly over the R pipelines.
    """
    what = _TARGET_NAMES[target]
    if plan.schedule in CHUNKED_SCHEDULES and target != "pippy":
        raise ExportError(
            source, f"the plan runs {plan.chunks} chunks per GPU ({plan.schedule}), which {what} has no schedule for",
            f"re-plan with one stage per GPU: `{replan_command(plan, '1f1b')}`, or export it to pippy")
    if plan.schedule not in PIPPY_SCHEDULE_CLASSES:
        raise ExportError(
            source, f"the plan's schedule {plan.schedule!r} (asynchronous, with weight stashing) has no "
                    f"equivalent in {what}, which runs synchronous schedules (GPipe, 1F1B)",
            f"re-plan with a synchronous schedule: `{replan_command(plan, '1f1b')}`")
    replicas = [stage.replicas for stage in plan.stages]
    if len(set(replicas)) != 1:
        layout = ("a pipeline x data-parallel mesh: every stage on the same number of ranks" if target == "pippy"
                  else "a data-parallel degree of world size / stages for every stage")
        raise ExportError(
            source, f"its stages have {replicas} replicas, but {what} needs {layout}",
            f"re-plan with `{replan_command(plan, add=['--straight'])}` (or use replicas that are all equal), or run "
            "this plan with this project's runtime (runtime.engine.Engine.from_plan)")
    count = replicas[0]
    microbatches = plan.microbatches or 1
    if microbatches % count:
        raise ExportError(
            source, f"its {microbatches} microbatches per step do not split evenly over its {count} pipelines",
            f"re-plan with `--microbatches` a multiple of {count}")
    return count


def _whole_rounds(microbatches: int, stages: int) -> bool:
    """Whether torch's zero-bubble schedule class accepts `microbatches` on `stages` stages: they split into
    max(1, microbatches // stages) equal rounds."""
    return microbatches % max(1, microbatches // stages) == 0


def pippy_export(plan: Plan, source: str = "<plan>") -> PippyExport:
    """torch.distributed.pipelining settings for `plan` (see `PippyExport`); ExportError as `data_parallel_degree`."""
    replicas = data_parallel_degree(plan, "pippy", source)
    microbatches = plan.microbatches or 1
    per_pipeline, stages = microbatches // replicas, len(plan.stages)
    if plan.schedule == "zb-h1" and not _whole_rounds(per_pipeline, stages):
        fit = next(count for count in range(per_pipeline + 1, per_pipeline + 2 * stages + 2)
                   if _whole_rounds(count, stages))
        raise ExportError(
            source, f"torch's ScheduleInterleavedZeroBubble cuts a step into max(1, n // stages) equal rounds: "
                    f"{per_pipeline} microbatches per pipeline on {stages} stages make {per_pipeline // stages}, "
                    "which do not divide them",
            f"re-plan with --microbatches {fit * replicas}, or run this plan with runtime.engine.Engine")
    ranks = stages // plan.chunks
    if plan.schedule == "zbv" and per_pipeline < 2 * ranks - 1:
        raise ExportError(
            source, f"torch's ScheduleZBVZeroBubble runs at least 2p - 1 = {2 * ranks - 1} microbatches per pipeline "
                    f"on {ranks} ranks, and the plan has {per_pipeline}",
            f"re-plan with --microbatches {(2 * ranks - 1) * replicas} or more, or run this plan with "
            "runtime.engine.Engine")
    return PippyExport(
        plan_path=source, model_name=plan.profile.name,
        split_spec={stage.first_layer: "SplitPoint.BEGINNING" for stage in plan.stages[1:]},
        schedule_class=PIPPY_SCHEDULE_CLASSES[plan.schedule], n_microbatches=microbatches // replicas,
        microbatches_per_step=microbatches, microbatch_size=plan.microbatch_size, num_stages=len(plan.stages),
        replicas=replicas, ranks=tuple(tuple(stage.ranks[k] for stage in plan.stages) for k in range(replicas)),
        stage_ranks=tuple(stage.ranks for stage in plan.stages),
        first_layers=tuple(stage.first_layer for stage in plan.stages),
        last_layers=tuple(stage.last_layer for stage in plan.stages),
        recompute=tuple(stage.recompute for stage in plan.stages), chunks=plan.chunks,
    )


def deepspeed_export(plan: Plan, profile: Profile, source: str = "<plan>") -> DeepSpeedExport:
    """DeepSpeed PipelineModule settings for `plan` of `profile` (see `DeepSpeedExport`).

    parts = [stage.start for each stage] + [number of layers]. ExportError as
    `data_parallel_degree`, or if the profile's layers are not the plan's.
    """
    replicas = data_parallel_degree(plan, "deepspeed", source)
    names = [layer.name for layer in profile.layers]
    for index, stage in enumerate(plan.stages):
        inside = stage.stop <= len(names)
        if not inside or names[stage.start] != stage.first_layer or names[stage.stop - 1] != stage.last_layer:
            raise ExportError(source, f"stage {index} ({name_range(stage.first_layer, stage.last_layer)}, layers "
                                      f"[{stage.start}, {stage.stop})) is not in the profile of {profile.model_name}",
                              "give the profile the plan was made from (--profile)")
    if plan.stages[-1].stop != len(names):
        raise ExportError(source, f"the plan covers {plan.stages[-1].stop} layers, the profile has {len(names)}",
                          "give the profile the plan was made from (--profile)")
    stage_of = {layer: s for s, stage in enumerate(plan.stages) for layer in range(stage.start, stage.stop)}
    tied = tuple((shared.names, shared.layers, tuple(sorted({stage_of[layer] for layer in shared.layers})))
                 for shared in profile.shared_params)
    return DeepSpeedExport(
        plan_path=source, model_name=plan.profile.name, schedule=plan.schedule,
        parts=tuple(stage.start for stage in plan.stages) + (plan.stages[-1].stop,),
        num_stages=len(plan.stages), data_parallel=replicas,
        stage_layers=tuple(tuple(names[stage.start:stage.stop]) for stage in plan.stages),
        stage_ranks=tuple(stage.ranks for stage in plan.stages),
        recompute=tuple(stage.recompute for stage in plan.stages), tied=tied,
        train_micro_batch_size_per_gpu=plan.microbatch_size,
        gradient_accumulation_steps=(plan.microbatches or 1) // replicas,
    )


def export_plan(plan: Plan, target: str, profile: Profile | None = None, source: str = "<plan>") -> Export:
    """The export of `plan` to `target` ("pippy" or "deepspeed"; deepspeed needs the plan's profile)."""
    if target == "pippy":
        return pippy_export(plan, source)
    if target == "deepspeed":
        if profile is None:
            raise PlannerError("the deepspeed export needs the plan's profile (its layer names)")
        return deepspeed_export(plan, profile, source)
    raise PlannerError(f"unknown export target {target!r}; use one of {', '.join(TARGETS)}")


def export_paths(plan_path: str | Path, target: str, out: str | Path | None = None) -> tuple[Path, Path]:
    """(JSON file, text file) of an export: `out` or `<plan stem>.<target>.json` next to the plan, and the
    text next to it with the suffix .py (pippy) or .txt (deepspeed)."""
    text_suffix = ".py" if target == "pippy" else ".txt"
    plan_path = Path(plan_path)
    json_path = Path(out) if out is not None else plan_path.with_name(f"{plan_path.stem}.{target}.json")
    text_path = json_path.with_suffix(text_suffix)
    if text_path == json_path:
        raise FileProblemError(str(json_path), f"the export's JSON file would overwrite its {text_suffix} file",
                               "give --out a name ending in .json")
    return json_path, text_path


def write_export(export: Export, json_path: str | Path, text_path: str | Path) -> tuple[Path, Path]:
    """Write the export's JSON (versioned header) and its text (snippet or instructions) atomically."""
    written_json = write_versioned_json(json_path, export.file_format, EXPORT_VERSION, export.to_dict())
    content = export.text().encode("utf-8")
    written_text = write_atomically(text_path, lambda handle: handle.write(content))
    return written_json, written_text
