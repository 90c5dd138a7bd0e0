"""A plan's stages as a DeepSpeed `PipelineModule`: one layer per stage, tied weights summed across stages.

`pipeline_module(model, plan, loss_fn=..., example_inputs=...)` splits the model with
`runtime.stages.build_stages` (so it works on any model the other runtimes run: nn.Sequential,
torch.fx, torch.export) and hands DeepSpeed exactly one layer per plan stage with
`num_stages = len(plan.stages)` and `partition_method="uniform"`: DeepSpeed's
`partition_uniform(S, S)` gives every stage one layer, so its partition is the plan's and no
private DeepSpeed method is replaced. Each layer takes DeepSpeed's single activation argument (a
tensor or a tuple), unpacks it into the stage's positional arguments and returns a tensor or a
tuple of tensors.

DeepSpeed runs every stage on D = world size / S ranks (its pipe x data topology puts stage s on
ranks s*D .. s*D + D - 1) and one synchronous 1F1B schedule, so a plan must have equal replicas
on every stage and a synchronous schedule (`DeepSpeedPlanError` otherwise; a zb-h1 plan runs as
DeepSpeed's 1F1B, without its split backward, so its predicted time does not hold there). Gradients of a
parameter several stages use (`stages.shared`, e.g. a tied embedding and head) are summed over
the ranks of those stages in each data-parallel replica: the module answers DeepSpeed's
`get_tied_weights_and_groups()`, which the pipe engine all-reduces before its data-parallel
average. `deepspeed_config(plan)` gives the batch settings: per replica, the plan's microbatch
size and microbatches / D steps of gradient accumulation; the loss is the mini-batch mean, as
in `runtime.Engine` (and it turns off DeepSpeed's default gradient clipping at norm 1.0).

    deepspeed.init_distributed(dist_backend="gloo")        # or nccl
    module = pipeline_module(model, plan, loss_fn=loss_fn, example_inputs=example_microbatch)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                      config={**deepspeed_config(plan), ...})
    loss = engine.train_batch(data_iter)                    # (inputs, target) microbatches
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from torch import nn

from planner.errors import PlannerError
from planner.files.export import ExportError, data_parallel_degree
from planner.files.plan import Plan
from planner.units import plural
from runtime.stages import Stages, build_stages

__all__ = ["DeepSpeedPlanError", "PlannedPipelineModule", "deepspeed_config", "pipeline_module"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class DeepSpeedPlanError(PlannerError):
    """The plan cannot run on DeepSpeed's pipeline engine as planned (replicas, schedule, microbatches)."""


class _StageLayer(nn.Module):
    """One plan stage as one DeepSpeed layer: `layer(x)` runs `stage(*x)` for a tuple `x`, else `stage(x)`.

    DeepSpeed's pipe engine calls backward on every floating-point output a stage sends, so an
    output that needs no gradient (Llama's rotary cos/sin tables, made from buffers) is sent as
    a leaf that requires one: the backward through it ends there, as it would.
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, value: Any) -> Any:
        args = value if isinstance(value, tuple) else (value,)
        output = self.stage(*args)
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, tuple):
            return tuple(_differentiable(item) for item in output)
        return _differentiable(output)


def _differentiable(value: Any) -> Any:
    """A floating-point tensor that requires grad: itself, or a leaf copy of it that does."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad:
        return value.detach().requires_grad_()
    return value


class PlannedPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule over a plan's stages, which also sums the plan's tied weights (see the module docstring)."""

    def __init__(self, stages: Stages, *, loss_fn: LossFn, **pipeline_module_kwargs: Any) -> None:
        super().__init__(layers=[_StageLayer(stage) for stage in stages], num_stages=len(stages), loss_fn=loss_fn,
                         partition_method="uniform", **pipeline_module_kwargs)
        self._planned_ties = self._tie_groups(stages)

    def _tie_groups(self, stages: Stages) -> list[tuple[nn.Parameter, Any]]:
        """(this rank's parameter, process group) per shared parameter of this rank's stage; groups made on every rank."""
        topology = self.topology()
        replicas = topology.get_dim("data")
        stage_index = topology.get_coord(dist.get_rank()).pipe
        replica = topology.get_coord(dist.get_rank()).data
        ties: list[tuple[nn.Parameter, Any]] = []
        for shared in stages.shared:
            for data in range(replicas):
                ranks = sorted(topology.get_rank(pipe=s, data=data) for s in shared.stages)
                group = dist.new_group(ranks)  # collective: every rank creates every group, in order
                if data == replica and stage_index in shared.stages:
                    name = shared.stage_names[shared.stages.index(stage_index)]
                    ties.append((dict(stages[stage_index].named_parameters())[name], group))
        return ties

    def get_tied_weights_and_groups(self) -> list[tuple[nn.Parameter, Any]]:
        """DeepSpeed's TiedLayerSpec weights, and the plan's shared parameters with their groups (summed by the engine)."""
        return [*super().get_tied_weights_and_groups(), *self._planned_ties]


def pipeline_module(model: nn.Module, plan: Plan, *, loss_fn: LossFn, example_inputs: Any = None,
                    **pipeline_module_kwargs: Any) -> PlannedPipelineModule:
    """This rank's PipelineModule for `plan`'s stages of `model`; call after `deepspeed.init_distributed`.

    Every rank passes the whole model (same weights); `example_inputs`: one microbatch of the
    model's inputs, for models torch.fx cannot trace. Other keyword arguments go to
    PipelineModule (not `layers`, `num_stages`, `partition_method`, `loss_fn`, `topology`).
    DeepSpeedPlanError if the plan cannot run on DeepSpeed, torch.distributed is not initialized,
    or the job's world size is not the plan's rank count.
    """
    replicas = _replicas(plan)
    if not dist.is_initialized():
        raise DeepSpeedPlanError("torch.distributed is not initialized: call deepspeed.init_distributed() first, in "
                                 "a process started by torchrun or the deepspeed launcher")
    needed = replicas * len(plan.stages)
    if dist.get_world_size() != needed:
        raise DeepSpeedPlanError(f"the plan has {plural(needed, 'rank')} ({plural(len(plan.stages), 'stage')} x "
                                 f"{plural(replicas, 'replica')}) but the job has "
                                 f"{plural(dist.get_world_size(), 'process', 'processes')}: launch {needed}")
    return PlannedPipelineModule(build_stages(model, plan, example_inputs), loss_fn=loss_fn, **pipeline_module_kwargs)


def deepspeed_config(plan: Plan) -> dict[str, float]:
    """DeepSpeed config entries that train `plan` as planned: the batch settings, and no gradient clipping.

    train_batch_size = microbatch size x microbatches (the plan's mini-batch) =
    train_micro_batch_size_per_gpu x gradient_accumulation_steps x D. `gradient_clipping` is
    0.0: DeepSpeed 0.19 clips the gradient norm at 1.0 unless told otherwise, which
    single-device training, `runtime.Engine` and the plan do not (set your own value after it).
    """
    replicas = _replicas(plan)
    if plan.microbatch_size is None:
        raise DeepSpeedPlanError("the plan does not know its microbatch size (its profile has no batch size): "
                                 "re-plan with --microbatch-size, or set train_micro_batch_size_per_gpu yourself")
    microbatches = plan.microbatches or 1
    return {"train_micro_batch_size_per_gpu": plan.microbatch_size,
            "gradient_accumulation_steps": microbatches // replicas,
            "train_batch_size": plan.microbatch_size * microbatches, "gradient_clipping": 0.0}


def _replicas(plan: Plan) -> int:
    """D, the replicas of every stage; DeepSpeedPlanError for plans DeepSpeed cannot run as planned."""
    try:
        return data_parallel_degree(plan, "deepspeed")
    except ExportError as exc:
        raise DeepSpeedPlanError(f"this plan cannot run on DeepSpeed's pipeline engine: {exc.problem}; {exc.fix}") from None
