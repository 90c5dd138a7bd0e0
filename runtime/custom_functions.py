"""Custom autograd Functions met while a model is captured: a traced graph keeps their forward, not their backward.

torch.fx and torch.export both trace into `torch.autograd.Function.apply`: the graph records the operations of
the Function's `forward`, and autograd then differentiates those, not the Function's own `backward`. That is
harmless where the backward is the derivative of the forward written by hand to save memory (BLOOM's GeLU), and
silently wrong where it is not: a gradient reversal layer trained with its sign flipped, a straight-through
estimator with a zero gradient. While `FunctionCalls` is open, `Function.apply` records each Function a model
applies (torch's own are left out: theirs, such as reentrant checkpointing, compute what autograd of their
forward does). `refusal` then runs the model once on the example microbatch (its state and the random state put
back after), takes the inputs each Function was first applied to, and compares the gradients of its own backward
with those of its forward's operations, for one random output gradient: within RTOL (relative to the largest) they
are the same Function to the graph; otherwise, or where the check cannot run (no example, a forward that raises),
the split is refused in one line. A Function applied inside a module torch.fx keeps whole (one that no split point
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

from runtime.model_state import model_state, restore_model_state
from runtime.nested import tensors
from runtime.random_skips import TORCH_DIR, user_line

__all__ = ["FunctionCalls", "gradients_differ"]

RTOL = 1e-3  # float32 gradients of the same derivative, written twice, agree far closer than this


class FunctionCalls:
    """Records each custom autograd Function applied inside the block (its class, and where it was first applied);
    `refusal()` says in one line which one a traced graph would get wrong."""

    def __init__(self) -> None:
        self.calls: dict[type, str] = {}
        self._opened: contextlib.ExitStack | None = None

    def __enter__(self) -> "FunctionCalls":
        def record(cls: type, args: tuple[Any, ...]) -> None:
            self.calls.setdefault(cls, user_line(traceback.extract_stack()))

        self._opened = contextlib.ExitStack()
        self._opened.enter_context(_applies(record))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        assert self._opened is not None
        self._opened.close()

    def refusal(self, model: nn.Module, example_inputs: Sequence[Any] | None) -> str | None:
        """None if no Function was met, or each one's backward gives its forward's gradients on the example;
        else what to tell the user."""
        if not self.calls:
            return None
        if example_inputs is None:
            cls, where = next(iter(self.calls.items()))
            return (f"the forward applies the custom autograd Function {cls.__qualname__}{where}, whose own backward a "
                    "traced graph does not keep: pass an example microbatch (example_inputs) so that the split can "
                    "check that its forward's operations give the same gradients")
        first = _first_inputs(model, tuple(example_inputs), set(self.calls))
        for cls, where in self.calls.items():
            found = gradients_differ(cls, first[cls]) if cls in first else "is not applied when the model runs eagerly"
            if found is not None:
                return (f"the forward applies the custom autograd Function {cls.__qualname__}{where}, and a traced graph "
                        f"keeps its forward's operations but not its own backward, which {found}; apply it inside a "
                        "module that no split point encloses (torch.fx then calls that module as written), or split "
                        "the model by hand as an nn.Sequential")
        return None


def gradients_differ(cls: type, args: tuple[Any, ...]) -> str | None:
    """None if `cls`'s backward and autograd of its forward's operations give the same input gradients at `args`
    for one random output gradient; else how they differ, or why they could not be compared."""
    try:
        custom = _input_gradients(lambda *inputs: cls.apply(*inputs), args)
        plain = _input_gradients(lambda *inputs: _forward_alone(cls, inputs), args)
    except Exception as exc:  # e.g. a forward that writes its saved output in place: autograd of it cannot run
        first_line = " ".join(str(exc).split())[:120]
        return f"could not be compared with them on the example ({type(exc).__name__}: {first_line})"
    scale = max((float(g.abs().max()) for g in custom + plain if g.numel()), default=0.0)
    same = all(a.shape == b.shape and bool(torch.allclose(a, b, rtol=RTOL, atol=RTOL * scale + 1e-12))
               for a, b in zip(custom, plain))
    return None if same else "gives other gradients on the example"


def _forward_alone(cls: type, inputs: tuple[Any, ...]) -> Any:
    """The Function's forward called as a plain function: autograd records its operations."""
    if cls.setup_context is not torch.autograd.Function.setup_context:  # forward(*inputs) with setup_context
        return cls.forward(*inputs)
    return cls.forward(torch.autograd.function.FunctionCtx(), *inputs)


def _input_gradients(run: Callable[..., Any], args: tuple[Any, ...]) -> list[torch.Tensor]:
    """d(sum of outputs x a fixed random weight)/d(each floating-point tensor input), zeros where none flows."""
    inputs = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                   for a in args)
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    with torch.enable_grad():
        outputs = [t for t in tensors(run(*inputs)) if t.is_floating_point()]
    generator = torch.Generator(device=outputs[0].device if outputs else "cpu").manual_seed(0)
    weights = [torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) for t in outputs]
    flowing = [(t, w) for t, w in zip(outputs, weights) if t.requires_grad]
    found = (torch.autograd.grad([t for t, _ in flowing], leaves, [w for _, w in flowing], allow_unused=True)
             if flowing and leaves else [None] * len(leaves))
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, found)]


def _first_inputs(model: nn.Module, inputs: tuple[Any, ...], wanted: set[type]) -> dict[type, tuple[Any, ...]]:
    """The arguments each of the `wanted` Functions is first applied to when the model runs on `inputs` (without
    autograd; the model's state and the random state as they were)."""
    found: dict[type, tuple[Any, ...]] = {}

    def record(cls: type, args: tuple[Any, ...]) -> None:
        if cls in wanted and cls not in found:
            found[cls] = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)

    saved = model_state(model)
    devices = sorted({t.device.index or 0 for t in tensors(inputs) if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), _applies(record):
            model(*inputs)
    finally:
        restore_model_state(saved)
    return found


@contextlib.contextmanager
def _applies(record: Callable[[type, tuple[Any, ...]], None]) -> Iterator[None]:
    """Within the block, `record(cls, args)` sees each custom (not torch's own) Function's apply before it runs."""
    original = torch.autograd.Function.__dict__["apply"]
    apply = original.__func__

    def recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not _torchs_own(cls):
            record(cls, args)
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
