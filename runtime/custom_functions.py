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
  returns; tensors that are constants of the trace (buffers) are passed by the graph, as its attributes.
- torch.export (fake tensors): the Function runs on export's fake tensors, unrecorded, for its output's structure
  and shapes, and the call is one opaque operator (`runtime.opaque_calls`) that then calls the KeptFunction, which
  returns the output's tensors as a list.
The non-tensor arguments are held by the KeptFunction (`runtime.opaque_calls.Arguments`); a parameter the caller
left out stays out. torch's own Functions (reentrant checkpointing: `runtime.checkpointed`) are not replaced here,
and a forward called directly (not by `apply`) runs as written.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import BackwardCFunction, FunctionMeta, _is_setup_context_defined
from torch.utils import _pytree as pytree

from runtime.opaque_calls import Arguments, capturing, opaque_call, output_tensors, unrecorded
from runtime.patches import Patches
from runtime.random_skips import TORCH_DIR

__all__ = ["FunctionCalls", "KeptFunction"]

_APPLY = torch.autograd.Function.__dict__["apply"].__func__
_NOT_GIVEN = object()  # a parameter the caller left out: the stand-in's default for each one
_RUNNING = contextvars.ContextVar("planner_split_running", default=False)  # the Function itself runs, for shapes


class KeptFunction:
    """One call of a custom autograd Function as the target of a graph node.

    `node(*values)` applies `function` to the call's `arguments` with the graph's values in their places; returns
    the Function's output, or with `flat` the output's tensors as a list (the operator's form, under torch.export).
    """

    def __init__(self, function: type, arguments: Arguments, flat: bool) -> None:
        self.function = function
        self.arguments = arguments
        self.flat = flat
        self.outputs: list[torch.Tensor] = []  # during the capture (`opaque_call`): the output's tensors (fake)
        self.__name__ = f"{function.__name__}_apply"  # torch.fx's generated code names its targets by these
        self.__module__ = function.__module__

    def __call__(self, *values: Any) -> Any:
        args, kwargs = self.arguments.rebuild(values)
        output = _APPLY(self.function, *args, **kwargs)
        return output_tensors(output) if self.flat else output

    def place(self, graph: fx.Graph, node: fx.Node, tensors: Sequence[fx.Node], attributes: dict[str, Any]) -> None:
        """Make the operator's `node` call this (it returns the same list)."""
        node.target = self
        node.args = tuple(tensors)

    def __repr__(self) -> str:
        return f"{self.function.__qualname__}.apply"


class FunctionCalls(Patches):
    """Within the block, each custom autograd Function applied to traced values becomes one graph node (module
    docstring); under torch.export inside an `runtime.opaque_calls.OpaqueCalls` block.

    The `forward` (and `setup_context`, where defined) of each custom Function class are replaced, and put back
    after: those that exist when the block begins and those defined inside it (the metaclass's `__init__` is
    replaced too). `Function.apply` looks them up at each call, so an `apply` bound before the capture
    (`gelu = GeLUFunction.apply`, a model attribute) is caught too. Other threads, and calls on values that are
    not traced, run the Function's own forward.
    """

    def patch(self) -> None:
        for cls in _custom_functions():
            self._keep(cls)
        created = FunctionMeta.__dict__["__init__"]

        def creating(cls: type, *args: Any, **kwargs: Any) -> None:  # a Function class defined during the capture
            created(cls, *args, **kwargs)
            if not _torchs_own(cls):
                self._keep(cls)

        self.replace(FunctionMeta, "__init__", creating)

    def _keep(self, cls: type) -> None:
        """Replace the class's forward (and setup_context) for the capture; a forward whose parameters cannot be
        read (a builtin) is left as it is."""
        try:
            inspect.signature(cls.forward)
        except (TypeError, ValueError):
            return
        with_context = _is_setup_context_defined(cls.setup_context)
        self.replace(cls, "forward", staticmethod(_kept_forward(cls, cls.forward, with_context)))
        if with_context:
            self.replace(cls, "setup_context", staticmethod(_kept_setup_context(cls.setup_context)))


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
    """`cls.forward` while a capture runs: a call by `apply` on traced values becomes one graph node."""

    def kept_forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        given = _given(forward, args, kwargs)
        if _RUNNING.get() or not (with_context or isinstance(args[0], BackwardCFunction)):  # called directly
            return forward(*given[0], **given[1])
        call_args = given[0] if with_context else given[0][1:]  # without the ctx
        leaves = pytree.tree_leaves((call_args, given[1]))
        proxies = [leaf for leaf in leaves if isinstance(leaf, fx.Proxy)]
        if proxies:  # torch.fx: tensors that are constants of the trace become its attributes
            arguments, values = Arguments.of(call_args, given[1], lambda leaf: isinstance(leaf, (fx.Proxy, torch.Tensor)),
                                             f"{cls.__qualname__}.apply")
            return proxies[0].tracer.create_proxy("call_function", KeptFunction(cls, arguments, False), tuple(values), {})
        if not (capturing() and any(is_fake(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor))):
            return forward(*given[0], **given[1])
        arguments, tensors = Arguments.of(call_args, given[1], lambda leaf: isinstance(leaf, torch.Tensor),
                                          f"{cls.__qualname__}.apply")
        kept = KeptFunction(cls, arguments, True)  # torch.export
        with unrecorded():
            output = _run(kept, tensors)  # the Function itself on export's fake tensors
        return opaque_call(kept, tensors, output)

    return _same_parameters(forward, kept_forward)


def _given(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments the caller gave: trailing positional ones left out dropped, one left out before a given one
    filled with its default (as apply passes them), keyword-only ones left out dropped."""
    positional = list(args)
    while positional and positional[-1] is _NOT_GIVEN:
        positional.pop()
    if any(value is _NOT_GIVEN for value in positional):
        defaults = [parameter.default for parameter in inspect.signature(forward).parameters.values()]
        positional = [defaults[index] if value is _NOT_GIVEN else value for index, value in enumerate(positional)]
    return tuple(positional), {name: value for name, value in kwargs.items() if value is not _NOT_GIVEN}


def _same_parameters(function: Callable[..., Any], body: Callable[[tuple[Any, ...], dict[str, Any]], Any]
                     ) -> Callable[..., Any]:
    """A function with `function`'s parameters (names, kinds; each default `_NOT_GIVEN`) that returns
    body(positional, keywords).

    Function.apply places keyword arguments by the parameter names of the forward's code object, so a stand-in
    for a forward must have the same ones.
    """
    namespace: dict[str, Any] = {"_planner_split_body": body, "_planner_split_not_given": _NOT_GIVEN}
    parameters, positional, keywords = [], [], []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.default is not inspect.Parameter.empty:
            parameter = parameter.replace(default=_Named("_planner_split_not_given"))
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
    passed = "".join(item + ", " for item in positional)
    source = f"def stand_in{declared}:\n    return _planner_split_body(({passed}), {{{', '.join(keywords)}}})\n"
    exec(source, namespace)  # noqa: S102 - made of the forward's own parameter names
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
        return setup_context(*args, **kwargs) if _RUNNING.get() or not capturing() else None

    return kept_setup_context


def _run(kept: KeptFunction, tensors: list[torch.Tensor]) -> Any:
    """The Function applied to copies of `tensors` (not leaves, so in-place Functions run, as in a model), with
    autograd on: what it returns."""
    token = _RUNNING.set(True)
    try:
        with torch.enable_grad():
            copies = [tensor.detach().requires_grad_(True).clone() if tensor.requires_grad else tensor.detach()
                      for tensor in tensors]
            args, kwargs = kept.arguments.rebuild(tuple(copies))
            return _APPLY(kept.function, *args, **kwargs)
    finally:
        _RUNNING.reset(token)


def _torchs_own(cls: type) -> bool:
    """Whether the Function is defined inside torch."""
    try:
        return os.path.abspath(inspect.getfile(cls)).startswith(TORCH_DIR)
    except (TypeError, OSError):
        return False
