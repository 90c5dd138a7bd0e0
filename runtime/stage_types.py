"""What splitting a model produces besides the stage modules: its error, the stages' signatures, the values
crossing a boundary and the parameters several stages share (a module of types that the splitters import)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.errors import PlannerError

__all__ = ["SharedParameter", "StageSignature", "StageSplitError", "ValueSpec"]


class StageSplitError(PlannerError):
    """The model cannot be split as asked: untraceable forward, unknown or misordered split point."""


@dataclass(frozen=True)
class SharedParameter:
    """A parameter used by several stages (tied weights): a runtime must sum its gradients across them.

    `names`: every name of the parameter in the model; `stages`: the stage indices using it;
    `stage_names[i]`: its name in `stages[i]`'s `named_parameters()`.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    stage_names: tuple[str, ...]


@dataclass(frozen=True)
class StageSignature:
    """Names of the values a stage takes (in call order) and returns.

    Traced stages: the fx node names of the model's graph (stage 0 takes the forward's
    arguments; a middle stage returns a tuple; the last returns the model's output). nn.Sequential
    slices take and return one value, named "input", the last child's name, and "output".
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class ValueSpec:
    """One value crossing a stage boundary at some inputs: its name, and shape and dtype if a tensor."""

    name: str
    kind: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
