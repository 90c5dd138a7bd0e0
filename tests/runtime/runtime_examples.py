"""The shipped example model files, imported once, for the runtime tests."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from planner.profiling.model_file import ModelFile, load_model_file

REPO = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=None)
def model_file(name: str) -> ModelFile:
    """The example's model file, imported once."""
    return load_model_file(REPO / "examples" / f"{name}.py")
