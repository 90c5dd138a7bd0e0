"""Shared fixtures: paths of the repository, its examples and the optional PipeDream profiles; GPUs hidden.

The suite is the CPU suite CI runs: its jobs of several processes use gloo on CPU processes, which
`--device auto` would put on the GPUs where there are some (one GPU per process, refused on a
machine with fewer). So on a machine with GPUs it hides them from this process and every job it
starts, before torch initialises CUDA, unless PLANNER_TEST_GPU=1: then the GPU-only tests run too
(`benchmarks/cuda_path.sh` sets it and runs those alone: `-k "gpu or cuda"`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest

if os.environ.get("PLANNER_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402  (after the GPUs are hidden)

# one intra-op thread in each test process: under `-n 2` two workers and their torchrun jobs already fill the
# cores, and torch's default (a thread per core) then spends 2-3x the CPU of one thread on the same ops, its
# threads waiting for each other's turns (a tiny mlp's profile: 1.4-1.7 s of CPU against 0.54-0.59 s beside two
# busy cores); a test that times with more threads sets them itself, as `ProfileSettings.threads` does
torch.set_num_threads(1)

from tests.machine_lock import MachineLock  # noqa: E402

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


MACHINE_LOCK = pytest.StashKey[MachineLock]()
TORCHRUN_LOGS = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # xdist's controller names the run itself (else its NodeManager draws the id), to delete the lock files at the end
    if not hasattr(config, "workerinput") and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex
    config.stash[MACHINE_LOCK] = MachineLock.for_this_run()
    # torchrun makes a /tmp/torchelastic_* folder for each job given no --log-dir and never removes it (about ten a
    # suite, from the jobs tests start with `python -m torch.distributed.run`): PET_LOG_DIR, which torchrun reads
    # for --log-dir, names one of this process's, which its jobs inherit and which goes at the end
    config.stash[TORCHRUN_LOGS] = os.environ["PET_LOG_DIR"] = tempfile.mkdtemp(prefix="planner-tests-torchrun-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(config.stash[TORCHRUN_LOGS], ignore_errors=True)
    os.environ.pop("PET_LOG_DIR", None)
    run = getattr(config.option, "testrunuid", None)
    if not hasattr(config, "workerinput") and run:  # the controller, after its workers ended
        MachineLock.of_run(run).remove()


@pytest.fixture(scope="session")
def machine_lock(request: pytest.FixtureRequest) -> MachineLock:
    """This run's lock between its worker processes (`tests/machine_lock.py`): `exclusive()` while timing."""
    return request.config.stash[MACHINE_LOCK]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Every test holds the machine shared from its fixtures' setup (a module's torchrun job may be one) to
    their teardown, so that a timing fixture's exclusive hold waits for it and it for that; a test that asks
    for `machine_lock` holds it as its fixtures say."""
    lock = item.config.stash[MACHINE_LOCK]
    with contextlib.nullcontext() if "machine_lock" in getattr(item, "fixturenames", ()) else lock.shared():
        yield
