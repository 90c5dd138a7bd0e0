"""A plan's stages under torch.distributed.pipelining: this rank's PipelineStage, its schedule, and gradient sync.

`build(model, plan, example_microbatch)` splits the model with `runtime.stages.build_stages`
(nn.Sequential slices, torch.fx, or torch.export at the example microbatch for models torch.fx
cannot trace: not torch.distributed.pipelining's own `pipeline()`, which fails on models whose
export lifts buffers and constants, such as Llama's rotary tables), wraps this rank's stage in a manual
`torch.distributed.pipelining.PipelineStage` and makes the plan's schedule class
(`planner.files.export.PIPPY_SCHEDULE_CLASSES`; zb-h1 runs as `ScheduleInterleavedZeroBubble` on one
stage per rank, interleaved-1f1b as `ScheduleInterleaved1F1B` and zbv as `ScheduleZBVZeroBubble` on the
rank's chunks). The plan must be exportable (`planner.files.export.data_parallel_degree`): gpipe, 1f1b,
zb-h1, interleaved-1f1b or zbv, every stage on R ranks. Pipeline k is
`[stage.ranks[k] for stage in plan.stages]`; it runs `plan.microbatches / R` microbatches of its
share of each mini-batch (`PippyPipeline.shard`). pipelining takes a stage's output only as a tensor
or a tuple of tensors: a last stage returning another structure (a transformers `ModelOutput`) returns
its tensors, and the loss function gets the structure rebuilt (`_TensorOutputs`).

torch.distributed.pipelining neither sums the gradients of a parameter used by several stages
(gpt's tied `transformer.wte.weight` / `lm_head.weight`) nor all-reduces the pipelines'
gradients: call `finish_gradients()` after `schedule.step(...)` and before `optimizer.step()`.
On every rank, once:

    built = build(model, plan, example_microbatch)
    parameters = {id(p): p for stage in built.stages for p in stage.submod.parameters()}  # once each: zbv's
    optimizer = torch.optim.SGD(list(parameters.values()), lr=...)  # rank 0 holds gpt's tie in two stages

then per mini-batch (the whole one, the same on every rank):

    built.forward_backward(inputs, target)  # this pipeline's share through schedule.step, then
    optimizer.step(); optimizer.zero_grad()  # finish_gradients

(`forward_backward` feeds the inputs where a rank holds the first stage and the target where it holds
the last, which under zbv is rank 0 for both.)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils import _pytree as pytree

from planner.files.export import PIPPY_MULTI_STAGE_CLASSES, ExportError, pippy_export
from planner.profiling.model_file import LossFn, default_loss
from planner.files.plan import Plan
from planner.units import plural
from runtime.engine import init_distributed
from runtime.gradients import GradientGroups, all_reduce_gradients, comm_device, make_rank_gradient_groups
from runtime.nested import map_tensors, split_batch
from runtime.pipeline import PipelineError
from runtime.stages import Stages, build_stages, describe_boundaries, stage_args

__all__ = ["PippyError", "PippyPipeline", "build"]

_SCHEDULES: dict[str, Any] = {"ScheduleGPipe": ScheduleGPipe, "Schedule1F1B": Schedule1F1B}


class PippyError(PipelineError):
    """The plan cannot run under torch.distributed.pipelining in this job (world size, boundaries, plan)."""


class PippyPipeline:
    """This rank's part of the plan under torch.distributed.pipelining; unpacks as `stage, schedule = built`.

    `stages`: this rank's PipelineStages (one; under a chunked schedule the plan's chunks, lowest first);
    `stage`: the first of them (its module: `stage.submod`); `schedule`: the plan's schedule class on
    them; `stage_index` (of `stage`), `replica` (this rank's pipeline), `replicas` (R).
    """

    def __init__(self, stages: Sequence[PipelineStage], schedule: Any, replica: int, replicas: int,
                 gradients: GradientGroups, device: torch.device, microbatches: int) -> None:
        self.stages = list(stages)
        self.microbatches = microbatches
        self.stage = self.stages[0]
        self.schedule = schedule
        self.stage_index: int = self.stage.stage_index
        self.replica = replica
        self.replicas = replicas
        self._gradients = gradients
        self._device = device

    def __iter__(self) -> Iterator[Any]:
        """`stage, schedule = build(...)`."""
        return iter((self.stage, self.schedule))

    def shard(self, value: Any) -> Any:
        """This pipeline's share of a whole mini-batch: the `replica`-th of R slices along dim 0 of every
        tensor (`torch.tensor_split`; tuples, lists and dicts are walked). Identity when R = 1."""
        return value if self.replicas == 1 else split_batch(value, self.replicas)[self.replica]

    def finish_gradients(self) -> None:
        """Make every `.grad` the gradient of the mini-batch's mean loss, as single-device training gives.

        After `schedule.step`, this rank's gradients are summed over its pipeline's microbatches; each
        parameter is divided once by their count (the schedule is built with scale_grads=False: torch
        divides per stage, so a parameter two stages of one rank share, as zbv's first and last stages
        share gpt's tied embedding, would be divided twice), which makes them the mean loss of the
        pipeline's share. A parameter several stages use (tied):
        its gradient is summed over every rank of those stages (all pipelines), divided by R; any
        other parameter: summed over this stage's R replicas, divided by R. With equal shares
        and equal microbatches, mean of R pipeline means = the mini-batch mean. Every rank must
        call it (collectives); a parameter without a gradient takes part with zeros.
        """
        unique = {id(p): p for stage in self.stages for p in stage.submod.parameters() if p.grad is not None}
        for parameter in unique.values():
            parameter.grad.div_(self.microbatches)
        for parameter, group in self._gradients.tied:
            all_reduce_gradients([parameter], group, self._device, divide_by=self.replicas)
        if self.replicas > 1:
            all_reduce_gradients(self._gradients.replicated, self._gradients.replica_group, self._device,
                                 divide_by=self.replicas)

    def forward_backward(self, inputs: Any, target: Any) -> float | None:
        """One whole mini-batch (the same on every rank): this pipeline's share through `schedule.step`
        as this stage's role requires, then `finish_gradients`. Returns the mini-batch's mean loss
        (the mean of every microbatch loss of every pipeline) on the last stage's ranks, else None.
        The optimizer step is the caller's."""
        losses: list[torch.Tensor] = []
        share = self.shard(inputs)
        first, last = any(stage.is_first for stage in self.stages), any(stage.is_last for stage in self.stages)
        args = (tuple(share) if isinstance(share, (tuple, list)) else (share,)) if first else ()
        kwargs = {"target": self.shard(target), "losses": losses} if last else {}
        # return_outputs=False: the last stage would otherwise keep every microbatch's output (gpt's logits, 16.8 MB a
        # microbatch) to hand back merged, which this method does not return
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.finish_gradients()
        if not last:
            return None
        mean = torch.stack([loss.detach().float() for loss in losses]).mean().reshape(1)
        if self.replicas > 1:
            mean = mean.to(comm_device(self._device))
            dist.all_reduce(mean, group=self._gradients.replica_group)
            mean /= self.replicas
        return float(mean.item())



def build(model: nn.Module, plan: Plan, example_microbatch: Any, *, loss_fn: LossFn | None = None,
          device: torch.device | str | None = None) -> PippyPipeline:
    """This rank's PipelineStage and schedule for `plan`'s stages of `model`; see the module docstring.

    Every rank calls it with the whole model (same weights) after `torch.distributed` is
    initialized with one process per rank of the plan; it creates process groups (the same on
    every rank). `example_microbatch`: the inputs of one microbatch (a tensor or a tuple of
    arguments): the split model runs once on it (no grad, eval mode, RNG state kept) to check
    that only tensors cross stage boundaries, as pipelining sends only tensors; None skips the
    check, and each stage's inputs and output on it are given to PipelineStage (`_stage_examples`):
    torch's own inference runs stages on uninitialised tensors, which crashes a stage that starts
    at an embedding of positions or tokens (gpt on 4 ranks x 2 chunks). Exported stages, and
    `example_microbatch=None`, leave the shapes to that inference, from the first step's first
    microbatch. Either way every microbatch must have one shape (mini-batch = a multiple of R x
    n_microbatches). `loss_fn(output, target)`: a
    mean over the microbatch (default `planner.profiling.model_file.default_loss`); the schedule has
    scale_grads=False and `finish_gradients` divides each parameter's gradient by n_microbatches once.
    `device`: default `runtime.engine.init_distributed`'s (this rank's GPU under NCCL, else CPU). Raises
    PippyError if the job does not match the plan, ExportError if the plan cannot run here.
    """
    if not dist.is_initialized():
        raise PippyError("torch.distributed is not initialized: call runtime.engine.init_distributed() first, "
                         "in a process started by torchrun")
    try:
        settings = pippy_export(plan)
    except ExportError as exc:
        raise PippyError(f"this plan cannot run on torch.distributed.pipelining: {exc.problem}; {exc.fix}") from None
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != settings.world_size:
        chunks = f", {settings.chunks} per rank," if settings.chunks > 1 else ""
        raise PippyError(f"the plan has {plural(settings.world_size, 'rank')} ({plural(settings.num_stages, 'stage')}"
                         f"{chunks} x {plural(settings.replicas, 'replica')}) but the job has "
                         f"{plural(world, 'process', 'processes')}: launch with torchrun --nproc-per-node "
                         f"{settings.world_size} (or make a plan for {plural(world, 'GPU')})")
    stages = build_stages(model, plan, example_microbatch)
    examples = None
    if example_microbatch is not None:
        _check_boundaries(stages, example_microbatch)
        examples = _stage_examples(stages, example_microbatch)
    replica = next(k for k, ranks in enumerate(settings.ranks) if rank in ranks)
    mine = [s for s, r in enumerate(settings.ranks[replica]) if r == rank]  # one stage, or the plan's chunks
    pipeline_groups = _pipeline_groups(settings.ranks)
    chosen = torch.device(device) if device is not None else init_distributed()[2]
    modules = {index: stages[index].to(chosen) for index in mine}
    group = pipeline_groups[replica]
    # stage s of this pipeline lives on its group's rank of settings.ranks[replica][s] (new_group sorts ranks)
    group_ranks = {s: (r if group is None else dist.get_group_rank(group, r))
                   for s, r in enumerate(settings.ranks[replica])}
    last = settings.num_stages - 1
    outputs_of_last = _TensorOutputs(modules[last]) if last in mine else None
    built = []
    for index in mine:
        inputs, outputs = examples[index] if examples is not None else (None, None)
        if index == last and outputs is not None:
            outputs = _TensorOutputs.flat(outputs)[0]
        module = outputs_of_last if index == last else modules[index]
        stage = PipelineStage(module, index, settings.num_stages, chosen, input_args=inputs, output_args=outputs,
                              group=group)
        stage.stage_index_to_group_rank = group_ranks
        built.append(stage)
    # zb-h1 is the zero-bubble class on one stage per rank (its B and W apart, as the plan's schedule);
    # interleaved-1f1b the interleaved class on the rank's chunks
    stages_arg = built if settings.schedule_class in PIPPY_MULTI_STAGE_CLASSES else built[0]
    loss = loss_fn or default_loss
    if outputs_of_last is not None:
        loss = outputs_of_last.loss(loss)
    schedule = _schedule_class(settings.schedule_class)(stages_arg, n_microbatches=settings.n_microbatches,
                                                        loss_fn=loss, scale_grads=False)
    gradients = make_rank_gradient_groups(settings.stage_ranks, stages.shared, modules)
    return PippyPipeline(built, schedule, replica, settings.replicas, gradients, chosen, settings.n_microbatches)


class _TensorOutputs(nn.Module):
    """The last stage as torch.distributed.pipelining takes it: returning a tensor or a tuple of tensors.

    An output of another structure (a transformers `ModelOutput`, a dict, nested tuples) is returned as the tuple of
    its tensors (`torch.utils._pytree` leaves) and rebuilt for the loss (`loss`), so the loss function gets what
    the model returns. Its parameters are the stage's own (`stage`), under names prefixed with `stage.`.
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.spec: pytree.TreeSpec | None = None  # of the latest output that was flattened

    @staticmethod
    def flat(output: Any) -> tuple[Any, pytree.TreeSpec | None]:
        """`output` itself and None where pipelining takes it as it is, else (its leaves as a tuple, its structure)."""
        if isinstance(output, torch.Tensor) or (type(output) in (tuple, list)
                                                and all(isinstance(value, torch.Tensor) for value in output)):
            return output, None
        leaves, spec = pytree.tree_flatten(output)
        return tuple(leaves), spec

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output, self.spec = self.flat(self.stage(*args, **kwargs))
        return output

    def loss(self, loss_fn: LossFn) -> LossFn:
        """`loss_fn` of the stage's output as the stage returned it, rebuilt from the leaves `forward` gave."""
        def rebuilt(output: Any, target: Any) -> torch.Tensor:
            if self.spec is not None:  # a tensor where torch unpacked a tuple of one (its shape inference does)
                output = pytree.tree_unflatten([output] if isinstance(output, torch.Tensor) else list(output), self.spec)
            return loss_fn(output, target)
        return rebuilt


def _schedule_class(name: str) -> Any:
    """torch.distributed.pipelining's schedule class `name`; PippyError naming the torch version where this torch
    lacks it (the zero-bubble classes came after the gpipe and 1F1B ones)."""
    import torch.distributed.pipelining as pipelining

    found = _SCHEDULES.get(name) or getattr(pipelining, name, None)
    if found is None:
        raise PippyError(f"torch {torch.__version__} has no torch.distributed.pipelining.{name}: upgrade torch, or run "
                         "this plan with runtime.engine.Engine")
    return found


def _pipeline_groups(pipelines: Sequence[Sequence[int]]) -> list[Any]:
    """One process group per pipeline, created in the same order on every rank (the gradient groups come
    next: `make_gradient_groups`); a single pipeline uses the default group (None)."""
    if len(pipelines) == 1:
        return [None]
    return [dist.new_group(sorted(ranks)) for ranks in pipelines]


def _check_boundaries(stages: Stages, example_microbatch: Any) -> None:
    """PippyError naming the first value crossing a stage boundary that is not a tensor."""
    first = next(iter(stages[0].parameters()), None)
    where = first.device if first is not None else torch.device("cpu")
    args = example_microbatch if isinstance(example_microbatch, tuple) else (example_microbatch,)
    args = map_tensors(lambda tensor: tensor.to(where), args)
    with _evaluating(stages), torch.random.fork_rng(devices=[where] if where.type == "cuda" else []):
        boundaries = describe_boundaries(stages, *args)
    for index, values in enumerate(boundaries):
        for value in values:
            if value.kind != "tensor":
                raise PippyError(
                    f"the value {value.name!r} ({value.kind}) crosses the boundary between stages {index} and "
                    f"{index + 1}, but torch.distributed.pipelining sends only tensors: split elsewhere "
                    "(re-plan) or run the plan with runtime.engine.Engine, which sends any value", index)


def _stage_examples(stages: Stages, example_microbatch: Any) -> list[tuple[Any, Any]] | None:
    """Each stage's input arguments and output on one microbatch (eval mode, no grad, RNG state kept; floating
    point ones marked as needing gradients but the model's inputs), for torch's static stage metadata: its
    dynamic inference runs a stage on uninitialised tensors, which as token or position indices crash an
    embedding (a plan that starts a stage at gpt's position embedding). None for exported stages, which
    are not run here (`describe_boundaries`)."""
    if stages.method == "export":
        return None
    first = next(iter(stages[0].parameters()), None)
    where = first.device if first is not None else torch.device("cpu")
    args = example_microbatch if isinstance(example_microbatch, tuple) else (example_microbatch,)
    value: Any = tuple(map_tensors(lambda tensor: tensor.to(where), args))
    found = []
    with _evaluating(stages), torch.random.fork_rng(devices=[where] if where.type == "cuda" else []), \
            torch.no_grad():
        for index, stage in enumerate(stages):
            inputs = value if index == 0 else tuple(map_tensors(_example, value))
            output = stage(*value)
            value = stage_args(stage, output)
            found.append((inputs, tuple(map_tensors(_example, value)) if isinstance(value, tuple) else
                          _example(value)))
    return found


def _example(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of a boundary value, needing gradients if it is floating point."""
    copy = tensor.detach().clone()
    return copy.requires_grad_(copy.is_floating_point())


@contextmanager
def _evaluating(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every module in eval mode (no dropout, no batch-norm statistics updates), restored afterwards."""
    flags = [(module, module.training) for stage in modules for module in stage.modules()]
    try:
        for stage in modules:
            stage.eval()
        yield
    finally:
        for module, training in flags:
            module.training = training
