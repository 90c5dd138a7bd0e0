"""Custom autograd Functions at the split: each call is one node of the captured graph, which applies it as written.

torch.fx and torch.export both trace into a custom `torch.autograd.Function`: left alone, the graph records the
operations of its `forward`, and autograd differentiates those instead of running its own `backward`. That trains
a gradient reversal layer with its sign flipped and a straight-through estimator with a zero gradient, and loses
the memory a hand-written derivative saves (BLOOM's GeLU keeps its input; autograd of its forward's operations
keeps more: x1.67 the saved activations of a split BLOOM).

While `FunctionCalls` is open, a custom Function applied to traced values makes one graph node whose target is a
`KeptFunction`: at run time that applies the Function to its arguments, so autograd records the Function's own
backward, as in eager mode (its memory, its random draws, `mark_dirty`, `ctx.needs_input_grad`).
- torch.fx (arguments holding Proxies): a `call_function` node of the KeptFunction, returning what the Function
  returns.
- torch.export (fake tensors): the opaque operator `planner_split::apply(int call, Tensor[] tensors) -> Tensor[]`,
  which export records as one node; its fake kernel runs the Function for the output's structure and shapes.
  `keep_functions` then makes each such node call its KeptFunction, which returns the output's tensors as a list.
The non-tensor arguments (and, under torch.fx, tensors that are constants of the trace) are held by the
KeptFunction; the graph passes the rest. torch's own Functions (reentrant checkpointing and the like) are traced
as before.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
from types import TracebackType
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.autograd.function import FunctionMeta, _is_setup_context_defined
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils import _pytree as pytree

from runtime.random_skips import TORCH_DIR

__all__ = ["FunctionCalls", "KeptFunction", "keep_functions", "opaque_call", "output_tensors"]

_APPLY = torch.autograd.Function.__dict__["apply"].__func__
_ABSENT = object()
_CAPTURING: contextvars.ContextVar[list["KeptFunction"]] = contextvars.ContextVar("planner_split_calls")
_RUNNING = contextvars.ContextVar("planner_split_running", default=False)  # the fake kernel runs the Function


class KeptFunction:
    """One call of a custom autograd Function as the target of a graph node.

    `node(*tensors)` applies `function` to the call's arguments with `tensors` in the places the graph fills
    (`spec`: the pytree of (args, kwargs); `constants`: its leaves, None where a tensor goes); returns the
    Function's output, or with `flat` the output's tensors as a list (the operator's form, under torch.export).
    """

    def __init__(self, function: type, spec: pytree.TreeSpec, constants: list[Any], flat: bool) -> None:
        self.function = function
        self.spec = spec
        self.constants = constants
        self.flat = flat
        self.outputs: list[torch.Tensor] = []  # under torch.export: the output's tensors at capture (fake)
        self.__name__ = f"{function.__name__}_apply"  # torch.fx's generated code names its targets by these
        self.__module__ = function.__module__

    def arguments(self, tensors: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's (args, kwargs) with `tensors` in their places."""
        given = iter(tensors)
        leaves = [next(given) if constant is None else constant for constant in self.constants]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs

    def __call__(self, *tensors: torch.Tensor) -> Any:
        args, kwargs = self.arguments(tensors)
        output = _APPLY(self.function, *args, **kwargs)
        return output_tensors(output) if self.flat else output

    def place(self, graph: fx.Graph, node: fx.Node, tensors: Sequence[fx.Node], attributes: dict[str, Any]) -> None:
        """Make the operator's `node` call this (it returns the same list)."""
        node.target = self
        node.args = tuple(tensors)

    def __repr__(self) -> str:
        return f"{self.function.__qualname__}.apply"


class FunctionCalls:
    """Within the block, each custom autograd Function applied to traced values becomes one graph node (module
    docstring); `kept` lists those torch.export met, by the number the operator's nodes carry.

    The `forward` (and `setup_context`, where defined) of each custom Function class are replaced, and put back
    after: those that exist when the block begins and those defined inside it (the metaclass's `__init__` is
    replaced too). `Function.apply` looks them up at each call, so an `apply` bound before the capture
    (`gelu = GeLUFunction.apply`, a model attribute) is caught too.
    """

    def __init__(self) -> None:
        self.kept: list[KeptFunction] = []
        self._replaced: list[tuple[type, str, Any]] = []  # (class, attribute, its own __dict__ entry or _ABSENT)
        self._token: contextvars.Token[list[KeptFunction]] | None = None

    def __enter__(self) -> "FunctionCalls":
        self._token = _CAPTURING.set(self.kept)
        for cls in _custom_functions():
            self._keep(cls)
        created = FunctionMeta.__dict__["__init__"]

        def creating(cls: type, *args: Any, **kwargs: Any) -> None:  # a Function class defined during the capture
            created(cls, *args, **kwargs)
            if not _torchs_own(cls):
                self._keep(cls)

        self._replace(FunctionMeta, "__init__", creating)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for cls, attribute, own in reversed(self._replaced):
            if own is _ABSENT:
                delattr(cls, attribute)
            else:
                setattr(cls, attribute, own)
        self._replaced.clear()
        assert self._token is not None
        _CAPTURING.reset(self._token)

    def _keep(self, cls: type) -> None:
        """Replace the class's forward (and setup_context) for the capture."""
        with_context = _is_setup_context_defined(cls.setup_context)
        self._replace(cls, "forward", staticmethod(_kept_forward(cls, cls.forward, with_context)))
        if with_context:
            self._replace(cls, "setup_context", staticmethod(_kept_setup_context(cls.setup_context)))

    def _replace(self, owner: type, attribute: str, value: Any) -> None:
        self._replaced.append((owner, attribute, owner.__dict__.get(attribute, _ABSENT)))
        setattr(owner, attribute, value)


def opaque_call(kept: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Under torch.export, inside a FunctionCalls block: one `planner_split::apply` node standing for `kept` (a
    KeptFunction or a `runtime.kept_modules.KeptModule`: its `outputs` give the shapes) applied to `tensors`."""
    calls = _CAPTURING.get()
    calls.append(kept)
    return torch.ops.planner_split.apply(len(calls) - 1, tensors)


def keep_functions(graph: fx.Graph, kept: list[Any], attributes: dict[str, Any]) -> None:
    """Make each `planner_split::apply` node of `graph` call what it stands for (`kept[call].place`; a kept
    module's stage reads it from `attributes`)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.planner_split.apply.default:
            call, tensors = node.args
            kept[call].place(graph, node, tensors, attributes)


def _custom_functions() -> list[type]:
    """Every subclass of torch.autograd.Function defined outside torch, now."""
    found: dict[type, None] = {}
    stack = list(torch.autograd.Function.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if not _torchs_own(cls):
            found[cls] = None
    return list(found)


def _kept_forward(cls: type, forward: Callable[..., Any], with_context: bool) -> Callable[..., Any]:
    """`cls.forward` while a capture runs: a call on traced values becomes one graph node."""

    def kept_forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _RUNNING.get():
            return forward(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args if with_context else args[1:], kwargs))  # without the ctx
        proxies = [leaf for leaf in leaves if isinstance(leaf, fx.Proxy)]
        if proxies:  # torch.fx
            kept = KeptFunction(cls, spec, [None if isinstance(leaf, fx.Proxy) else leaf for leaf in leaves], False)
            return proxies[0].tracer.create_proxy("call_function", kept, tuple(proxies), {})
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if not tensors:
            return forward(*args, **kwargs)
        kept = KeptFunction(cls, spec, [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], True)
        with disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():  # not recorded, grad mode included
            output = _run(kept, tensors)  # the Function itself on export's fake tensors (torch.export)
        leaves, output_spec = pytree.tree_flatten(output)
        kept.outputs = output_tensors(output)
        given = iter(opaque_call(kept, tensors))
        return pytree.tree_unflatten([next(given) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
                                     output_spec)

    return _same_parameters(forward, kept_forward)


def _same_parameters(function: Callable[..., Any], body: Callable[[tuple[Any, ...], dict[str, Any]], Any]
                     ) -> Callable[..., Any]:
    """A function with `function`'s parameters (names, kinds, defaults) that returns body(positional, keywords).

    Function.apply places keyword arguments by the parameter names of the forward's code object, so a stand-in
    for a forward must have the same ones.
    """
    namespace: dict[str, Any] = {"_body": body}
    parameters, positional, keywords = [], [], []
    for index, parameter in enumerate(inspect.signature(function).parameters.values()):
        if parameter.default is not inspect.Parameter.empty:
            namespace[f"_default{index}"] = parameter.default
            parameter = parameter.replace(default=_Named(f"_default{index}"))
        parameters.append(parameter.replace(annotation=inspect.Parameter.empty))
        name, kind = parameter.name, parameter.kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            positional.append(f"*{name}")
        elif kind is inspect.Parameter.KEYWORD_ONLY:
            keywords.append(f"{name!r}: {name}")
        elif kind is inspect.Parameter.VAR_KEYWORD:
            keywords.append(f"**{name}")
        else:
            positional.append(name)
    declared = inspect.Signature(parameters)
    exec(f"def stand_in{declared}:\n    return _body(({''.join(item + ', ' for item in positional)}), "  # noqa: S102
         f"{{{', '.join(keywords)}}})\n", namespace)  # source made of the forward's own parameter names
    return functools.update_wrapper(namespace["stand_in"], function)


class _Named:
    """A default value that a signature writes as `name`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _kept_setup_context(setup_context: Callable[..., Any]) -> Callable[..., Any]:
    """`cls.setup_context` while a capture runs: nothing to save for a node that applies the Function later."""

    @functools.wraps(setup_context)
    def kept_setup_context(*args: Any, **kwargs: Any) -> Any:
        return setup_context(*args, **kwargs) if _RUNNING.get() else None

    return kept_setup_context


def _run(kept: KeptFunction, tensors: list[torch.Tensor]) -> Any:
    """The Function applied to copies of `tensors` (not leaves, so in-place Functions run, as in a model), with
    autograd on: what it returns."""
    token = _RUNNING.set(True)
    try:
        with torch.enable_grad():
            copies = [tensor.detach().requires_grad_(True).clone() if tensor.requires_grad else tensor.detach()
                      for tensor in tensors]
            args, kwargs = kept.arguments(copies)
            return _APPLY(kept.function, *args, **kwargs)
    finally:
        _RUNNING.reset(token)


def _fake_apply(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The operator on export's fake tensors: new tensors like the outputs the Function gave at capture."""
    return [torch.empty_strided(output.shape, output.stride(), dtype=output.dtype, device=output.device)
            for output in _CAPTURING.get()[call].outputs]


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) output, in pytree order."""
    return [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]


def _define_operator() -> torch.library.Library:
    """Register `planner_split::apply` once per process (torch's operator registry is process-wide)."""
    library = torch.library.Library("planner_split", "FRAGMENT")
    if not hasattr(torch.ops.planner_split, "apply"):
        library.define("apply(int call, Tensor[] tensors) -> Tensor[]")
        torch.library.register_fake("planner_split::apply", _fake_apply, lib=library)
    return library


_LIBRARY = _define_operator()


def _torchs_own(cls: type) -> bool:
    """Whether the Function is defined inside torch."""
    try:
        return os.path.abspath(inspect.getfile(cls)).startswith(TORCH_DIR)
    except (TypeError, OSError):
        return False
