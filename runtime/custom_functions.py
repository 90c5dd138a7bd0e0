"""Custom autograd Functions met while a model is captured: a traced graph keeps their forward, not their backward.

torch.fx and torch.export both trace into `torch.autograd.Function.apply`: the graph records the operations of
the Function's `forward`, and autograd then differentiates those, not the Function's own `backward`. That is
harmless where the backward is the derivative of the forward written by hand to save memory (BLOOM's GeLU), and
silently wrong where it is not: a gradient reversal layer trained with its sign flipped, a straight-through
estimator with a zero gradient. While `FunctionCalls` is open, `Function.apply` records each Function a model
applies (torch's own are left out: theirs, such as reentrant checkpointing, compute what autograd of their
forward does). `refusal` then runs the model once on the example microbatch with autograd on (its state and the
random state put back after), takes the arguments each Function was first applied to, and compares the gradients
of its own backward with those of its forward's operations, for one random output gradient and the same random
state: each within RTOL of its own size (or the rounding of bf16, fp16, TF32), they are the same Function to the
graph; otherwise, or where the check cannot run (no example, a forward that raises), the split is refused in one
line. A Function applied inside a module torch.fx keeps whole (one that no split point
encloses) is not traced, runs as written, and is not met here.

`Function.apply` is replaced on the class for as long as a block runs, and put back after it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from types import TracebackType
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from planner.profiling.tensors import rounding_rtol
from runtime.model_state import model_state, restore_model_state
from runtime.nested import tensors
from runtime.random_skips import TORCH_DIR, user_line

__all__ = ["FunctionCalls", "gradients_differ"]

RTOL = 1e-3  # float32 gradients of the same derivative, written twice, agree far closer than this (or a lower
# precision's rounding: `tensors.rounding_rtol`)


Call = tuple[tuple[Any, ...], dict[str, Any]]  # a Function's positional and keyword arguments


class FunctionCalls:
    """Records each custom autograd Function applied inside the block (its class, and where it was first applied);
    `refusal()` says in one line which one a traced graph would get wrong."""

    def __init__(self) -> None:
        self.calls: dict[type, str] = {}
        self._patch: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> "FunctionCalls":
        def record(cls: type, call: Call) -> None:
            if cls not in self.calls:
                self.calls[cls] = user_line(traceback.extract_stack())

        self._patch = _applies(record)
        self._patch.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        assert self._patch is not None
        self._patch.__exit__(kind, error, trace)

    def refusal(self, model: nn.Module, example_inputs: Sequence[Any] | None) -> str | None:
        """None if no Function was met, or each one's backward gives its forward's gradients on the example;
        else what to tell the user."""
        if not self.calls:
            return None
        cls, where = next(iter(self.calls.items()))
        applies = f"the forward applies the custom autograd Function {cls.__qualname__}{where}"
        if example_inputs is None:
            return (f"{applies}, whose own backward a traced graph does not keep: pass an example microbatch "
                    "(example_inputs) so that the split can check that its forward's operations give the same gradients")
        try:
            first = _first_calls(model, tuple(example_inputs), set(self.calls))
        except Exception as exc:  # the example does not run: the Functions cannot be checked
            return (f"{applies}, whose own backward a traced graph does not keep, and the model raised on the example "
                    f"microbatch, so the split cannot check it ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})")
        for cls, where in self.calls.items():
            found = gradients_differ(cls, first[cls]) if cls in first else "is not applied when the model runs eagerly"
            if found is not None:
                return (f"the forward applies the custom autograd Function {cls.__qualname__}{where}, and a traced "
                        f"graph keeps its forward's operations but not its own backward, which {found}; apply it inside "
                        "a module that no split point encloses (torch.fx then calls that module as written), or split "
                        "the model by hand as an nn.Sequential")
        return None


def gradients_differ(cls: type, call: Call) -> str | None:
    """None if `cls`'s backward and autograd of its forward's operations give the same gradients for each
    floating-point tensor argument of `call` (one random output gradient, the same random state for both runs;
    each gradient within `rounding_rtol` of its own size); else how they differ, or why they could not be compared."""
    devices = _cuda_devices()
    try:
        found = []
        for run in (lambda args, kwargs: cls.apply(*args, **kwargs),
                    lambda args, kwargs: _forward_alone(cls, args, kwargs)):
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(0)  # a Function that draws (a dropout) draws the same in both
                found.append(_input_gradients(run, call))
    except Exception as exc:  # e.g. a forward that writes its saved output in place: autograd of it cannot run
        first_line = " ".join(str(exc).split())[:120]
        return f"could not be compared with them on the example ({type(exc).__name__}: {first_line})"
    custom, plain = found
    for a, b in zip(custom, plain):
        scale = max(float(a.abs().max()) if a.numel() else 0.0, float(b.abs().max()) if b.numel() else 0.0)
        tolerance = rounding_rtol(a, RTOL)
        if a.shape != b.shape or not torch.allclose(a, b, rtol=tolerance, atol=tolerance * scale + 1e-12):
            return "gives other gradients on the example"
    return None


def _forward_alone(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The Function's forward called as a plain function: autograd records its operations."""
    if cls.setup_context is not torch.autograd.Function.setup_context:  # forward(*inputs) with setup_context
        return cls.forward(*args, **kwargs)
    ctx = torch.autograd.function.FunctionCtx()
    ctx.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)  # as apply sets it
    return cls.forward(ctx, *args, **kwargs)


def _input_gradients(run: Callable[[tuple[Any, ...], dict[str, Any]], Any], call: Call) -> list[torch.Tensor]:
    """d(sum of outputs x a fixed random weight)/d(each floating-point tensor argument), zeros where none flows.
    The Function gets copies of the arguments made inside the graph (as in a model: not leaves, so in-place
    Functions run)."""
    args, kwargs = call
    leaves: list[torch.Tensor] = []

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if not value.is_floating_point():
            return value.clone()
        leaves.append(value.detach().clone().requires_grad_(True))
        return leaves[-1].clone()

    with torch.enable_grad():
        outputs = [t for t in tensors(run(tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}))
                   if t.is_floating_point()]
    generator = torch.Generator(device=outputs[0].device if outputs else "cpu").manual_seed(0)
    weights = [torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) for t in outputs]
    flowing = [(t, w) for t, w in zip(outputs, weights) if t.requires_grad]
    found = (torch.autograd.grad([t for t, _ in flowing], leaves, [w for _, w in flowing], allow_unused=True)
             if flowing and leaves else [None] * len(leaves))
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, found)]


def _first_calls(model: nn.Module, inputs: tuple[Any, ...], wanted: set[type]) -> dict[type, Call]:
    """The arguments each of the `wanted` Functions is first applied to when the model runs on `inputs` (with
    autograd on, as when training; the model's state and the random state as they were)."""
    found: dict[type, Call] = {}

    def record(cls: type, call: Call) -> None:
        if cls in wanted and cls not in found:
            args, kwargs = call
            found[cls] = (tuple(_detached(a) for a in args), {k: _detached(v) for k, v in kwargs.items()})

    saved = model_state(model)
    try:
        with torch.random.fork_rng(devices=_cuda_devices()), torch.enable_grad(), _applies(record):
            model(*inputs)
    finally:
        restore_model_state(saved)
    return found


def _detached(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _cuda_devices() -> list[int]:
    """The CUDA devices whose random state a run may draw from: every one once CUDA is in use."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


@contextlib.contextmanager
def _applies(record: Callable[[type, Call], None]) -> Iterator[None]:
    """Within the block, `record(cls, (args, kwargs))` sees each custom (not torch's own) Function's apply before
    it runs."""
    original = torch.autograd.Function.__dict__["apply"]
    apply = original.__func__

    def recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not _torchs_own(cls):
            record(cls, (args, kwargs))
        return apply(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(recording_apply)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


def _torchs_own(cls: type) -> bool:
    """Whether the Function is defined inside torch."""
    try:
        return os.path.abspath(inspect.getfile(cls)).startswith(TORCH_DIR)
    except (TypeError, OSError):
        return False
