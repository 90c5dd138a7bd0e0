"""Which modules a forward checkpoints, and how deep in torch.utils.checkpoint calls the running code is
(`counting_checkpoints`).

A module the forward calls checkpointed (`checkpoint(block, h)`, either variant, however the model imported
`checkpoint`; transformers' gradient checkpointing) runs as one call at training time: a pipeline split cannot
begin inside it, and its backward recomputes all of it. The layer finder (`planner.profiling.layers`) keeps
such a call whole. torch's `checkpoint` looks both variants up at each call (`CheckpointFunction.forward`, the
reentrant one; `_checkpoint_without_reentrant_generator`, the other), so replacing those two for the block sees
every checkpointed call. The module checkpointed is the function's owner: the module itself, a bound method of
it, or a partial of a function given the module first (transformers 5.x checkpoints `partial(forward, layer)`
from inside the layer's call, so the layer's call begins before the checkpoint does).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import functools

import torch.utils.checkpoint as torch_checkpoint
from torch import nn

__all__ = ["checkpoint_depth", "counting_checkpoints", "whole_calls"]

_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("planner_checkpoint_depth", default=0)


def checkpoint_depth() -> int:
    """How many checkpointed calls the running code is inside (0 outside any, or outside `counting_checkpoints`)."""
    return _DEPTH.get()


def _owner(function: Any) -> nn.Module | None:
    """The module a checkpointed function calls (see the module docstring), None if it is not one's. A bound
    method counts only if it is a whole call of its module (`forward`, `__call__`): a module that checkpoints one
    of its helpers (`checkpoint(self._run, block, h)`) is not checkpointed whole."""
    first = None
    while isinstance(function, functools.partial):
        first = function.args[0] if function.args else first
        function = function.func
    if isinstance(function, nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner if getattr(function, "__func__", None) in whole_calls(type(owner)) else None
    return first if isinstance(first, nn.Module) else None


def whole_calls(cls: type) -> set[Callable[..., Any]]:
    """The functions that make a whole call of a module of class `cls`, or its forward (looked up at each call:
    non-strict torch.export replaces `nn.Module.__call__` while it runs)."""
    return {nn.Module.__call__, nn.Module._wrapped_call_impl, nn.Module._call_impl, cls.__call__, cls.forward}


@contextlib.contextmanager
def counting_checkpoints() -> Iterator[dict[int, nn.Module]]:
    """For the block, code that a torch.utils.checkpoint call runs sees `checkpoint_depth()` one higher, and the
    dict yielded gets each module checkpointed, by id (torch is put back after, also on error)."""
    checkpointed: dict[int, nn.Module] = {}
    generator = torch_checkpoint._checkpoint_without_reentrant_generator
    forward = torch_checkpoint.CheckpointFunction.__dict__["forward"]

    def without_reentrant(function: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        owner = _owner(function)
        if owner is not None:
            checkpointed[id(owner)] = owner
        token = _DEPTH.set(_DEPTH.get() + 1)
        try:
            yield from generator(function, *args, **kwargs)  # checkpoint() runs the function between its two steps
        finally:
            _DEPTH.reset(token)

    def with_reentrant(ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        owner = _owner(run_function)
        if owner is not None:
            checkpointed[id(owner)] = owner
        token = _DEPTH.set(_DEPTH.get() + 1)
        try:
            return forward.__func__(ctx, run_function, preserve_rng_state, *args)
        finally:
            _DEPTH.reset(token)

    torch_checkpoint._checkpoint_without_reentrant_generator = without_reentrant
    torch_checkpoint.CheckpointFunction.forward = staticmethod(with_reentrant)
    try:
        yield checkpointed
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = generator
        torch_checkpoint.CheckpointFunction.forward = forward
