"""Splits a model into the pipeline stages of a plan: nn.Sequential slices, torch.fx graphs, or torch.export graphs.

This module chooses the way (`split_model`), checks the split points, slices nn.Sequential models and keeps
every parameter name in some stage (tied weights shared); the graph splitting itself is
`runtime.graph_split`, the types it returns `runtime.stage_types`.
"""

from __future__ import annotations

import difflib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import fx, nn

from planner.files.plan import Plan
from runtime.export_split import ShapeGuard
from runtime.graph_split import UntraceableError, split_exported, split_traced
from runtime.opaque_calls import Arguments, members, real_module
from runtime.stage_types import SharedParameter, StageSignature, StageSplitError, ValueSpec

__all__ = [
    "StageModule", "StageSplitError", "SharedParameter", "StageSignature", "ValueSpec", "Stages",
    "build_stages", "split_model", "run_stages", "describe_boundaries", "stage_args",
]

# A stage: an nn.Sequential slice of the model (plain nn.Sequential models), an fx.GraphModule
# (any other model: traced by torch.fx, or captured by torch.export), or the model itself when
# there is a single stage.
StageModule = nn.Module


class Stages(list[nn.Module]):
    """The stage modules in pipeline order (a list), with `shared` parameters, `signatures` and `method`.

    `method`: how the model was split: "whole" (one stage), "sequential", "fx" or "export".

    A stage may modify its inputs in place (vgg's stages can begin with `ReLU(inplace=True)`):
    a runtime that turns received tensors into leaves requiring grad must run such a stage on
    clones of them (autograd refuses in-place operations on such leaves; `runtime.stage_runner`
    finds out which stages do, and runs the others on the leaves themselves).
    """

    def __init__(self, modules: Iterable[nn.Module], shared: tuple[SharedParameter, ...],
                 signatures: tuple[StageSignature, ...], method: str = "fx") -> None:
        super().__init__(modules)
        self.shared = shared
        self.signatures = signatures
        self.method = method


def build_stages(model: nn.Module, plan: Plan, example_inputs: Any = None) -> Stages:
    """One module per stage of `plan`, such that `run_stages(stages, *inputs)` equals `model(*inputs)`.

    Stage k runs from the first call of `plan.stages[k].first_layer` up to the first call of
    the next stage's first layer (torch.distributed.pipelining's `SplitPoint.BEGINNING`), and
    holds the model's own submodules and Parameter objects (no copies). A parameter used by
    several stages (tied weights) is in each of them and listed in `stages.shared`. The last
    stage returns the model's output; the loss is computed outside, as the profiler does
    (`loss_fn(output, target)`). `example_inputs`: one microbatch of the model's inputs, at the
    shapes training will use (a tensor or a tuple); needed when torch.fx cannot trace the model
    (see `split_model`).
    Raises StageSplitError if the plan's layer names are not modules of `model` or the model
    cannot be split.
    """
    if not plan.stages:
        raise StageSplitError("the plan has no stages")
    _check_plan_names(model, plan)
    return split_model(model, [stage.first_layer for stage in plan.stages[1:]], example_inputs)


def split_model(model: nn.Module, split_points: Sequence[str],
                example_inputs: Any = None) -> Stages:
    """Split `model` so that a new stage begins at the first call of each named module (in order).

    How: a plain nn.Sequential split at its children is sliced (`nn.Sequential` of the same
    child objects, under the same names). Any other model is traced with torch.fx: the forwards
    of the model and of the modules enclosing a split point are traced, every other module
    (split points included) stays one `call_module` node, so code inside it is never traced.
    The graph is cut before the first node of each split module's first call; a stage takes
    every value made before it and used at or after it (residuals too: a middle stage passes
    on what later stages need) and returns those the next stages need. Parameters and buffers
    read directly in a traced forward (`get_attr`) are read by every stage that uses them.

    Limits of tracing: a traced forward may not branch or loop on tensor values, call len() on
    them or iterate over them (StageSplitError says where); Python-level choices such as
    `if self.training` or `F.dropout(x, training=self.training)` in a traced forward are fixed
    at the mode the model is in now (code inside untraced modules is not affected); a split
    module must be called by a traced forward. Values crossing a boundary may be non-tensors
    (sizes, devices) when a traced forward passes them on: see `describe_boundaries`.

    When torch.fx cannot trace the model (Hugging Face transformers models, for one) and
    `example_inputs` are given, the model is captured with torch.export instead (non-strict, in
    the model's current mode; `runtime.export_split`), and its ATen-level graph is cut at the
    first node of each split module's first call (the nodes' `nn_module_stack`). Its stages read
    the model's own Parameters and buffers under their names in the model; they run only at the
    example's shapes and mode (another shape raises StageSplitError naming both), and dropout
    draws from the device's generator at run time as in eager mode. Values crossing an exported
    boundary are tensors. Code export cannot capture (branches on tensor values, e.g.
    mixture-of-experts routing loops) inside a module that encloses no split point keeps that module
    (and the others of its class) whole, one call that runs it eagerly (`runtime.kept_modules`);
    elsewhere it raises StageSplitError naming the construct and the way out.
    """
    names = list(split_points)
    if isinstance(example_inputs, Mapping):  # a tokenizer's: the model would be called as model(**inputs)
        raise StageSplitError(
            f"the example inputs are a dict ({', '.join(map(str, example_inputs))}), and stages take their inputs by "
            "position: give the model a forward taking them so (planner.profiling.keyword_inputs.keyword_model(model, "
            "names), which `planner train` applies to a model file's dict) and pass the tuple in that order")
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)  # a model of one tensor input
    _check_module_names(model, names, "split point")
    if len(set(names)) != len(names):
        raise StageSplitError(f"split points repeat a module: {names}")
    if not names:
        modules: list[nn.Module] = [model]
        signatures = (StageSignature(("input",), ("output",)),)
        method = "whole"
    else:
        indices = _sequential_indices(model, names)
        if indices is not None:
            modules, signatures = _slice_sequential(model, indices)
            method = "sequential"
        else:
            try:
                modules, signatures = split_traced(model, names)
                method = "fx"
            except UntraceableError as untraceable:
                if example_inputs is None:
                    raise StageSplitError(f"{untraceable}; or pass an example microbatch (example_inputs) so that "
                                          "torch.export can capture the model instead") from None
                modules, signatures = split_exported(model, names, tuple(example_inputs), untraceable)
                method = "export"
            _hold_argument_modules(model, modules)
            _hold_every_name(model, modules)
    return Stages(modules, _shared_parameters(model, modules), signatures, method)


def run_stages(stages: Sequence[nn.Module], *inputs: Any) -> Any:
    """Chain the stages on the model's inputs, as a single process would; returns the model's output."""
    value: Any = stages[0](*inputs)
    for previous, stage in zip(stages, stages[1:]):
        value = stage(*stage_args(previous, value))
    return value


def describe_boundaries(stages: Stages, *inputs: Any) -> list[tuple[ValueSpec, ...]]:
    """The values crossing each boundary k -> k+1 at `inputs` (run once without grad), for sizing buffers.

    Exported stages are not run (a run in another mode would be refused, and one in training
    mode would move batch-norm statistics): their boundaries are the values export recorded,
    at the shapes stage 0 was captured at, which `inputs` must have.
    """
    if stages.method == "export":
        ShapeGuard.check_shapes(stages[0], inputs)
        return [tuple(_spec(node.name, node.meta.get("val")) for node in stage.graph.nodes if node.op == "placeholder")
                for stage in stages[1:]]
    boundaries: list[tuple[ValueSpec, ...]] = []
    with torch.no_grad():
        value: Any = stages[0](*inputs)
        for index, stage in enumerate(stages[1:]):
            args = stage_args(stages[index], value)
            names = stages.signatures[index].outputs
            boundaries.append(tuple(_spec(name, arg) for name, arg in zip(names, args)))
            value = stage(*args)
    return boundaries


def stage_args(stage: nn.Module, value: Any) -> tuple[Any, ...]:
    """A stage's result as the next stage's arguments: traced stages return a tuple, slices one value."""
    return value if isinstance(stage, fx.GraphModule) else (value,)


def _spec(name: str, value: Any) -> ValueSpec:
    """Describe one boundary value."""
    if isinstance(value, torch.Tensor):
        return ValueSpec(name, "tensor", tuple(value.shape), value.dtype)
    return ValueSpec(name, type(value).__name__)


# --- names -----------------------------------------------------------------------------------


def _check_plan_names(model: nn.Module, plan: Plan) -> None:
    """Every stage's first and last layer must be a module of the model."""
    for index, stage in enumerate(plan.stages):
        for field_name in ("first_layer", "last_layer"):
            _check_module_names(model, [getattr(stage, field_name)], f"plan stage {index} {field_name}")


def _check_module_names(model: nn.Module, names: Sequence[str], what: str) -> None:
    """StageSplitError naming the first name that is not a submodule, with close matches."""
    known = [name for name, _ in model.named_modules() if name]
    known_set = set(known)
    for name in names:
        if name not in known_set:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hint = f"close matches: {', '.join(close)}" if close else f"modules include: {', '.join(known[:8])}"
            raise StageSplitError(
                f"{what} {name!r} is not a module of {type(model).__name__} ({hint}); "
                "was the plan made from a profile of this model?"
            )


# --- nn.Sequential -----------------------------------------------------------------------------


def _sequential_indices(model: nn.Module, names: Sequence[str]) -> list[int] | None:
    """Child indices of the split points if `model` is a plain nn.Sequential split at its children."""
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        return None
    children = list(model._modules)
    if not all(name in children for name in names):
        return None
    indices = [children.index(name) for name in names]
    if any(later <= earlier for earlier, later in zip(indices, indices[1:])) or indices[0] == 0:
        raise StageSplitError(
            f"split points {list(names)} are not in the order of {type(model).__name__}'s children "
            "after the first one; each stage must begin at a later child than the one before"
        )
    return indices


def _slice_sequential(model: nn.Module, indices: list[int]) -> tuple[list[nn.Module], tuple[StageSignature, ...]]:
    """nn.Sequential slices between the child indices, keeping the children's names."""
    items = list(model._modules.items())
    bounds = [0, *indices, len(items)]
    slices: list[nn.Module] = []
    signatures = []
    for start, stop in zip(bounds, bounds[1:]):
        stage = nn.Sequential(OrderedDict(items[start:stop]))
        stage.training = model.training
        slices.append(stage)
        inputs = ("input",) if start == 0 else (items[start - 1][0],)
        outputs = ("output",) if stop == len(items) else (items[stop - 1][0],)
        signatures.append(StageSignature(inputs, outputs))
    return slices, tuple(signatures)


# --- parameters -------------------------------------------------------------------------------


def _hold_argument_modules(model: nn.Module, stages: Sequence[nn.Module]) -> None:
    """Have each stage hold, under its name in the model, every module of the model that the stage passes to a
    call it keeps whole (`runtime.opaque_calls.Arguments`: `checkpoint(layer, h, proj)`, a kept module given
    `proj=self.proj`, `self.proj.forward` or an object holding it): the stage then trains, moves and shares
    (`Stages.shared`) that module's parameters as its own. Without it the call would use a module no stage, or
    another stage, holds."""
    paths = {id(module): name for name, module in model.named_modules() if name}
    for stage in stages:
        for node in stage.graph.nodes if isinstance(stage, fx.GraphModule) else ():
            arguments = getattr(node.target, "arguments", None)
            for constant in arguments.constants if isinstance(arguments, Arguments) else ():
                for module in _modules_in(constant):
                    if id(module) in paths:
                        owner_name, _, field = paths[id(module)].rpartition(".")
                        _submodule(stage, owner_name).add_module(field, module)


def _modules_in(value: Any, depth: int = 3) -> Iterator[nn.Module]:
    """The modules `value` is or reaches: itself, a bound method's module, or through its `members`, `depth`
    levels down."""
    value = real_module(value)
    owner = real_module(getattr(value, "__self__", None))
    if isinstance(value, nn.Module) or isinstance(owner, nn.Module):
        yield value if isinstance(value, nn.Module) else owner
        return
    for _, item in members(value) if depth > 0 else ():
        yield from _modules_in(item, depth - 1)


def _submodule(stage: nn.Module, name: str) -> nn.Module:
    """The stage's submodule `name` (dotted), made (an empty nn.Module) where missing."""
    owner = stage
    for part in name.split(".") if name else ():
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    return owner


def _hold_every_name(model: nn.Module, stages: Sequence[nn.Module]) -> None:
    """Give every name in the model's state_dict to a graph stage, so the stages' state_dicts together are the model's.

    A name no stage holds (a tied weight's alias whose module the forward never calls, such as
    T5's `shared` beside `encoder.embed_tokens`; a parameter or buffer the forward never reads)
    is added to the first stage holding the same tensor, else to stage 0.
    """
    held: dict[str, set[int]] = {}
    holder_of: dict[int, nn.Module] = {}
    for stage in stages:
        state = stage.state_dict(keep_vars=True)
        held.update({name: set() for name in state})
        for value in state.values():
            holder_of.setdefault(id(value), stage)
    for name, value in model.state_dict(keep_vars=True).items():
        if name not in held:
            owner_name, _, field = name.rpartition(".")
            owner = _submodule(holder_of.get(id(value), stages[0]), owner_name)
            if isinstance(value, nn.Parameter):
                owner.register_parameter(field, value)
            else:
                owner.register_buffer(field, value)


def _shared_parameters(model: nn.Module, stages: Sequence[nn.Module]) -> tuple[SharedParameter, ...]:
    """Parameters held by more than one stage, with their model names and per-stage names."""
    model_names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        model_names.setdefault(id(parameter), []).append(name)
    holders: dict[int, list[tuple[int, str]]] = {}
    for index, stage in enumerate(stages):
        for name, parameter in stage.named_parameters():
            holders.setdefault(id(parameter), []).append((index, name))
    return tuple(
        SharedParameter(tuple(model_names.get(key, [held[0][1]])), tuple(i for i, _ in held),
                        tuple(name for _, name in held))
        for key, held in holders.items() if len(held) > 1
    )
