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

A companion says it is ready on a pipe of its own (its file descriptor number is its fifth argument), read
without buffering: its standard output and error go to a log file, so a model that prints (at import, per
step, a line without its end) neither hides the signal nor fills a pipe nobody reads and stalls the
companion. It imports the model file with the profiler's `sys.path` added to its own, as the profiler
did. A companion that exits before the profile is done fails the profile: its timings were taken beside
less load than it records.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from planner.errors import ProfileError

__all__ = ["READY", "companions"]

READY = "ready"  # what a companion writes on its ready pipe once it has run its first steps
START_TIMEOUT_S = 300.0  # importing torch and the model file, building the model, two steps
SYS_PATH_VARIABLE = "PLANNER_COMPANION_SYS_PATH"  # the profiler's sys.path, for the model file's imports


@dataclass
class _Companion:
    """A started companion: its process, the read end of its ready pipe (None once read) and its log."""

    process: subprocess.Popen
    ready_fd: int | None
    log: Path


@contextlib.contextmanager
def companions(model_path: str, count: int, batch_size: int, threads: int, dtype: str,
               timeout_s: float = START_TIMEOUT_S) -> Iterator[Callable[[], None]]:
    """Start `count` companions (module docstring) for the block and stop them when it ends. The block
    gets a function that waits until every companion has taken its first steps (call it before timing
    anything: the companions import torch and build the model meanwhile); it raises ProfileError with a
    companion's last line of output if one fails to start. A block that ends normally while a companion
    has already exited raises ProfileError too."""
    with tempfile.TemporaryDirectory(prefix="planner-companions-") as scratch:
        started: list[_Companion] = []

        def ready() -> None:
            deadline = time.monotonic() + timeout_s
            for companion in started:
                _wait_ready(companion, deadline, model_path, timeout_s)

        try:
            environment = {**os.environ, SYS_PATH_VARIABLE: os.pathsep.join(sys.path)}
            for index in range(count):
                log = Path(scratch) / f"companion-{index}.log"
                read_fd, write_fd = os.pipe()
                try:
                    with log.open("w") as output:
                        process = subprocess.Popen(
                            [sys.executable, "-m", "planner.profiling.companions", model_path, str(batch_size),
                             str(threads), dtype, str(write_fd)],
                            stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
                            env=environment)
                except BaseException:
                    os.close(read_fd)
                    raise
                finally:
                    os.close(write_fd)  # the companion holds it now: its end of file is the companion's exit
                started.append(_Companion(process, read_fd, log))
            yield ready
            for companion in started:
                if companion.process.poll() is not None:
                    raise ProfileError(
                        f"a companion process training {model_path} beside the profile stopped before the profile "
                        f"was done ({_why(companion)}), so its times were not all taken under the load it records; "
                        "profile again, or alone (--processes 1)")
        finally:
            for companion in started:
                _stop(companion)


LAST_LINE_CHARS = 200  # of a companion's output, in an error message


def _why(companion: _Companion, exited: bool = True) -> str:
    """How a companion ended (`exited`: by itself, not stopped for missing the start timeout) and its last line of
    output (cut to LAST_LINE_CHARS), for a one-line error."""
    said = [text.strip() for text in companion.log.read_text(errors="replace").splitlines() if text.strip()]
    last = said[-1] if said else ""
    if len(last) > LAST_LINE_CHARS:
        last = last[:LAST_LINE_CHARS] + "..."
    code = companion.process.returncode
    ended = (f"killed by signal {-code}" if code < 0 else f"exit status {code}") if exited and code is not None else ""
    return "; ".join(part for part in (last, ended) if part) or "no output"


def _wait_ready(companion: _Companion, deadline: float, model_path: str, timeout_s: float) -> None:
    """Wait for `companion` to write READY on its pipe; ProfileError if it exits or the deadline passes first."""
    if companion.ready_fd is None:
        return
    received = b""
    while not received.endswith(b"\n"):
        readable, _, _ = select.select([companion.ready_fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(companion.ready_fd, 64) if readable else None
        if not chunk:  # b"": it exited before it was ready; None: out of time
            if chunk is None:
                companion.process.kill()
            companion.process.wait()
            raise ProfileError(
                f"a companion process training {model_path} beside the profile "
                f"{'failed' if chunk == b'' else f'did not start within {timeout_s:g} s'}: "
                f"{_why(companion, exited=chunk == b'')}; "
                "profile alone (--processes 1)")
        received += chunk
    os.close(companion.ready_fd)
    companion.ready_fd = None


def _stop(companion: _Companion) -> None:
    """End a companion: close its input (it exits), then terminate and, if need be, kill it."""
    process = companion.process
    with contextlib.suppress(OSError):
        if process.stdin is not None:
            process.stdin.close()
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if companion.ready_fd is not None:
        os.close(companion.ready_fd)
        companion.ready_fd = None


def _exit_when_input_closes() -> None:
    """A daemon thread that ends this process once its standard input closes (the profiler is gone)."""

    def watch() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, name="companion-stdin", daemon=True).start()


def main(argv: list[str]) -> None:
    """Train MODEL_PATH's model at BATCH samples with THREADS threads in DTYPE until stopped, writing READY on
    file descriptor READY_FD after two steps (module docstring). A PlannerError is one line on stderr."""
    model_path, batch_size, threads, dtype_name, ready_fd = argv[0], int(argv[1]), int(argv[2]), argv[3], int(argv[4])
    _exit_when_input_closes()
    sys.path.extend(entry for entry in os.environ.get(SYS_PATH_VARIABLE, "").split(os.pathsep)
                    if entry and entry not in sys.path)
    from planner.errors import PlannerError

    try:
        _train(model_path, batch_size, threads, dtype_name, ready_fd)
    except PlannerError as exc:
        print(exc, file=sys.stderr, flush=True)
        sys.exit(1)


def _train(model_path: str, batch_size: int, threads: int, dtype_name: str, ready_fd: int) -> None:
    """`main`'s loop."""
    import torch

    from planner.profiling.devices import resolve_dtype
    from planner.profiling.model_file import build_checked_model, load_model_file
    from planner.profiling.profiler import training_step

    torch.set_num_threads(threads)
    dtype = resolve_dtype(dtype_name)
    model_file = load_model_file(model_path)
    model = build_checked_model(model_file).to(dtype=dtype).train()
    step = training_step(model_file, model, batch_size, torch.device("cpu"), dtype)  # the profiler's, on its batch
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    steps = 0
    while True:
        step.loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        if steps == 2:
            os.write(ready_fd, f"{READY}\n".encode())
            os.close(ready_fd)


if __name__ == "__main__":
    main(sys.argv[1:])
