"""The gradient collectives of a pipeline rank, shared by `runtime.engine` and `runtime.pippy`: the process groups of
a stage's replicas and of tied parameters, and the all-reduce of gradients over one of them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from runtime.stage_types import SharedParameter

__all__ = [
    "GradientGroups", "all_reduce_gradients", "comm_device", "make_gradient_groups", "make_rank_gradient_groups",
]


def comm_device(device: torch.device) -> torch.device:
    """Where messages and all-reduce buffers live: the GPU under NCCL, the CPU under gloo."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class GradientGroups:
    """This rank's gradient collectives: `tied` pairs each tied parameter of its stages (once) with the group of
    every rank of the stages holding it; `replicated` are its stages' other parameters, all-reduced over
    `replica_group` (None when its stage has one replica)."""

    tied: list[tuple[nn.Parameter, Any]]
    replicated: list[nn.Parameter]
    replica_group: Any


def make_gradient_groups(stage_ranks: Sequence[Sequence[int]], shared: Sequence[SharedParameter], stage: int,
                         module: nn.Module) -> GradientGroups:
    """`make_rank_gradient_groups` for a rank that runs one stage, `stage`, whose module is `module`."""
    return make_rank_gradient_groups(stage_ranks, shared, {stage: module})


def make_rank_gradient_groups(stage_ranks: Sequence[Sequence[int]], shared: Sequence[SharedParameter],
                              modules: Mapping[int, nn.Module]) -> GradientGroups:
    """Create one group per stage with several replicas, then one per tied parameter (collective: every rank
    creates every group, in this order), and return those of this rank, whose stages' modules are `modules`.

    A tied parameter's group holds each rank of its stages once: a rank running several of those stages
    (interleaved-1f1b) holds one Parameter object for them, whose `.grad` autograd already sums, so it
    takes part once; a parameter whose users all lie on one rank (zbv puts gpt's embedding and head on
    rank 0) is an ordinary one there, with no group. `tied` follows `shared`'s order on every rank
    (all-reducing the groups in one order cannot deadlock). A rank of several stages needs one replica per
    stage (one replica group at most). A parameter that needs no gradient (`requires_grad=False`, frozen
    for fine-tuning) is in neither list: it gets no gradient, so no optimizer state either.
    """
    replica_groups = [dist.new_group(sorted(ranks)) if len(ranks) > 1 else None for ranks in stage_ranks]
    holders = [sorted({rank for held_by in held.stages for rank in stage_ranks[held_by]}) for held in shared]
    tied_groups = [dist.new_group(ranks) if len(ranks) > 1 else None for ranks in holders]
    replicated_stages = [stage for stage in modules if replica_groups[stage] is not None]
    if len(modules) > 1 and replicated_stages:
        raise ValueError(f"stage {replicated_stages[0]} has several replicas, but its rank runs stages "
                         f"{sorted(modules)}: a rank of several stages needs one replica each")
    tied: list[tuple[nn.Parameter, Any]] = []
    for index, held in enumerate(shared):
        mine = [stage for stage in held.stages if stage in modules]
        if mine and tied_groups[index] is not None:  # one rank holding every user (zbv's rank 0): nothing to sum
            name = held.stage_names[held.stages.index(mine[0])]
            parameter = dict(modules[mine[0]].named_parameters())[name]
            if parameter.requires_grad:
                tied.append((parameter, tied_groups[index]))
    tied_ids = {id(parameter) for parameter, _ in tied}
    unique = {id(p): p for module in modules.values() for p in module.parameters()
              if id(p) not in tied_ids and p.requires_grad}
    group = replica_groups[replicated_stages[0]] if replicated_stages else None
    return GradientGroups(tied, list(unique.values()), group)


def all_reduce_gradients(parameters: Sequence[nn.Parameter], group: Any, device: torch.device, divide_by: int = 1,
                         wait: Callable[[Any], None] = lambda work: work.wait()) -> None:
    """Sum the gradients of `parameters` over `group`, divide by `divide_by`, and set them as the `.grad`s.

    One flat buffer on `comm_device(device)`, the gradients copied in (a parameter without a gradient takes part
    with zeros, the buffer's own: no other tensor is made for it; mixed dtypes are summed in the widest and cast
    back), ending with one count per parameter of the ranks that had its gradient: a parameter no rank had one for
    keeps `.grad` None, as on one device where no sample of the batch used it (so the optimizer makes no state for
    it and steps it not: weight decay does not shrink it). `wait(work)` waits for the asynchronous all-reduce (the
    engine's wait also watches the other ranks).
    """
    if not parameters:
        return
    widest = functools.reduce(torch.promote_types, (parameter.dtype for parameter in parameters))
    total = sum(parameter.numel() for parameter in parameters)
    flat = torch.zeros(total + len(parameters), dtype=widest, device=comm_device(device))
    offset = 0
    for parameter in parameters:
        if parameter.grad is not None:
            flat[offset:offset + parameter.numel()].copy_(parameter.grad.reshape(-1))
        offset += parameter.numel()
    flat[total:].copy_(torch.tensor([float(parameter.grad is not None) for parameter in parameters]))
    wait(dist.all_reduce(flat, group=group, async_op=True))
    counts = flat[len(flat) - len(parameters):].tolist()
    if divide_by != 1:
        flat /= divide_by
    unused = 0 in counts  # then the gradients are copied out: views would keep the buffer's unused parts alive
    offset = 0
    for parameter, count in zip(parameters, counts):
        size = parameter.numel()
        parameter.grad = None if count == 0 else \
            flat[offset:offset + size].view_as(parameter).to(parameter.device, parameter.dtype, copy=unused)
        offset += size
