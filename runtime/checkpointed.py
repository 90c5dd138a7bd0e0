"""Activation checkpointing in code the split traces: each checkpointed module call stays one call, checkpointed.

A model may checkpoint its own layers (`model.gradient_checkpointing_enable()` in transformers, or
`torch.utils.checkpoint.checkpoint(self.block, x)`); the profile measures it so (a layer's saved activations are
its input alone, its backward includes the recomputation). torch.fx and torch.export trace through the checkpoint:
the non-reentrant variant's saved-tensor hooks are not in the graph (the stage then keeps every activation: x14
the saved bytes of a checkpointed GPT-2), and the reentrant one's `torch.no_grad()` is (the stage's output then
needs no gradient, and training fails).

While `CheckpointCalls` is open, a checkpointed call of one of the model's modules becomes one graph node, a
`runtime.kept_modules.KeptModule` that runs `torch.utils.checkpoint.checkpoint` with the options the model gave,
on what the model checkpointed, and that the stage holds under its name in the model. Caught:
- transformers' `_gradient_checkpointing_func` on the model's modules (4.x checkpoints `layer.__call__` from the
  model's forward; 5.x a partial of the layer's own forward from inside it);
- `torch.utils.checkpoint.checkpoint` however imported: its reentrant `CheckpointFunction.forward` and its
  non-reentrant `_checkpoint_without_reentrant_generator` are replaced (both looked up at each call).
A module call (the module, its `__call__` or `forward`, or a partial of those) becomes the node from inside the
module's call (its `forward` is replaced for the call), so the node belongs to the module where a split point
looks for it; a partial of a function taking the module first (5.x) becomes the node where it is called. The
output's shapes come from the call made on export's fake tensors, unrecorded. A non-reentrant checkpoint of
anything else is traced through as before (its stage keeps the activations); a reentrant one, and a
checkpointed module that encloses a split point, are refused in one line.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import fx, nn
from torch.utils import _pytree as pytree

from planner.profiling.checkpoint_regions import whole_calls
from runtime.kept_modules import KeptModule
from runtime.opaque_calls import Arguments, CallRefused, opaque_call, real_module, unrecorded
from runtime.patches import Patches

__all__ = ["CheckpointCalls", "reentrant_checkpoints", "stands_in"]

_INSTEAD = ("checkpoint the module (checkpoint(self.block, x)), or leave checkpointing to the plan (planner partition "
            "recomputes stages where --memory needs it)")
_TORCH_OPTIONS = {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop"}
_WHOLE_CALL = nn.Module.__call__  # as imported: non-strict torch.export replaces it while it runs


class CheckpointCalls(Patches):
    """Within the block, each checkpointed module call of `model` is one graph node (module docstring)."""

    def __init__(self, model: nn.Module, split_points: Sequence[str]) -> None:
        self.model = model
        self.names = {id(module): name for name, module in model.named_modules()}
        self.split_points = list(split_points)
        super().__init__()

    def patch(self) -> None:
        original = torch_checkpoint._checkpoint_without_reentrant_generator
        parameters = inspect.signature(original)

        def without_reentrant(*args: Any, **kwargs: Any) -> Iterator[None]:
            bound = parameters.bind(*args, **kwargs)
            bound.apply_defaults()
            options = {name: bound.arguments[name] for name in ("context_fn", "determinism_check", "debug",
                                                                 "early_stop") if name in bound.arguments}
            options |= {"use_reentrant": False, "preserve_rng_state": bound.arguments["preserve_rng_state"]}
            try:
                module, function, _ = self._call_of(bound.arguments["fn"])
            except CallRefused:
                module, function = None, None
            if module is None or function is not None or _bound_forward(bound.arguments["fn"]):
                # not a module call (checkpoint_sequential's segments, a lambda): traced through, as torch.fx and
                # torch.export do, so the stage keeps the activations the checkpoint would have dropped
                yield from original(*args, **kwargs)
                return
            with _StandingIn(self._path(module), module, options):
                yield

        def with_reentrant(ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            return self._checkpoint(run_function, args, {"use_reentrant": True, "preserve_rng_state": preserve_rng_state})

        self.replace(torch_checkpoint, "_checkpoint_without_reentrant_generator", without_reentrant)
        self.replace(torch_checkpoint.CheckpointFunction, "forward", staticmethod(with_reentrant))
        for module in self.model.modules():
            given = module.__dict__.get("_gradient_checkpointing_func")
            if isinstance(given, functools.partial) and given.func is torch_checkpoint.checkpoint:
                self.replace(module, "_gradient_checkpointing_func", self._transformers_checkpoint(given.keywords))

    def _transformers_checkpoint(self, keywords: dict[str, Any]) -> Callable[..., Any]:
        """transformers' `_gradient_checkpointing_func`, `partial(checkpoint, **keywords)`, during the capture."""

        def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            given = keywords | kwargs
            options = {name: value for name, value in given.items() if name in _TORCH_OPTIONS}
            options.setdefault("use_reentrant", True)  # torch's choice where none is given
            passed = {name: value for name, value in given.items() if name not in _TORCH_OPTIONS}  # the function's
            return self._checkpoint(functools.partial(function, **passed) if passed else function, args, options)

        return checkpoint

    def _checkpoint(self, function: Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        """One node for `checkpoint(function, *args, **options)`."""
        module, called, (before, keywords) = self._call_of(function)
        if called is None:  # a module call: the node is made inside it (a bound forward called with hooks)
            with _StandingIn(self._path(module), module, options):
                return module(*args) if _bound_forward(function) else function(*args)
        return _node(self._path(module), module, called, (*before, *args), keywords, options,
                     lambda: called(module, *before, *args, **keywords))

    def _call_of(self, function: Callable[..., Any]) -> tuple[nn.Module, Callable[..., Any] | None,
                                                               tuple[tuple[Any, ...], dict[str, Any]]]:
        """(module, None, _) for a call of one of the model's modules; (module, function, (args, kwargs)) for a
        partial of a function taking the module first (its other bound arguments); else CallRefused."""
        outer, before, keywords = function, (), {}
        while isinstance(function, functools.partial):
            before, keywords = (*function.args, *before), function.keywords | keywords
            function = function.func
        function, owner = real_module(function), real_module(getattr(function, "__self__", None))
        before = (real_module(before[0]), *before[1:]) if before else before
        if isinstance(function, nn.Module) and id(function) in self.names:
            return function, None, ((), {})
        if isinstance(owner, nn.Module) and id(owner) in self.names and \
                getattr(function, "__func__", None) in whole_calls(type(owner)):
            return owner, None, ((), {})
        if before and isinstance(before[0], nn.Module) and id(before[0]) in self.names and callable(function):
            return before[0], function, (before[1:], keywords)
        raise CallRefused(
            f"the forward checkpoints {_label(outer)} (torch.utils.checkpoint), which is not a call of one of the "
            f"model's modules: {_INSTEAD}")

    def _path(self, module: nn.Module) -> str:
        """The module's name in the model; CallRefused if a split point is inside it."""
        name = self.names[id(module)]
        inside = [point for point in self.split_points if not name or point.startswith(f"{name}.")]
        if inside:
            raise CallRefused(
                f"split point {inside[0]!r} is inside {name or 'the model'}, which the forward checkpoints "
                "(torch.utils.checkpoint) as one call: split at that module or outside it")
        return name


def reentrant_checkpoints(stage: nn.Module) -> list[str]:
    """The model names of the calls a split stage checkpoints with torch's reentrant variant (whose backward
    cannot compute input gradients apart from weight gradients, as zero-bubble schedules do)."""
    return [node.target.path for module in stage.modules() if isinstance(module, fx.GraphModule)
            for node in module.graph.nodes if isinstance(node.target, KeptModule)
            and node.target.checkpoint is not None and node.target.checkpoint.get("use_reentrant", True)]


def stands_in(module: nn.Module) -> bool:
    """Whether `module` is being called checkpointed now (torch.fx must then call its forward, not record it)."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


class _StandingIn(Patches):
    """For the block, the module's forward is a `_CheckpointedForward` (put back after)."""

    def __init__(self, path: str, module: nn.Module, options: dict[str, Any]) -> None:
        super().__init__()
        self.module = module
        self.forward = _CheckpointedForward(path, module, options, module.forward)

    def patch(self) -> None:
        self.replace(self.module, "forward", self.forward)


class _CheckpointedForward:
    """The module's forward during a checkpointed call under capture: one node for the module's whole call."""

    def __init__(self, path: str, module: nn.Module, options: dict[str, Any], forward: Callable[..., Any]) -> None:
        self.path, self.module, self.options, self.forward = path, module, options, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _node(self.path, self.module, _WHOLE_CALL, args, kwargs, self.options,
                     lambda: self.forward(*args, **kwargs))


def _node(path: str, module: nn.Module, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          options: dict[str, Any], run: Callable[[], Any]) -> Any:
    """The graph node of `checkpoint(partial(function, module, **kwargs), *args, **options)`; `run()` makes the
    call itself (under torch.export, on fake tensors: the output's shapes)."""
    leaves = pytree.tree_leaves((args, kwargs))
    proxies = [leaf for leaf in leaves if isinstance(leaf, fx.Proxy)]
    if proxies:  # torch.fx: the module from a get_attr node
        arguments, values = Arguments.of(args, kwargs, lambda leaf: isinstance(leaf, (fx.Proxy, torch.Tensor)),
                                         f"checkpointed {path}")
        kept = KeptModule(path, module, arguments, function, options, flat=False)
        tracer = proxies[0].tracer
        holder = tracer.create_proxy("get_attr", path, (), {})
        return tracer.create_proxy("call_function", kept, (holder, *values), {})
    with unrecorded():  # torch.export
        output = run()
    arguments, tensors = Arguments.of(args, kwargs, lambda leaf: isinstance(leaf, torch.Tensor), f"checkpointed {path}")
    return opaque_call(KeptModule(path, module, arguments, function, options), tensors, output)


def _bound_forward(function: Any) -> bool:
    """Whether `function` is a module's bound forward (which bypasses the module's call)."""
    owner = getattr(function, "__self__", None)
    return isinstance(owner, nn.Module) and getattr(function, "__func__", None) is type(owner).forward


def _label(function: Any) -> str:
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__qualname__", type(function).__name__)
