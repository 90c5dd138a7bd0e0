"""Processes that train the model beside a CPU profile, so that it is measured under the load training puts on the machine.

`planner train` runs one process per rank, and on a CPU machine they compute at the same time on cores
that share the last-level cache and the memory bandwidth. Measured alone, a layer reads faster than it
runs in training: on the 2-core machine with a second process training beside it, the examples' steps
took 5-8% longer (mlp 9.95 -> 10.52 ms, resnet 21.5 -> 23.2 ms), and so do the predictions made from
them, which had read 13-26% short of training for those two examples (2026-11-26, benchmarks/RESULTS.md).

`planner profile --processes N` (on CPU: 2 by default, the processes the default threads assume)
therefore measures with N - 1 companions: each `python -m planner.profiling.companions MODEL BATCH
THREADS DTYPE` trains its own copy of the model on the example batch (forward, loss, backward, a
plain SGD step) in a loop, with the profile's threads, from before the first measurement until the
profile is done. A training rank runs other layers than its neighbour and waits in the bubbles, so
this is training's load approximated, not replayed. A companion exits when its standard input
closes, so none outlives a profiler that was killed.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from planner.errors import ProfileError

__all__ = ["READY", "companions"]

READY = "ready"  # what a companion prints once it has run its first steps
START_TIMEOUT_S = 300.0  # importing torch and the model file, building the model, two steps


@contextlib.contextmanager
def companions(model_path: str, count: int, batch_size: int, threads: int, dtype: str,
               timeout_s: float = START_TIMEOUT_S) -> Iterator[Callable[[], None]]:
    """Start `count` companions (module docstring) for the block and stop them when it ends. The block
    gets a function that waits until every companion has taken its first steps (call it before timing
    anything: the companions import torch and build the model meanwhile); it raises ProfileError with a
    companion's last line of stderr if one fails to start."""
    with tempfile.TemporaryDirectory(prefix="planner-companions-") as scratch:
        started: list[tuple[subprocess.Popen, Path]] = []
        waiting: list[tuple[subprocess.Popen, Path]] = []

        def ready() -> None:
            deadline = time.monotonic() + timeout_s
            while waiting:
                process, log = waiting[0]
                _wait_ready(process, log, deadline, model_path, timeout_s)
                waiting.pop(0)

        try:
            for index in range(count):
                log = Path(scratch) / f"companion-{index}.log"
                with log.open("w") as errors:
                    process = subprocess.Popen(
                        [sys.executable, "-m", "planner.profiling.companions", model_path, str(batch_size),
                         str(threads), dtype],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True)
                started.append((process, log))
                waiting.append((process, log))
            yield ready
        finally:
            for process, _ in started:
                _stop(process)


def _wait_ready(process: subprocess.Popen, log: Path, deadline: float, model_path: str, timeout_s: float) -> None:
    """Wait for `process` to print READY; ProfileError if it exits or the deadline passes first."""
    assert process.stdout is not None
    while True:
        left = deadline - time.monotonic()
        readable, _, _ = select.select([process.stdout], [], [], max(0.0, left))
        line = process.stdout.readline() if readable else None
        if line is not None and line.strip() == READY:
            return
        if line == "" or line is None:  # end of output (it exited) or out of time
            if line is None:
                process.kill()
            process.wait()
            said = [text for text in log.read_text().splitlines() if text.strip()]
            why = said[-1] if said else (f"exit status {process.returncode}" if line == "" else "no output")
            raise ProfileError(
                f"a companion process training {model_path} beside the profile "
                f"{'failed' if line == '' else f'did not start within {timeout_s:g} s'}: {why}; "
                "profile alone with --processes 1")


def _stop(process: subprocess.Popen) -> None:
    """End a companion: close its input (it exits), then terminate and, if need be, kill it."""
    with contextlib.suppress(OSError):
        if process.stdin is not None:
            process.stdin.close()
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()


def _exit_when_input_closes() -> None:
    """A daemon thread that ends this process once its standard input closes (the profiler is gone)."""

    def watch() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, name="companion-stdin", daemon=True).start()


def main(argv: list[str]) -> None:
    """Train MODEL_PATH's model at BATCH samples with THREADS threads in DTYPE until stopped (module docstring)."""
    model_path, batch_size, threads, dtype_name = argv[0], int(argv[1]), int(argv[2]), argv[3]
    _exit_when_input_closes()
    import torch

    from planner.profiling.devices import resolve_dtype
    from planner.profiling.model_file import checked_example_batch, default_loss, load_model_file

    torch.set_num_threads(threads)
    dtype = resolve_dtype(dtype_name)
    model_file = load_model_file(model_path)
    model = model_file.build_model().to(dtype=dtype).train()
    inputs, target = checked_example_batch(model_file, batch_size)
    inputs = tuple(tensor.to(dtype=dtype) if tensor.is_floating_point() else tensor for tensor in inputs)
    target = target.to(dtype=dtype) if target.is_floating_point() else target
    loss_fn = model_file.loss_fn or default_loss
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    steps = 0
    while True:
        loss_fn(model(*inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        if steps == 2:
            print(READY, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
