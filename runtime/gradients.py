"""The gradient collectives of a pipeline rank, shared by `runtime.engine` and `runtime.pippy`: the process groups of
a stage's replicas and of tied parameters, and the all-reduce of gradients over one of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from runtime.stage_types import SharedParameter

__all__ = ["GradientGroups", "all_reduce_gradients", "comm_device", "make_gradient_groups"]


def comm_device(device: torch.device) -> torch.device:
    """Where messages and all-reduce buffers live: the GPU under NCCL, the CPU under gloo."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class GradientGroups:
    """This rank's gradient collectives: `tied` pairs each tied parameter of its stage with the group of every
    rank of the stages holding it; `replicated` are the stage's other parameters, all-reduced over
    `replica_group` (None when the stage has one replica)."""

    tied: list[tuple[nn.Parameter, Any]]
    replicated: list[nn.Parameter]
    replica_group: Any


def make_gradient_groups(stage_ranks: Sequence[Sequence[int]], shared: Sequence[SharedParameter], stage: int,
                         module: nn.Module) -> GradientGroups:
    """Create one group per stage with several replicas, then one per tied parameter (collective: every rank
    creates every group, in this order), and return those of this rank's `stage`, whose module is `module`."""
    replica_groups = [dist.new_group(sorted(ranks)) if len(ranks) > 1 else None for ranks in stage_ranks]
    tied_groups = [dist.new_group(sorted(rank for held_by in held.stages for rank in stage_ranks[held_by]))
                   for held in shared]
    parameters = dict(module.named_parameters())
    tied = [(parameters[held.stage_names[held.stages.index(stage)]], tied_groups[index])
            for index, held in enumerate(shared) if stage in held.stages]
    tied_ids = {id(parameter) for parameter, _ in tied}
    replicated = [parameter for parameter in module.parameters() if id(parameter) not in tied_ids]
    return GradientGroups(tied, replicated, replica_groups[stage])


def all_reduce_gradients(parameters: Sequence[nn.Parameter], group: Any, device: torch.device, divide_by: int = 1,
                         wait: Callable[[Any], None] = lambda work: work.wait()) -> None:
    """Sum the gradients of `parameters` over `group`, divide by `divide_by`, and set them as the `.grad`s.

    One flat buffer on `comm_device(device)` (a parameter without a gradient takes part with zeros;
    mixed dtypes are summed in the widest and cast back); `wait(work)` waits for the asynchronous
    all-reduce (the engine's wait also watches the other ranks).
    """
    if not parameters:
        return
    grads = [parameter.grad if parameter.grad is not None else torch.zeros_like(parameter) for parameter in parameters]
    flat = torch.cat([grad.reshape(-1) for grad in grads]).to(comm_device(device))
    wait(dist.all_reduce(flat, group=group, async_op=True))
    if divide_by != 1:
        flat /= divide_by
    offset = 0
    for parameter in parameters:
        size = parameter.numel()
        parameter.grad = flat[offset:offset + size].view_as(parameter).to(parameter.device, parameter.dtype)
        offset += size
