"""One graph node for a call the split keeps whole: the arguments the node holds, and the operator torch.export records.

A custom autograd Function (`runtime.custom_functions`), a module export cannot capture (`runtime.kept_modules`)
and a checkpointed module call (`runtime.checkpointed`) each become one node that makes the call at run time.
- `Arguments` holds a call's (args, kwargs) with the traced values taken out: the node passes those, the rest
  (numbers, flags, None, devices, other objects) it holds. An object it would hold that holds a traced value
  itself (an attribute, not a pytree node) is refused: the node would replay the capture's value at every run.
  A device equal to the one the model was captured on
  follows the device of the call's first tensor at run time, as export's own factory calls do
  (`runtime.export_split.follow_input_device`).
- Under torch.export, `OpaqueCalls` collects what each call stands for, and `opaque_call` records it as the opaque
  operator `planner_split::apply(int call, Tensor[] tensors) -> Tensor[]` (its fake kernel makes tensors shaped
  like the `outputs` the call gave at capture). `place_opaque_calls` then makes each such node make its call:
  `kept.place(graph, node, tensors, attributes)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import _AttrProxy, disable_proxy_modes_tracing
from torch.utils import _pytree as pytree

__all__ = ["PASSED", "Arguments", "CallRefused", "OpaqueCalls", "members", "opaque_call", "output_tensors",
           "place_opaque_calls", "real_module", "refusal", "unrecorded"]

PASSED = object()  # in Arguments.constants: a value the graph passes
_CAPTURING: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("planner_split_calls")


class CallRefused(Exception):
    """A call the split cannot keep whole; the message is the one line to show (a tracer may wrap the error:
    `refusal` finds it)."""


def real_module(value: Any) -> Any:
    """The model's own module behind `value` where torch.export hands out a stand-in for it (it does for every
    module of a model holding one module under two names, T5's shared embedding: `_AttrProxy`, a subclass of the
    module's class that shares its attributes), else `value` itself."""
    return value.get_base() if isinstance(value, _AttrProxy) else value


def refusal(exc: BaseException) -> str | None:
    """The message of a CallRefused in `exc`'s chain (causes and contexts), None if none."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        if isinstance(error, CallRefused):
            return str(error)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@dataclass
class Arguments:
    """A call's (args, kwargs) as the pytree `spec` of their leaves: `constants` holds each leaf the node keeps,
    `PASSED` where the graph passes a value; `device`: the capture device of the first value passed (None if none)."""

    spec: pytree.TreeSpec
    constants: list[Any]
    device: torch.device | None

    @staticmethod
    def of(args: tuple[Any, ...], kwargs: dict[str, Any], passed: Callable[[Any], bool],
           callee: str) -> tuple["Arguments", list[Any]]:
        """The call's Arguments, and the leaves for which `passed` holds, which the graph is to pass, in order;
        CallRefused if a leaf it would hold holds a traced value (`callee` names the call in the message)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        leaves = [real_module(leaf) for leaf in leaves]
        values = [leaf for leaf in leaves if passed(leaf)]
        for leaf in leaves:
            where = None if passed(leaf) else _traced_inside(leaf)
            if where is not None:
                raise CallRefused(
                    f"{callee}, which the split keeps whole, is given a {type(leaf).__name__} object holding a value "
                    f"computed in the forward ({type(leaf).__name__}{where}): the split would keep the value the "
                    f"capture saw; pass the tensor itself, or make {type(leaf).__name__} a pytree node "
                    "(torch.utils._pytree.register_dataclass)")
        device = next((leaf.device for leaf in values if isinstance(leaf, torch.Tensor)), None)
        return Arguments(spec, [PASSED if passed(leaf) else leaf for leaf in leaves], device), values

    def rebuild(self, values: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's (args, kwargs) with `values` in their places (and the capture device followed)."""
        given = iter(values)
        now = next((value.device for value in values if isinstance(value, torch.Tensor)), self.device)
        leaves = [next(given) if constant is PASSED
                  else now if isinstance(constant, torch.device) and constant == self.device
                  else constant for constant in self.constants]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs


def _traced(value: Any) -> bool:
    """Whether `value` exists only while a capture runs: a torch.fx proxy, or a tensor of export's fake mode."""
    return isinstance(value, fx.Proxy) or (isinstance(value, torch.Tensor) and is_fake(value))


def _traced_inside(value: Any, depth: int = 3) -> str | None:
    """Where `value` holds a traced value among its `members` (".scale", ".parts[1]"), `depth` levels down; None
    if nowhere."""
    for place, item in members(value) if depth > 0 else ():
        if _traced(item):
            return place
        inner = _traced_inside(item, depth - 1)
        if inner is not None:
            return place + inner
    return None


def members(value: Any) -> list[tuple[str, Any]]:
    """What an argument a call keeps holds, one level down, each with where (".scale", "[1]", ".args[0]"): the
    items of a list, tuple or dict, a partial's function and arguments, a plain object's attributes; none for
    modules, tensors, classes, functions and bound methods (their objects are the caller's to look at)."""
    if isinstance(value, (list, tuple)):
        return [(f"[{index}]", item) for index, item in enumerate(value)]
    if isinstance(value, dict):
        return [(f"[{key!r}]", item) for key, item in value.items()]
    if isinstance(value, functools.partial):
        return [(".func", value.func), *((f".args[{index}]", item) for index, item in enumerate(value.args)),
                *((f".keywords[{key!r}]", item) for key, item in value.keywords.items())]
    plain = not isinstance(value, (nn.Module, type, torch.Tensor, types.FunctionType, types.MethodType,
                                   types.BuiltinFunctionType))
    return [(f".{key}", item) for key, item in vars(value).items()] if plain and hasattr(value, "__dict__") else []


class OpaqueCalls:
    """Within the block (one torch.export), `opaque_call` records calls; `kept` lists them by number."""

    def __init__(self) -> None:
        self.kept: list[Any] = []
        self._token: contextvars.Token[list[Any]] | None = None

    def __enter__(self) -> "OpaqueCalls":
        self._token = _CAPTURING.set(self.kept)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        assert self._token is not None
        _CAPTURING.reset(self._token)


def capturing() -> bool:
    """Whether an OpaqueCalls block is open in this thread (a torch.export capture)."""
    return _CAPTURING.get(None) is not None


def opaque_call(kept: Any, tensors: list[torch.Tensor], output: Any) -> Any:
    """Inside an OpaqueCalls block, under torch.export: one operator node standing for `kept` applied to `tensors`,
    whose call gave `output` at capture (`kept.outputs` keeps its tensors, for their shapes); `output` with the
    graph's values in place of its tensors."""
    kept.outputs = output_tensors(output)
    calls = _CAPTURING.get()
    calls.append(kept)
    values = iter(torch.ops.planner_split.apply(len(calls) - 1, tensors))
    leaves, spec = pytree.tree_flatten(output)
    return pytree.tree_unflatten([next(values) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Inside torch.export's capture: operations that run on its fake tensors without entering the graph (grad-mode
    changes included), to learn a call's output. Sizes they make that depend on data (a mixture of experts'
    routing: `torch.where`, `nonzero`) are let go, as the graph never sees them (export would otherwise refuse
    symbols its outputs do not hold: transformers 4.46's Mixtral checkpointed)."""
    fake_mode = detect_fake_mode()
    shape_env = getattr(fake_mode, "shape_env", None)
    fresh = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
    with disable_proxy_modes_tracing(), torch._C.DisableTorchFunction(), fresh:
        yield


def place_opaque_calls(graph: fx.Graph, kept: list[Any], attributes: dict[str, Any]) -> None:
    """Make each operator node of `graph` make the call it stands for (`kept[call].place`; a node may have its
    stage hold an object under a name, in `attributes`). The capture's fake outputs are let go."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.planner_split.apply.default:
            call, tensors = node.args
            kept[call].place(graph, node, tensors, attributes)
            kept[call].outputs = []


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) output, in pytree order."""
    return [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]


def _fake_apply(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The operator on export's fake tensors: new tensors like the outputs the call gave at capture."""
    return [torch.empty_strided(output.shape, output.stride(), dtype=output.dtype, device=output.device)
            for output in _CAPTURING.get()[call].outputs]


def _define_operator() -> torch.library.Library:
    """Register `planner_split::apply` once per process (torch's operator registry is process-wide)."""
    library = torch.library.Library("planner_split", "FRAGMENT")
    if not hasattr(torch.ops.planner_split, "apply"):
        library.define("apply(int call, Tensor[] tensors) -> Tensor[]")
        torch.library.register_fake("planner_split::apply", _fake_apply, lib=library)
    return library


_LIBRARY = _define_operator()
