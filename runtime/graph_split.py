"""Splits a model's graph into stage GraphModules at split points: torch.fx traces the forwards that enclose a split
point, torch.export (`runtime.export_split`) captures what torch.fx cannot, and both graphs are cut the same way:
before the first node of each split module's first call, a stage taking every value made before it that later
nodes use."""

from __future__ import annotations

import dataclasses
import operator
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from runtime.export_split import (
    ExportFailure, ShapeGuard, ancestors, capture, first_nodes, follow_input_device, get_attribute,
    modules_inside_blocks,
)
from runtime.checkpointed import CheckpointCalls, stands_in
from runtime.custom_functions import FunctionCalls
from runtime.model_state import model_state, restore_model_state
from runtime.opaque_calls import refusal
from runtime.random_skips import ScalarDraws
from runtime.stage_types import StageSignature, StageSplitError

__all__ = ["UntraceableError", "split_exported", "split_traced"]

_FX_DIR = Path(fx.__file__).resolve().parent  # the tracer's own frames, skipped when naming the failing forward
_SUGGESTION = (
    "write the model as an nn.Sequential of its layers, or split at other modules: only the forwards "
    "that enclose a split point are traced, every other module runs whole"
)
_EXPORT_SUGGESTION = (
    "choose split points (planner profile --split-points) whose enclosing forwards torch.fx can trace, "
    "so that code runs whole inside one module, or write the model as an nn.Sequential of its layers"
)


class UntraceableError(StageSplitError):
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
        if stands_in(m):  # checkpointed: its forward makes the one node (`runtime.checkpointed`)
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def create_arg(self, a: Any) -> Any:
        """A dict that is a dataclass (a transformers `ModelOutput`) is made by a call of its class, where torch.fx
        makes a plain dict of its entries: the last stage returns what the model returns (BertForMaskedLM's
        last stage returned {'logits': ...}, which the default loss could not read)."""
        if isinstance(a, dict) and type(a) is not dict and dataclasses.is_dataclass(a):
            return self.create_node("call_function", type(a), (),
                                    {key: self.create_arg(value) for key, value in a.items()})
        return super().create_arg(a)


def split_traced(model: nn.Module, names: list[str]) -> tuple[list[nn.Module], tuple[StageSignature, ...]]:
    """Trace the model with torch.fx and cut its graph where each split module is first called (a custom autograd
    Function the trace meets is one node that applies it: `runtime.custom_functions`)."""
    graph, entered, stowed = _trace(model, names)
    for name, value in stowed.items():  # while the stages are built: they read these from the model
        setattr(model, name, value)
    try:
        return _cut_graph(model, model, list(graph.nodes), names, entered)
    finally:
        for name in stowed:
            delattr(model, name)


def split_exported(model: nn.Module, names: list[str], example_inputs: tuple[Any, ...],
                    untraceable: UntraceableError) -> tuple[list[nn.Module], tuple[StageSignature, ...]]:
    """Capture the model with torch.export and cut its graph where each split module's first call begins."""
    try:
        captured = capture(model, example_inputs, names)
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
    constants = _constants(model, root, nodes)
    stages: list[nn.Module] = []
    signatures = []
    for index in range(len(bounds) - 1):
        stage, signature = _stage_module(model, root, nodes, bounds, index, constants)
        stages.append(stage)
        signatures.append(signature)
    return stages, tuple(signatures)


def _trace(model: nn.Module, names: list[str]) -> tuple[fx.Graph, dict[str, fx.Node | None], dict[str, Any]]:
    """The model's fx graph with split modules and non-enclosing modules as leaves, where each split module is
    entered, and the tensors the trace computed from buffers alone (fx stows them on the model as attributes;
    the model is then put back as it was); StageSplitError if it fails."""
    split_modules = {id(model.get_submodule(name)): name for name in names}
    enclosing = {id(model.get_submodule(prefix)) for name in names for prefix in _strict_prefixes(name)}
    tracer = _SplitTracer(split_modules, enclosing)
    saved = model_state(model)
    draws = ScalarDraws()  # a layer skipped at random: fx would keep the one outcome it drew
    functions = FunctionCalls()  # a custom autograd Function: one node that applies it, its backward kept
    try:
        with draws, functions, CheckpointCalls(model, names):
            graph = tracer.trace(model)
        read = {node.target: get_attribute(model, node.target) for node in graph.nodes if node.op == "get_attr"}
    except Exception as exc:  # any tracing failure: say which forward and why
        if draws.random_skip is not None:
            raise StageSplitError(f"cannot split {type(model).__name__}: {draws.random_skip}") from None
        refused = refusal(exc)
        if refused is not None:
            raise StageSplitError(f"cannot split {type(model).__name__}: {refused}") from None
        raise _trace_failure(model, exc) from exc
    finally:
        restore_model_state(saved)
    return graph, tracer.entered, {target: value for target, value in read.items() if not _has(model, target)}


def _has(module: nn.Module, target: str) -> bool:
    try:
        get_attribute(module, target)
    except AttributeError:
        return False
    return True



def _strict_prefixes(name: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b"]: the modules enclosing `name`."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _trace_failure(model: nn.Module, exc: Exception) -> UntraceableError:
    """A one-line error naming the forward that failed to trace, the construct and a way out."""
    where = f"{_failing_forward(model, exc)}: {_gist(exc)}"
    return UntraceableError(f"cannot split {type(model).__name__}: torch.fx could not trace {where}; {_SUGGESTION}",
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


def _crossing(nodes: list[fx.Node], cut: int, constants: frozenset[fx.Node] = frozenset()) -> list[fx.Node]:
    """Values made before position `cut` and used at or after it (parameters are not values, and `constants`
    are computed again where they are used)."""
    position = {node: index for index, node in enumerate(nodes)}
    return [
        node for node in nodes[:cut]
        if node.op != "get_attr" and node not in constants and any(position[user] >= cut for user in node.users)
    ]


_PURE_CALLS = (operator.getitem,)  # besides aten operators that mutate nothing and draw no random numbers


def _constants(model: nn.Module, root: nn.Module | dict[str, Any], nodes: list[fx.Node]) -> frozenset[fx.Node]:
    """The values of an exported graph that depend on no input, no parameter, no persistent or changed buffer
    and no random draw: the positions transformers passes every layer (`arange`), its rotary embedding's cosines
    and sines (from a non-persistent buffer), a causal mask. Each stage that uses one computes it again (a few
    small operations) instead of receiving it: on gloo every tensor of a message is a send of its own (a GPT-2's
    boundary carried the positions beside its hidden state; a Llama's, the cosines and sines too). torch.fx
    graphs (torch functions and modules, not aten operators) have almost none."""
    persistent = set(model.state_dict(keep_vars=True))
    changed = {ancestor for node in nodes if _mutates(node) for argument in node.all_input_nodes
               for ancestor in ancestors(argument)}
    found: set[fx.Node] = set()
    for node in nodes:
        if node.op == "get_attr":
            value = get_attribute(root, node.target) if isinstance(root, nn.Module) else root.get(node.target)
            if isinstance(value, fx.GraphModule):  # the body of a no_grad or autocast block
                if _pure_body(value):
                    found.add(node)
            elif (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not value.requires_grad
                    and node.target not in persistent and node not in changed):
                found.add(node)
        elif node.op == "call_function" and node not in changed and _pure(node) and all(
                argument in found for argument in node.all_input_nodes):
            found.add(node)  # (one without inputs is a factory: arange, ones)
    return frozenset(node for node in found if node.op == "call_function")


_PURE_BLOCKS = (torch.ops.higher_order.wrap_with_set_grad_enabled,  # torch.export's no_grad and autocast blocks
                torch.ops.higher_order.wrap_with_autocast)


def _pure(node: fx.Node) -> bool:
    """Whether a call_function node computes its value from its arguments alone: an aten operator that writes into
    none of them and draws no random numbers, `getitem`, or a no_grad or autocast block (its body checked apart)."""
    target = node.target
    if target in _PURE_CALLS or target in _PURE_BLOCKS:
        return True
    return isinstance(target, torch._ops.OpOverload) and not _mutates(node) and \
        torch.Tag.nondeterministic_seeded not in target.tags


def _pure_body(body: fx.GraphModule) -> bool:
    """Whether every call of a block's body is `_pure`, the bodies of blocks inside it too."""
    for inner in body.graph.nodes:
        if inner.op == "call_function" and not _pure(inner):
            return False
        if inner.op == "get_attr" and isinstance(getattr(body, inner.target, None), fx.GraphModule) \
                and not _pure_body(getattr(body, inner.target)):
            return False
    return True


def _mutates(node: fx.Node) -> bool:
    """Whether the node is an aten operator that writes into one of its arguments (its schema marks it). (A call the
    split keeps whole runs the model's own code on what it is given, as eager mode does; none writes into a value
    of this kind.)"""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and any(
        argument.alias_info is not None and argument.alias_info.is_write for argument in node.target._schema.arguments)


def _stage_module(model: nn.Module, root: nn.Module | dict[str, Any], nodes: list[fx.Node], bounds: list[int],
                  index: int, constants: frozenset[fx.Node] = frozenset()) -> tuple[fx.GraphModule, StageSignature]:
    """The GraphModule of stage `index`: nodes [bounds[index], bounds[index + 1]) of the model's graph, with
    the `constants` it uses computed in it (`_constants`).

    Its submodules and attributes are those of `root` (the model, or the objects an exported graph reads)
    that its nodes use, under the same names; buffers stay out of `state_dict()`
    unless they are persistent buffers of `model` under that name.
    """
    start, stop = bounds[index], bounds[index + 1]
    last = stop == len(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # parameters and buffers read directly: each stage reads its own reference
            env[node] = graph.node_copy(node, lookup)  # (a constant: with what it is computed from)
        return env[node]

    inputs = [node for node in nodes if node.op == "placeholder"] if start == 0 else _crossing(nodes, start, constants)
    for node in inputs:
        env[node] = graph.node_copy(node) if start == 0 else graph.placeholder(node.name)
        env[node].meta = dict(node.meta)  # export's example value: the stage's input shapes
    for node in nodes[start:stop]:
        if node.op not in ("placeholder", "get_attr", "output") and node not in constants:
            env[node] = graph.node_copy(node, lookup)
    if last:
        output_node = nodes[-1]
        result = graph.output(fx.node.map_arg(output_node.args[0], lookup))
        output_names = tuple(node.name for node in _nodes_in(result.args[0]))
    else:
        outputs = _crossing(nodes, stop, constants)
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
