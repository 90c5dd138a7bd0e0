"""Splits a model into the pipeline stages of a plan: nn.Sequential slices, torch.fx graphs, or torch.export graphs."""

from __future__ import annotations

import difflib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import fx, nn

from planner.errors import PlannerError
from planner.files.plan import Plan
from runtime.export_split import (
    ExportFailure, ShapeGuard, capture, first_nodes, follow_input_device, modules_inside_blocks,
)

__all__ = [
    "StageModule", "StageSplitError", "SharedParameter", "StageSignature", "ValueSpec", "Stages",
    "build_stages", "split_model", "stage_signatures", "run_stages", "describe_boundaries", "stage_args",
]

# A stage: an nn.Sequential slice of the model (plain nn.Sequential models), an fx.GraphModule
# (any other model: traced by torch.fx, or captured by torch.export), or the model itself when
# there is a single stage.
StageModule = nn.Module

_FX_DIR = Path(fx.__file__).resolve().parent  # the tracer's own frames, skipped when naming the failing forward
_SUGGESTION = (
    "write the model as an nn.Sequential of its layers, or split at other modules: only the forwards "
    "that enclose a split point are traced, every other module runs whole"
)
_EXPORT_SUGGESTION = (
    "choose split points (planner profile --split-points) whose enclosing forwards torch.fx can trace, "
    "so that code runs whole inside one module, or write the model as an nn.Sequential of its layers"
)


class StageSplitError(PlannerError):
    """The model cannot be split as asked: untraceable forward, unknown or misordered split point."""


@dataclass(frozen=True)
class SharedParameter:
    """A parameter used by several stages (tied weights): a runtime must sum its gradients across them.

    `names`: every name of the parameter in the model; `stages`: the stage indices using it;
    `stage_names[i]`: its name in `stages[i]`'s `named_parameters()`.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    stage_names: tuple[str, ...]


@dataclass(frozen=True)
class StageSignature:
    """Names of the values a stage takes (in call order) and returns.

    Traced stages: the fx node names of the model's graph (stage 0 takes the forward's
    arguments; a middle stage returns a tuple; the last returns the model's output). nn.Sequential
    slices take and return one value, named "input", the last child's name, and "output".
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class ValueSpec:
    """One value crossing a stage boundary at some inputs: its name, and shape and dtype if a tensor."""

    name: str
    kind: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None


class Stages(list[nn.Module]):
    """The stage modules in pipeline order (a list), with `shared` parameters, `signatures` and `method`.

    `method`: how the model was split: "whole" (one stage), "sequential", "fx" or "export".

    A stage may modify its inputs in place (vgg's stages can begin with `ReLU(inplace=True)`):
    a runtime that turns received tensors into leaves requiring grad must pass them on as
    `leaf.clone()` (autograd refuses in-place operations on such leaves).
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
    boundary are tensors. What export cannot capture either (branches on tensor values, e.g.
    mixture-of-experts routing loops) raises StageSplitError naming the construct and the way out.
    """
    names = list(split_points)
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
                modules, signatures = _split_traced(model, names)
                method = "fx"
            except _UntraceableError as untraceable:
                if example_inputs is None:
                    raise StageSplitError(f"{untraceable}; or pass an example microbatch (example_inputs) so that "
                                          "torch.export can capture the model instead") from None
                modules, signatures = _split_exported(model, names, tuple(example_inputs), untraceable)
                method = "export"
            _hold_every_name(model, modules)
    return Stages(modules, _shared_parameters(model, modules), signatures, method)


def stage_signatures(stages: Stages) -> tuple[StageSignature, ...]:
    """What each stage takes and returns (names of the values); see `StageSignature`."""
    return stages.signatures


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


# --- torch.fx ---------------------------------------------------------------------------------


class _UntraceableError(StageSplitError):
    """torch.fx could not trace a forward that encloses a split point (torch.export may still capture it)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


class _SplitTracer(fx.Tracer):
    """Traces only the forwards that enclose a split point; every other module is a leaf call.

    Records, for each split module, the last graph node that existed when it was first called:
    the stage it begins starts right after that node.
    """

    def __init__(self, split_modules: dict[int, str], enclosing: set[int]) -> None:
        super().__init__()
        self.split_modules = split_modules
        self.enclosing = enclosing
        self.entered: dict[str, fx.Node | None] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Leaf unless the module encloses a split point."""
        return id(m) not in self.enclosing

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Note where a split module is first called, then trace the call as usual."""
        name = self.split_modules.get(id(m))
        if name is not None and name not in self.entered:
            nodes = self.graph.nodes
            self.entered[name] = None if len(nodes) == 0 else next(iter(reversed(nodes)))
        return super().call_module(m, forward, args, kwargs)


def _split_traced(model: nn.Module, names: list[str]) -> tuple[list[nn.Module], tuple[StageSignature, ...]]:
    """Trace the model with torch.fx and cut its graph where each split module is first called."""
    graph, entered = _trace(model, names)
    return _cut_graph(model, model, list(graph.nodes), names, entered)


def _split_exported(model: nn.Module, names: list[str], example_inputs: tuple[Any, ...],
                    untraceable: _UntraceableError) -> tuple[list[nn.Module], tuple[StageSignature, ...]]:
    """Capture the model with torch.export and cut its graph where each split module's first call begins."""
    try:
        captured = capture(model, example_inputs)
    except ExportFailure as failure:
        raise StageSplitError(
            f"cannot split {type(model).__name__}: torch.fx could not trace it ({untraceable.where}) and "
            f"torch.export could not capture it: {failure.construct}; {_EXPORT_SUGGESTION}"
        ) from None
    nodes = list(captured.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    found = first_nodes(captured.graph, names)
    blocks = modules_inside_blocks(captured.graph, captured.attributes)
    for name in names:
        block = blocks.get(name)
        if block is not None and (name not in found or position[found[name]] > position[block]):
            raise StageSplitError(
                f"split point {name!r} begins inside a torch.no_grad() or torch.autocast block of an enclosing "
                "forward, which torch.export captures as one operation: split at a module outside the block")
        if name not in found:
            raise StageSplitError(
                f"split point {name!r} records no operation in the exported graph (the forward does not call it, or "
                "it computes nothing, like nn.Identity): split at another module, e.g. the next one")
    entered = {name: nodes[position[node] - 1] if position[node] else None for name, node in found.items()}
    stages, signatures = _cut_graph(model, captured.attributes, nodes, names, entered)
    for index, stage in enumerate(stages):
        inputs = [node for node in stage.graph.nodes if node.op == "placeholder"]
        shapes = tuple(_example_shape(node) for node in inputs)
        stage.register_forward_pre_hook(ShapeGuard(index, shapes, captured.training))
        if captured.device is not None:
            follow_input_device(stage, captured.device)
    return stages, signatures


def _example_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The shape export recorded for a value (None if not a tensor)."""
    value = node.meta.get("val")
    return tuple(int(size) for size in value.shape) if isinstance(value, torch.Tensor) else None


def _cut_graph(model: nn.Module, root: nn.Module | dict[str, Any], nodes: list[fx.Node], names: list[str],
               entered: dict[str, fx.Node | None]) -> tuple[list[nn.Module], tuple[StageSignature, ...]]:
    """One GraphModule per stage of `nodes`, cut where each split module is entered; get_attr reads from `root`."""
    cuts = _cut_positions(model, names, nodes, entered)
    bounds = [0, *cuts, len(nodes)]
    stages: list[nn.Module] = []
    signatures = []
    for index in range(len(bounds) - 1):
        stage, signature = _stage_module(model, root, nodes, bounds, index)
        stages.append(stage)
        signatures.append(signature)
    return stages, tuple(signatures)


def _trace(model: nn.Module, names: list[str]) -> tuple[fx.Graph, dict[str, fx.Node | None]]:
    """The model's fx graph with split modules and non-enclosing modules as leaves; StageSplitError if it fails."""
    split_modules = {id(model.get_submodule(name)): name for name in names}
    enclosing = {id(model.get_submodule(prefix)) for name in names for prefix in _strict_prefixes(name)}
    tracer = _SplitTracer(split_modules, enclosing)
    saved = _model_state(model)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # any tracing failure: say which forward and why
        raise _trace_failure(model, exc) from exc
    finally:
        _restore_model_state(saved)
    return graph, tracer.entered


_ModelState = list[tuple[nn.Module, dict[str, Any], dict[str, Any], dict[str, Any], list[tuple[torch.Tensor, int, torch.Tensor]]]]


def _model_state(model: nn.Module) -> _ModelState:
    """What a traced forward may change: each module's attributes, buffer and parameter slots, buffer values."""
    return [(module, dict(module.__dict__), dict(module._buffers), dict(module._parameters),
             [(buffer, buffer._version, buffer.detach().clone()) for buffer in module._buffers.values()
              if buffer is not None])
            for module in model.modules()]


def _restore_model_state(saved: _ModelState) -> None:
    """Undo what the forward's Python did to the model while torch.fx ran it (counters, cached sizes)."""
    for module, attributes, buffers, parameters, values in saved:
        module.__dict__.clear()
        module.__dict__.update(attributes)
        module._buffers.clear()
        module._buffers.update(buffers)
        module._parameters.clear()
        module._parameters.update(parameters)
        with torch.no_grad():
            for buffer, version, value in values:
                if buffer._version != version:
                    buffer.copy_(value)


def _strict_prefixes(name: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b"]: the modules enclosing `name`."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _trace_failure(model: nn.Module, exc: Exception) -> _UntraceableError:
    """A one-line error naming the forward that failed to trace, the construct and a way out."""
    where = f"{_failing_forward(model, exc)}: {_gist(exc)}"
    return _UntraceableError(f"cannot split {type(model).__name__}: torch.fx could not trace {where}; {_SUGGESTION}",
                             where)


def _gist(exc: Exception) -> str:
    """What the model did that symbolic tracing cannot follow."""
    message = str(exc)
    if "control flow" in message:
        return "control flow (if/while/assert) depends on tensor values"
    if "cannot be iterated" in message:
        return "it iterates over a traced value (a tensor or its size)"
    if "'len' is not supported" in message:
        return "it calls len() on a traced value"
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    return f"{type(exc).__name__}: {first_line}"


def _failing_forward(model: nn.Module, exc: BaseException) -> str:
    """'<name> (<Class>).forward at file:line' for the innermost model frame of the traceback."""
    names = {id(module): name for name, module in model.named_modules()}
    found = f"{type(model).__name__}.forward"
    traceback = exc.__traceback__
    while traceback is not None:
        code = traceback.tb_frame.f_code
        owner = traceback.tb_frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        inside_model = _FX_DIR not in Path(code.co_filename).parents and code.co_filename != __file__
        if isinstance(owner, nn.Module) and id(owner) in names and inside_model:
            label = names[id(owner)] or "the model"
            where = f"{Path(code.co_filename).name}:{traceback.tb_lineno}"
            found = f"{label} ({type(owner).__name__}).{code.co_name} at {where}"
        traceback = traceback.tb_next
    return found


def _cut_positions(model: nn.Module, names: list[str], nodes: list[fx.Node],
                   entered: dict[str, fx.Node | None]) -> list[int]:
    """Graph positions where the stages after the first begin; StageSplitError unless increasing."""
    position = {node: index for index, node in enumerate(nodes)}
    cuts = []
    for name in names:
        if name not in entered:
            raise StageSplitError(
                f"split point {name!r} is not called by {type(model).__name__}.forward (nor by a forward "
                "that encloses it), so no stage can begin there; split at modules the forward calls"
            )
        marker = entered[name]
        cuts.append(0 if marker is None else position[marker] + 1)
    for (earlier, first), (later, second) in zip(zip(names, cuts), zip(names[1:], cuts[1:])):
        if second <= first:
            raise StageSplitError(
                f"split point {later!r} does not begin after {earlier!r} in the forward pass; "
                "give split points in execution order, one per stage"
            )
    if cuts[0] <= _count_placeholders(nodes):
        raise StageSplitError(f"split point {names[0]!r} begins the forward pass, so the first stage would be empty")
    return cuts


def _count_placeholders(nodes: list[fx.Node]) -> int:
    """Number of input nodes (they come first in an fx graph)."""
    return sum(1 for node in nodes if node.op == "placeholder")


def _crossing(nodes: list[fx.Node], cut: int) -> list[fx.Node]:
    """Values made before position `cut` and used at or after it (parameters are not values)."""
    position = {node: index for index, node in enumerate(nodes)}
    return [
        node for node in nodes[:cut]
        if node.op != "get_attr" and any(position[user] >= cut for user in node.users)
    ]


def _stage_module(model: nn.Module, root: nn.Module | dict[str, Any], nodes: list[fx.Node], bounds: list[int],
                  index: int) -> tuple[fx.GraphModule, StageSignature]:
    """The GraphModule of stage `index`: nodes [bounds[index], bounds[index + 1]) of the model's graph.

    Its submodules and attributes are those of `root` (the model, or the objects an exported
    graph reads) that its nodes use, under the same names; buffers stay out of `state_dict()`
    unless they are persistent buffers of `model` under that name.
    """
    start, stop = bounds[index], bounds[index + 1]
    last = stop == len(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # parameters and buffers read directly: each stage reads its own reference
            env[node] = graph.node_copy(node)
        return env[node]

    inputs = [node for node in nodes if node.op == "placeholder"] if start == 0 else _crossing(nodes, start)
    for node in inputs:
        env[node] = graph.node_copy(node) if start == 0 else graph.placeholder(node.name)
        env[node].meta = dict(node.meta)  # export's example value: the stage's input shapes
    for node in nodes[start:stop]:
        if node.op not in ("placeholder", "get_attr", "output"):
            env[node] = graph.node_copy(node, lookup)
    if last:
        output_node = nodes[-1]
        result = graph.output(fx.node.map_arg(output_node.args[0], lookup))
        output_names = tuple(node.name for node in _nodes_in(result.args[0]))
    else:
        outputs = _crossing(nodes, stop)
        graph.output(tuple(env[node] for node in outputs))
        output_names = tuple(env[node].name for node in outputs)
    graph.lint()
    stage = fx.GraphModule(root, graph, class_name=f"Stage{index}")
    stage.training = model.training
    _keep_buffer_persistence(model, stage)
    input_names = tuple(env[node].name for node in inputs)
    return stage, StageSignature(input_names, output_names)


def _keep_buffer_persistence(model: nn.Module, stage: nn.Module) -> None:
    """Mark the stage's buffers non-persistent unless the model saves them under the same name."""
    persistent = set(model.state_dict(keep_vars=True))
    for name, _ in list(stage.named_buffers(remove_duplicate=False)):
        owner_name, _, field = name.rpartition(".")
        if name not in persistent:
            stage.get_submodule(owner_name)._non_persistent_buffers_set.add(field)


def _nodes_in(argument: Any) -> list[fx.Node]:
    """The fx nodes in a (nested) output structure, in order."""
    found: list[fx.Node] = []
    fx.node.map_arg(argument, lambda node: found.append(node) or node)
    return found


# --- parameters -------------------------------------------------------------------------------


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
            stage = holder_of.get(id(value), stages[0])
            owner_name, _, field = name.rpartition(".")
            owner = stage
            for part in owner_name.split(".") if owner_name else ():
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
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
