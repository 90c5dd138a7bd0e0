"""Two spawned processes for tests of gloo collectives: start them, wait at most a deadline, end any left."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.multiprocessing as mp


def run_gloo_pair(worker: Callable[..., None], tmp_path: Path, timeout_s: float = 90.0) -> None:
    """`worker(rank, store_path, out_dir)` in two spawned processes (the store a file in `tmp_path`, `out_dir`
    `tmp_path` itself, for what they save); fails the test if they have not finished within `timeout_s`."""
    context: Any = mp.start_processes(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False,
                                      start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the two gloo processes did not finish in {timeout_s:g} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
