"""Scalar random draws fixed while a model is captured: a layer skipped at random (LayerDrop) becomes a fixed branch.

transformers 4.x models such as BART, OPT, Marian and Whisper draw `torch.rand([])` in every layer in training
and skip the layer when the draw is below a probability p (`if dropout_probability < self.layerdrop`), even
where p is 0. torch.export cannot capture a branch on a drawn value, and torch.fx, which runs the draw, keeps
the one outcome it saw. Under `ScalarDraws` each scalar draw is a `UniformDraw`, which takes part only in
comparisons with a number: a draw lies in [0, 1), so for p <= 0 or p >= 1 the outcome is the same for every
draw and the captured graph holds it (and no draw); for p strictly between, the skip is random in training and
a pipeline's stages are fixed, so the comparison raises and `ScalarDraws.random_skip` says where and what to
set. `.item()` gives the draw itself; any other use (arithmetic, a truth value, equality) fails the capture.
"""

from __future__ import annotations

import operator
import os
import traceback
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["TORCH_DIR", "ScalarDraws", "UniformDraw", "scalar_size", "user_line"]

TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep  # torch's own frames are not the user's
_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class UniformDraw:
    """A scalar `torch.rand` at capture: compared with p, its outcome is fixed for p <= 0 or p >= 1 (a draw lies in
    [0, 1)); for p strictly between, `ScalarDraws.random_skip` says where, and the comparison raises."""

    def __init__(self, draws: "ScalarDraws") -> None:
        self.draws = draws

    def _compare(self, other: Any, outcome: Callable[[float, float], bool]) -> bool:
        p = float(other)
        if 0.0 < p < 1.0:
            self.draws.random_skip = (
                f"the forward skips work at random in training (a draw of torch.rand compared with {p:g}, e.g. "
                f"LayerDrop){user_line(traceback.extract_stack())}: a pipeline's stages are fixed; set that probability "
                "to 0 (a transformers config's layerdrop, encoder_layerdrop, decoder_layerdrop)")
            raise RuntimeError(self.draws.random_skip)
        return outcome(0.5, p)

    def __lt__(self, other: Any) -> bool:
        return self._compare(other, operator.lt)

    def __le__(self, other: Any) -> bool:
        return self._compare(other, operator.le)

    def __gt__(self, other: Any) -> bool:
        return self._compare(other, operator.gt)

    def __ge__(self, other: Any) -> bool:
        return self._compare(other, operator.ge)

    def item(self) -> "UniformDraw":
        """`torch.rand([]).item() < p` compares the same way."""
        return self

    def __eq__(self, other: Any) -> bool:
        raise TypeError("a scalar torch.rand draw compared for equality cannot be fixed at capture")

    def __bool__(self) -> bool:
        raise TypeError("a scalar torch.rand draw used as a truth value cannot be fixed at capture")

    __hash__ = object.__hash__


class ScalarDraws(TorchFunctionMode):
    """Makes each scalar `torch.rand()` / `torch.rand([])` a `UniformDraw` (counted in `count`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.random_skip: str | None = None

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.rand and scalar_size(args, kwargs or {}):
            self.count += 1
            return UniformDraw(self)
        return func(*args, **(kwargs or {}))


def scalar_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether torch.rand's size arguments ask for one number without dimensions: rand(), rand([]), rand(())."""
    size = kwargs.get("size", args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args)
    return isinstance(size, (list, tuple)) and len(size) == 0


def user_line(stack: traceback.StackSummary) -> str:
    """', at FILE:LINE in FUNCTION: `CODE`' for the innermost frame outside torch and this package ('' if none)."""
    frames = [frame for frame in stack
              if not os.path.abspath(frame.filename).startswith((TORCH_DIR, _RUNTIME_DIR))]
    if not frames:
        return ""
    frame = frames[-1]
    return f", at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"
