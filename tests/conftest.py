"""Shared fixtures: paths of the repository, its examples and the optional PipeDream profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    """The shipped example model files."""
    return EXAMPLES
