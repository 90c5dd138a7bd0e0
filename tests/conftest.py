"""Shared fixtures: paths of the repository, its examples and the optional PipeDream profiles; GPUs hidden.

The suite is the CPU suite CI runs: its jobs of several processes use gloo on CPU processes, which
`--device auto` would put on the GPUs where there are some (one GPU per process, refused on a
machine with fewer). So on a machine with GPUs it hides them from this process and every job it
starts, before torch initialises CUDA, unless PLANNER_TEST_GPU=1: then the GPU-only tests run too
(`benchmarks/cuda_path.sh` sets it and runs those alone: `-k "gpu or cuda"`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PLANNER_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402  (after the GPUs are hidden)

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="needs a CUDA device and PLANNER_TEST_GPU=1 (tests/conftest.py)")

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# the shipped profiles as first made (format version 1: one batch size, no split backward measured), for
# tests of what a profile without those measurements gives; profiles/ holds the current ones
PROFILES_V1 = REPO / "tests" / "data" / "profiles-v1"


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    """The shipped example model files."""
    return EXAMPLES
