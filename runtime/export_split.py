"""Captures a model with torch.export (non-strict, training mode) as an fx graph that reads the model's own tensors.

`capture(model, example_inputs)` runs `torch.export.export(model, inputs, strict=False)` and
rewrites the exported program's graph so that it can be cut into stages like a torch.fx trace:
- lifted parameters and buffers become `get_attr` nodes under their fully qualified names in
  the model (tied weights keep each name the model's forward reads them by), so a stage built
  from the graph holds the model's own Parameter objects;
- lifted tensor constants become `get_attr` nodes of a name of their own (`_pipeline_constants.*`);
- the user inputs stay placeholders, in the order of `example_inputs`;
- the output returns the model's outputs, rebuilt into the model's own structure (a tensor, a
  tuple, a `ModelOutput`) by `torch.utils._pytree.tree_unflatten` when it is not a single tensor.

Each call node keeps the `nn_module_stack` export recorded; `first_nodes` uses it to find
where each module's first call begins. Export writes the capture device into the graph;
`follow_input_device` makes a stage use the device of its inputs instead, so stages captured
on the CPU run on each rank's GPU. The graph is specialised to the example's shapes and to
the model's training mode at capture: `ShapeGuard` refuses other shapes with one line.
What export cannot capture (branches or loops on tensor values, such as mixture-of-experts
routing) is exported again with the module it runs in kept whole (`runtime.kept_modules`) where that
module encloses no split point; otherwise it raises `ExportFailure` naming the file, line and code of
the construct.

One such branch is captured anyway: a layer skipped at random, `if torch.rand([]) < p` (LayerDrop, which
transformers 4.x models such as BART, OPT, Marian and Whisper draw in every layer in training even where
p is 0). Where the first capture fails on a value that depends on tensors, the model is captured again
with each scalar `torch.rand` fixed (`runtime.random_skips`): with p <= 0 or p >= 1 the outcome is the same
for every draw, so the graph holds it and no draw; with p strictly between, the skip is random in training
and a pipeline's stages are fixed, so ExportFailure says to set p to 0.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from planner.profiling.generation_cache import generation_cache_off
from runtime.checkpointed import CheckpointCalls
from runtime.custom_functions import FunctionCalls
from runtime.kept_modules import KeptModule, KeptModules, failing_modules
from runtime.model_state import model_state, restore_model_state
from runtime.opaque_calls import OpaqueCalls, place_opaque_calls, refusal
from runtime.random_skips import TORCH_DIR, ScalarDraws
from runtime.stage_types import StageSplitError

__all__ = ["CapturedModel", "ExportFailure", "ShapeGuard", "ancestors", "capture", "first_nodes", "follow_input_device",
           "get_attribute", "modules_inside_blocks"]

_OUTPUT_SPEC = "_pipeline_output_spec"  # get_attr target of the output's pytree spec


class ExportFailure(Exception):
    """torch.export could not capture the model; `construct` says what and where, in one line."""

    def __init__(self, construct: str) -> None:
        super().__init__(construct)
        self.construct = construct


@dataclass
class CapturedModel:
    """The model's forward as one fx graph over its own tensors (see the module docstring).

    `attributes`: every `get_attr` target of the graph -> the object it reads (the model's
    Parameters and buffers by their names in the model; lifted constants, export's
    sub-graphs of higher-order operators, the output spec). `training`: the mode at capture;
    `device`: the example inputs' device, which export writes into factory calls.
    """

    graph: fx.Graph
    attributes: dict[str, Any]
    training: bool
    device: torch.device | None = None


def capture(model: nn.Module, example_inputs: Sequence[Any], split_points: Sequence[str] = ()) -> CapturedModel:
    """Export `model` at `example_inputs` and rewrite the graph to read the model's own tensors (a module that
    encloses none of `split_points` may be kept whole: `runtime.kept_modules`), a transformers model's generation
    cache turned off (`planner.profiling.generation_cache`)."""
    inputs = tuple(example_inputs)
    with generation_cache_off(model):  # a transformers cache is not tensors, and no training step reads it
        program, kept = _export(model, inputs, split_points)
    captured = _rewrite(model, program, inputs)
    _place_kept(captured, kept)
    _causal_kept_calls(captured)
    _causal_attention(captured)
    _grouped_attention(captured)
    return captured


def first_nodes(graph: fx.Graph, names: Sequence[str]) -> dict[str, fx.Node]:
    """For each module name, the first graph node its (first) call made, by `nn_module_stack`."""
    wanted = set(names)
    found: dict[str, fx.Node] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or _unpacks_block(node):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        for path, _kind in stack.values():
            if path in wanted and path not in found:
                found[path] = node
        if len(found) == len(wanted):
            break
    return found


def modules_inside_blocks(graph: fx.Graph, attributes: dict[str, Any]) -> dict[str, fx.Node]:
    """Modules that begin inside a `torch.no_grad()` / `torch.autocast` block of an enclosing forward -> the block.

    Export captures such a block as one higher-order operation whose sub-graph runs the
    modules; no cut can fall between them. (A block inside a module's own forward is not
    listed: the module begins at or before the block.)
    """
    inside: dict[str, fx.Node] = {}
    for node in graph.nodes:
        if not _is_block(node):
            continue
        own = {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()}
        for argument in node.args:
            body = attributes.get(argument.target) if isinstance(argument, fx.Node) and argument.op == "get_attr" else None
            if isinstance(body, fx.GraphModule):
                for inner in body.graph.nodes:
                    for path, _ in (inner.meta.get("nn_module_stack") or {}).values():
                        if path not in own:
                            inside.setdefault(path, node)
    return inside


def _is_block(node: fx.Node) -> bool:
    """True for a higher-order operation (export's capture of a no_grad/autocast block)."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _unpacks_block(node: fx.Node) -> bool:
    """True for a `getitem` of a block's results (export gives it the stack of the block's last module)."""
    return node.target is operator.getitem and isinstance(node.args[0], fx.Node) and _is_block(node.args[0])


def follow_input_device(module: fx.GraphModule, captured: torch.device) -> None:
    """Make a graph create, move and check tensors on the device of its first tensor input, not on `captured`.

    Export writes the capture device into the graph (`arange(..., device=cpu)`, `to(device=cpu)`,
    metadata asserts, autocast's device type); a stage moved to another device (a rank's GPU)
    must use its own. Sub-graphs of higher-order operators are rewritten the same way, once.
    """
    graph = module.graph
    for node in graph.nodes:
        child = get_attribute(module, node.target) if node.op == "get_attr" else None
        if isinstance(child, fx.GraphModule) and not getattr(child, "_follows_input_device", False):
            follow_input_device(child, captured)
    module._follows_input_device = True
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    first = next((node for node in placeholders if isinstance(node.meta.get("val"), torch.Tensor)), None)
    pinned = [node for node in graph.nodes if node.op == "call_function" and _pins(node, captured)]
    if first is None or not pinned:
        return
    with graph.inserting_after(placeholders[-1]):
        device = graph.call_function(getattr, (first, "device"))
    with graph.inserting_after(device):
        device_type = graph.call_function(getattr, (device, "type"))  # autocast takes the type's name
    for node in pinned:
        node.kwargs = {key: device if _is(value, captured) else value for key, value in node.kwargs.items()}
        node.args = tuple(device if _is(value, captured) else value for value in node.args)
        if node.target is torch.ops.higher_order.wrap_with_autocast and node.args[0] == captured.type:
            node.args = (device_type, *node.args[1:])
    if not device_type.users:
        graph.erase_node(device_type)
    graph.lint()
    module.recompile()


def _is(value: Any, device: torch.device) -> bool:
    """True if `value` is `device` (a torch.device)."""
    return isinstance(value, torch.device) and value == device


def _pins(node: fx.Node, captured: torch.device) -> bool:
    """True if the call names the capture device (a device argument, or autocast's device type)."""
    if any(_is(value, captured) for value in (*node.args, *node.kwargs.values())):
        return True
    return node.target is torch.ops.higher_order.wrap_with_autocast and node.args[:1] == (captured.type,)


class ShapeGuard:
    """Forward pre-hook of an exported stage: one line when it is called at other shapes or in another mode.

    An exported graph has the example's sizes written into its operations (views, masks); run
    at other sizes it would fail deep inside, or compute something else silently.
    """

    def __init__(self, stage: int, shapes: tuple[tuple[int, ...] | None, ...], training: bool) -> None:
        self.stage, self.shapes, self.training = stage, shapes, training

    @staticmethod
    def of(module: nn.Module) -> "ShapeGuard | None":
        """`module`'s guard, None if it has none (it was not exported)."""
        return next((hook for hook in module._forward_pre_hooks.values() if isinstance(hook, ShapeGuard)), None)

    @staticmethod
    def check_shapes(module: nn.Module, args: tuple[Any, ...]) -> None:
        """The shape check of `module`'s guard, without calling it (nothing if it has none)."""
        guard = ShapeGuard.of(module)
        if guard is not None:
            guard._check_shapes(args)

    def check_microbatches(self, chunks: list[tuple[Any, ...]]) -> None:
        """Before a step runs: StageSplitError unless every microbatch's arguments have the captured
        shapes (an uneven split of the batch, e.g. 10 into 3, 3, 2, 2, is refused here rather than on
        its first odd microbatch, mid-step)."""
        sizes = [next((arg.shape[0] for arg in chunk if isinstance(arg, torch.Tensor) and arg.dim()), None)
                 for chunk in chunks]
        try:
            for chunk in chunks:
                self._check_shapes(chunk)
        except StageSplitError as exc:
            total = sum(size or 0 for size in sizes)
            raise StageSplitError(f"{exc}; the batch of {total} splits into microbatches of "
                                  f"{', '.join(str(size) for size in sizes)}: give a batch that {len(chunks)} "
                                  "microbatches of the captured size make") from None

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Raise StageSplitError unless `args` have the captured shapes and the module the captured mode."""
        self._check_shapes(args)
        if module.training != self.training:
            mode = "training" if self.training else "eval"
            raise StageSplitError(
                f"stage {self.stage} was split with torch.export in {mode} mode (dropout and batch norm are fixed "
                "at capture); build the stages again after model.train() / model.eval()"
            )

    def _check_shapes(self, args: tuple[Any, ...]) -> None:
        """StageSplitError naming both shapes unless `args` have the captured ones."""
        shapes = tuple(tuple(arg.shape) if isinstance(arg, torch.Tensor) else None for arg in args)
        if shapes != self.shapes:
            raise StageSplitError(
                f"stage {self.stage} was split with torch.export at input shapes {_shapes(self.shapes)} and was "
                f"called with {_shapes(shapes)}: an exported stage runs only at the shapes it was captured at; "
                "build the stages again with an example microbatch of the shape you train with"
            )


def _shapes(shapes: tuple[tuple[int, ...] | None, ...]) -> str:
    """'[2x8, 2x8x32]' (non-tensors as '-')."""
    return "[" + ", ".join("x".join(map(str, shape)) if shape is not None else "-" for shape in shapes) + "]"


# --- export ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_torch():
    """Keep torch.export's own logging and its partial-graph dump (printed to stderr) off the user's screen."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith("torch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


_KEEP_ROUNDS = 8  # exports with more modules kept whole, at most, after the first data-dependent failure


def _export(model: nn.Module, inputs: tuple[Any, ...], split_points: Sequence[str]) -> tuple[ExportedProgram, list[Any]]:
    """torch.export.export(strict=False) in the model's current mode, each custom autograd Function and each
    checkpointed module call one node that makes the call (`runtime.custom_functions`, `runtime.checkpointed`).
    Where a value depends on tensors: again with scalar draws fixed
    (module docstring), then with the modules the failures run in kept whole (`runtime.kept_modules`), class by
    class. The program and what its `planner_split::apply` nodes stand for; ExportFailure naming what failed."""
    draws: ScalarDraws | None = None
    kept: list[str] = []
    first: Exception | None = None
    for _ in range(_KEEP_ROUNDS + 2):
        calls = OpaqueCalls()
        try:
            with _quiet_torch(), draws or contextlib.nullcontext(), calls, KeptModules(model, kept, inputs), \
                    FunctionCalls(), CheckpointCalls(model, split_points):
                program = torch.export.export(model, inputs, strict=False)
        except Exception as exc:  # any capture failure: say which construct and where
            refused = refusal(exc)
            if refused is not None:
                raise ExportFailure(refused) from None
            if draws is not None and draws.random_skip is not None:
                raise ExportFailure(draws.random_skip) from None
            if not _data_dependent(exc):
                raise ExportFailure(_construct(first or exc)) from exc
            first = first or exc
            if draws is None:
                draws = ScalarDraws()
                continue
            more = failing_modules(model, exc, split_points, kept)
            if not more:
                raise ExportFailure(_construct(first)) from first
            kept += more
            continue
        if draws is not None and not draws.count and not kept:  # the retry passed a branch that is not a draw's
            raise ExportFailure(_construct(first)) from first
        return program, calls.kept
    raise ExportFailure(_construct(first)) from first


def _place_kept(captured: CapturedModel, kept: list[Any]) -> None:
    """Make each `planner_split::apply` node call what it stands for: a custom Function, or a module kept whole
    (which its stage then holds; only in the main graph, not inside a torch.no_grad() or autocast block)."""
    place_opaque_calls(captured.graph, kept, captured.attributes)
    for body in list(captured.attributes.values()):
        if isinstance(body, fx.GraphModule):
            inside: dict[str, Any] = {}
            place_opaque_calls(body.graph, kept, inside)
            if inside:
                raise ExportFailure(f"{', '.join(inside)} cannot be captured and runs inside a torch.no_grad() or "
                                    "torch.autocast block of an enclosing forward")
            body.recompile()


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _causal_attention(captured: CapturedModel) -> None:
    """Attention as eager mode runs it: SDPA calls whose mask depends on no input and is the causal one get
    `is_causal=True` and no mask, and the mask's computation goes.

    Under torch.export transformers materialises the causal mask (an exported model may later run at other
    lengths, where `is_causal` would be wrong); a stage runs only at the example's shapes (`ShapeGuard`), where the
    two agree. The mask cost every layer a saved mask (examples/llama.py: 0.13 MB a layer and microbatch beyond what
    the profiler measures in eager mode) and keeps SDPA on a GPU off its flash kernel. A mask computed from an input
    (padding) stays. The masks are evaluated once here, on the capture device, from the graph's constants alone."""
    calls = {node: _mask_of(node) for node in captured.graph.nodes if node.op == "call_function" and node.target is _SDPA}
    constant = {node: mask for node, mask in calls.items()
                if isinstance(mask, fx.Node) and _from_no_input(mask)}
    if not constant:
        return
    try:
        values = _evaluate(captured, set(constant.values()))
    except Exception:  # an operation that cannot run outside export (a model's own construct): masks stay as they are
        return
    for node, mask in constant.items():
        arguments = dict(zip(_SDPA_ARGUMENTS, node.args)) | dict(node.kwargs)
        if arguments.get("is_causal") or not _is_causal_mask(values[mask]):
            continue
        arguments.update(attn_mask=None, is_causal=True)
        node.args = tuple(arguments.pop(name) for name in _SDPA_ARGUMENTS[:3])
        node.kwargs = {name: value for name, value in arguments.items() if name != "attn_mask"}
    for mask in set(constant.values()):
        _erase_unused(captured.graph, mask)


def _causal_kept_calls(captured: CapturedModel) -> None:
    """Kept calls (a module kept whole, a layer the model checkpoints) given the causal mask take None instead where
    they give the same outputs without it, as eager mode passes them: transformers materialises the mask under
    torch.export only, and its layers take None for causal attention (`is_causal`: SDPA's flash kernel on a GPU,
    and no mask saved by each checkpointed layer). Tried once here for each call, on the capture device: the mask
    (which depends on no input) evaluated, the call's other inputs random of their captured shapes, the module in
    the mode its stage trains in, without gradients (its state and the random state put back after); outputs
    within 1e-5 of each other (an implementation that reads None as "no mask" gives other outputs: it keeps the
    mask). A call with an input that is not floating point, or of no known shape, keeps it."""
    calls = [node for node in captured.graph.nodes
             if node.op == "call_function" and isinstance(node.target, KeptModule)]
    constant = {node: [arg for arg in node.args[1:] if isinstance(arg, fx.Node) and _from_no_input(arg)]
                for node in calls}
    wanted = {arg for args in constant.values() for arg in args}
    if not wanted:
        return
    try:
        values = _evaluate(captured, wanted)
    except Exception:  # an operation that cannot run outside export (a model's own construct): masks stay
        return
    for node in calls:
        for mask in constant[node]:
            if _is_causal_mask(values[mask]) and _same_without(captured, node, mask, values):
                node.args = tuple(None if arg is mask else arg for arg in node.args)
    for mask in wanted:
        _erase_unused(captured.graph, mask)


def _same_without(captured: CapturedModel, node: fx.Node, mask: fx.Node, values: dict[fx.Node, Any]) -> bool:
    """Whether the kept call of `node` gives the same outputs with None for `mask` (`_causal_kept_calls`): both
    runs in the mode the stages train in (a layer may read None otherwise in training), from one random state
    (put back after: a fork of the CPU's, the inputs from a generator of their own, so that no seed moves)."""
    kept: KeptModule = node.target
    module = captured.attributes[node.args[0].target]
    drawn = {arg: arg.meta.get("val") for arg in node.args[1:] if isinstance(arg, fx.Node) and arg not in values}
    if not all(isinstance(value, torch.Tensor) and value.dtype.is_floating_point for value in drawn.values()):
        return False
    device = captured.device or torch.device("cpu")

    def arguments(dropped: bool) -> list[Any]:
        generator = torch.Generator(device=device).manual_seed(0)
        return [None if arg is mask and dropped
                else torch.randn(tuple(drawn[arg].shape), dtype=drawn[arg].dtype, device=device, generator=generator)
                if arg in drawn else values[arg] if isinstance(arg, fx.Node) else arg for arg in node.args[1:]]

    saved = model_state(module)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            module.train(captured.training)
            start = torch.random.get_rng_state()
            outputs = []
            for dropped in (False, True):
                torch.random.set_rng_state(start)
                outputs.append(kept.run_whole(module, *arguments(dropped)))
            given, without = outputs
            return len(given) == len(without) and all(_agree(a, b) for a, b in zip(given, without))
    except Exception:  # the call refuses None there: it keeps its mask
        return False
    finally:
        restore_model_state(saved)


def _agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values: floating point within 1e-5 relative to the larger of 1 and a's largest element."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point() or a.numel() == 0:
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5 * max(float(a.abs().max()), 1.0)))


def _grouped_attention(captured: CapturedModel) -> None:
    """SDPA calls without a mask whose keys and values are repeated over the query heads (transformers' `repeat_kv`:
    reshape(expand(unsqueeze(x, 2))), which it does where a mask is given) take the unrepeated ones with
    `enable_gqa=True`, as eager transformers does without a mask: examples/llama.py then saves 0.26 MB less a layer
    and microbatch (the expanded keys and values), what the profiler measured in eager mode. Same results: SDPA's
    grouped-query attention gives query head i the key and value head i // r, as the repetition does."""
    for node in list(captured.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        arguments = dict(zip(_SDPA_ARGUMENTS, node.args)) | dict(node.kwargs)
        if arguments.get("attn_mask") is not None or arguments.get("enable_gqa"):
            continue
        key, value = _repeated_heads(arguments["key"]), _repeated_heads(arguments["value"])
        if key is None or value is None or key[1] != value[1]:
            continue
        repeated = (arguments["key"], arguments["value"])
        arguments.update(key=key[0], value=value[0], enable_gqa=True)
        node.args = tuple(arguments.pop(name) for name in _SDPA_ARGUMENTS[:3])
        node.kwargs = {name: value for name, value in arguments.items() if name != "attn_mask"}
        for old in repeated:
            _erase_unused(captured.graph, old)


def _repeated_heads(node: Any) -> tuple[fx.Node, int] | None:
    """(x, r) where `node` is reshape(expand(unsqueeze(x, 2), [b, h, r, s, d]), [b, h r, s, d]) of a 4-d x of h heads
    (the shapes as export recorded them); None otherwise."""
    reshapes = (torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    if not isinstance(node, fx.Node) or node.target not in reshapes:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not torch.ops.aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target is not torch.ops.aten.unsqueeze.default \
            or unsqueeze.args[1] not in (2, -3):
        return None
    x = unsqueeze.args[0]
    shapes = [getattr(item.meta.get("val"), "shape", None) if isinstance(item, fx.Node) else None
              for item in (x, expand, node)]
    if any(shape is None for shape in shapes) or len(shapes[0]) != 4:
        return None
    (b, h, length, d), expanded, out = (tuple(shape) for shape in shapes)
    repeats = expanded[2] if len(expanded) == 5 else 0
    if expanded != (b, h, repeats, length, d) or out != (b, h * repeats, length, d) or repeats < 2:
        return None
    return x, repeats


def _mask_of(node: fx.Node) -> Any:
    """The attn_mask argument of an SDPA call node (None if not given)."""
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node `node` is computed from, itself included."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(current.all_input_nodes)
    return found


def _from_no_input(node: fx.Node) -> bool:
    """Whether `node`'s value is computed from no input of the graph (shapes are fixed at capture)."""
    return not any(ancestor.op == "placeholder" for ancestor in ancestors(node))


def _evaluate(captured: CapturedModel, wanted: set[fx.Node]) -> dict[fx.Node, Any]:
    """The values of `wanted` nodes, which depend on no placeholder: their ancestors run in graph order."""
    needed = set().union(*(ancestors(node) for node in wanted))
    values: dict[fx.Node, Any] = {}
    for node in captured.graph.nodes:
        if node not in needed:
            continue
        if node.op == "get_attr":
            values[node] = captured.attributes[node.target]
        else:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda used: values[used])
            values[node] = node.target(*args, **kwargs)
    return {node: values[node] for node in wanted}


def _is_causal_mask(mask: Any) -> bool:
    """Whether `mask` (boolean: True attends; or additive float: 0 attends) is SDPA's is_causal mask: square in its
    last two dimensions, query i attending to keys 0..i alone, for every batch and head it broadcasts over."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2] or not (
            mask.dtype == torch.bool or mask.dtype.is_floating_point):  # (a kept call may be given integer ones)
        return False
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    attends = mask if mask.dtype == torch.bool else mask == 0
    if mask.dtype != torch.bool and not bool(torch.all(mask[..., ~causal] <= torch.finfo(mask.dtype).min / 2)):
        return False
    return bool(torch.equal(attends, causal.expand_as(attends)))


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` if nothing uses it, then each of its inputs that this leaves unused (not placeholders)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if current.users or current.op in ("placeholder", "output"):
            continue
        inputs = current.all_input_nodes
        graph.erase_node(current)
        stack.extend(inputs)


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)')


def _data_dependent(exc: Exception) -> bool:
    """Whether export failed on a branch, loop bound or size that depends on tensor values."""
    return "data-dependent" in str(exc) or "GuardOnDataDependent" in type(exc).__name__


def _construct(exc: Exception) -> str:
    """What the model did that export cannot capture, with the user's file:line and code when known."""
    message = str(exc)
    unknown = re.search(r"Found <class '([\w.]+)'> in output", message)
    if unknown:
        return (f"the forward returns a {unknown.group(1).rsplit('.', 1)[-1]}, which is not tensors: make it return "
                "a tensor, or a tuple, list or dict of tensors")
    if _data_dependent(exc):
        what = "control flow (if/while/loop bounds) or a size depends on tensor values"
    else:
        first = next((line.strip() for line in message.splitlines() if line.strip()), "")
        what = f"{type(exc).__name__}: {first[:200]}"
    frames = [match for match in _USER_FRAME.finditer(message)
              if not os.path.abspath(match.group(1)).startswith(TORCH_DIR)]
    if frames:
        path, line, function, code = frames[-1].groups()
        return f"{what}, at {path.rsplit('/', 1)[-1]}:{line} in {function}: `{code.strip()}`"
    return what


# --- rewrite -----------------------------------------------------------------------------------


def _rewrite(model: nn.Module, program: ExportedProgram, inputs: tuple[Any, ...]) -> CapturedModel:
    """The exported graph with lifted state read through get_attr (see the module docstring)."""
    signature = program.graph_signature
    unsupported = [spec for spec in signature.output_specs if spec.kind != OutputKind.USER_OUTPUT]
    if unsupported:
        kinds = sorted({spec.kind.name.lower().replace("_", " ") for spec in unsupported})
        raise ExportFailure(f"the forward mutates state export lifts as outputs ({', '.join(kinds)}), "
                            "which a split graph cannot write back")
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for name, value in state.items():
        aliases.setdefault(id(value), []).append(name)
    by_input = {spec.arg.name: spec for spec in signature.input_specs}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attributes: dict[str, Any] = {}
    user_inputs = [node for node in program.graph.nodes
                   if node.op == "placeholder" and by_input[node.name].kind == InputKind.USER_INPUT]
    for node in user_inputs:  # first, as in a torch.fx trace
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    lifted: dict[fx.Node, tuple[str, Any]] = {}
    reads: dict[str, fx.Node] = {}

    def read(arg: fx.Node, user: fx.Node) -> fx.Node:
        """The value of `arg` for `user`; a lifted tensor is read by the name `user`'s module knows it by."""
        if arg not in lifted:
            return env[arg]
        target, value = lifted[arg]
        target = _name_for(user, aliases.get(id(value), []), target)
        attributes[target] = value
        if target not in reads:
            reads[target] = graph.get_attr(target)
            reads[target].meta = dict(arg.meta)
        return reads[target]

    for node in program.graph.nodes:
        if node in env:
            continue
        if node.op == "placeholder":
            spec = by_input[node.name]
            lifted[node] = _lifted(spec, state, program)
        elif node.op == "output":
            outputs = [read(arg, node) for arg in node.args[0]]
            graph.output(_structured(graph, outputs, program, attributes))
        else:
            env[node] = graph.node_copy(node, lambda arg, user=node: read(arg, user))
            if node.op == "get_attr":  # export's sub-graphs of higher-order operators
                attributes[node.target] = get_attribute(program.graph_module, node.target)
    tensors = [value for value in inputs if isinstance(value, torch.Tensor)]
    if len(user_inputs) != len(inputs) or len(tensors) != len(inputs):
        raise ExportFailure(f"the example inputs must be tensors passed positionally, got "
                            f"{[type(value).__name__ for value in inputs]}")
    graph.lint()
    return CapturedModel(graph, attributes, model.training, tensors[0].device if tensors else None)


def _name_for(user: fx.Node, names: list[str], default: str) -> str:
    """Of a tensor's names in the model, the one under the innermost module running `user` (tied weights).

    Export lifts a tied weight once, under one of its names; the embedding that reads
    `transformer.wte.weight` should hold it under that name, the head under `lm_head.weight`.
    """
    stack = user.meta.get("nn_module_stack") or {}
    for path, _kind in reversed(list(stack.values())):
        prefix = f"{path}." if path else ""
        inside = [name for name in names if name.startswith(prefix)]
        if inside:
            return min(inside, key=lambda name: (name.count("."), name))
    return default


def _lifted(spec: Any, state: dict[str, torch.Tensor], program: ExportedProgram) -> tuple[str, Any]:
    """(get_attr target, value) of a lifted parameter, buffer or constant."""
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target in state:
        return spec.target, state[spec.target]
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
        value = program.constants.get(spec.target, program.state_dict.get(spec.target))
        if isinstance(value, torch.Tensor):
            return "_pipeline_constants." + re.sub(r"\W", "_", spec.target), value
    raise ExportFailure(f"the exported graph takes a {spec.kind.name.lower()} input ({spec.target}) "
                        "that a split graph cannot hold")


def _structured(graph: fx.Graph, outputs: list[fx.Node], program: ExportedProgram,
                attributes: dict[str, Any]) -> Any:
    """The output argument: the single tensor, or the flat outputs rebuilt into the model's structure."""
    spec = program.call_spec.out_spec
    if spec is None or spec.is_leaf():
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    attributes[_OUTPUT_SPEC] = spec
    return graph.call_function(pytree.tree_unflatten, (list(outputs), graph.get_attr(_OUTPUT_SPEC)))


def get_attribute(module: nn.Module, target: str) -> Any:
    """The attribute `target` ("a.b.c") of `module`."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value
