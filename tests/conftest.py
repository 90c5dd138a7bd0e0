"""Shared fixtures: paths of the repository, its examples and the optional PipeDream profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# the shipped profiles as first made (format version 1: one batch size, no split backward measured), for
# tests of what a profile without those measurements gives; profiles/ holds the current ones
PROFILES_V1 = REPO / "tests" / "data" / "profiles-v1"


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    """The shipped example model files."""
    return EXAMPLES
