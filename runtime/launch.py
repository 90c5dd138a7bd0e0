"""`planner train` and `planner cluster`: check a job here, then start it on this machine with torchrun's launcher."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from planner.errors import PlannerError
from planner.files.plan import load_plan
from planner.profiling.conditions import (
    STEADY_MALLOC, busy_cores, busy_warning, current_conditions, differences, worker_threads,
)
from runtime.stages import build_stages
from runtime.train import (
    INTERRUPTED_FILE, TrainingError, check_loader, check_setup, example_microbatch, parse_args, rank_count, resume_note,
)

__all__ = ["JobStopped", "launch", "measure_cluster", "run_module"]

# the signals torchrun's launcher turns into SignalException: its --signals-to-handle (which reads the first variable
# where it is not given) and what it passes on in the second
_HANDLED_SIGNALS = ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE")
_TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # its default
# what a signal to the launcher that stops the job is called in its line: Ctrl-C, and a scheduler's or `kill`'s SIGTERM
_STOPPING = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
# the loggers of torchrun's launcher that say that it got a signal, that it sends one on to each worker, and which
# worker failed with which exit code: what each rank's own line and the job's line already say
_TORCHRUN_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


class JobStopped(KeyboardInterrupt):
    """The job was stopped by a signal to the launcher (`_STOPPING`): Ctrl-C or SIGTERM; `exit_code` 128 + its number,
    as a shell reports a process that signal ended."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or _STOPPING[signal.Signals(signum)])
        self.signum = signum
        self.exit_code = 128 + int(signum)


def launch(argv: Sequence[str], nproc: int | None = None) -> None:
    """Run `python -m runtime.train *argv` on `nproc` processes of this machine (default: the plan's
    rank count) under torchrun's launcher (`--standalone`), after `runtime.train.check_setup` ran
    here and the model was split for the plan, so that a bad plan, model file, option or folder,
    or a model that cannot be split (StageSplitError), is one line and nothing is started.

    The workers run in the profile's conditions where this machine allows
    (`planner.profiling.conditions`): the profile's threads per process when they fit the cores
    (else cores // nproc), and on CPU the glibc settings the profile was measured with. What still
    differs (or that the profile is not there to ask) is one line on stderr before the job starts;
    an `OMP_NUM_THREADS` the user set wins. Raises TrainingError when the job fails; each failing
    rank has printed its own line by then. Ctrl-C or SIGTERM ends every rank quietly (each finds the INTERRUPTED_FILE
    made before they are stopped) and raises JobStopped saying where training stopped: after the step rank 0 wrote
    into that file, with the checkpoint to resume from; before the job starts (the model built and split here),
    SIGTERM raises JobStopped too ("terminated"), as Ctrl-C raises KeyboardInterrupt.
    """
    with _terminable():
        _launch(argv, nproc)


def _launch(argv: Sequence[str], nproc: int | None) -> None:
    """`launch`'s work, once SIGTERM is JobStopped."""
    options = parse_args(argv)
    plan = load_plan(options.plan)
    count = nproc if nproc is not None else rank_count(plan)
    if count < 1:
        raise TrainingError(f"--nproc must be at least 1, got {count}")
    setup = check_setup(options, 0, count, 0)
    build_stages(setup.model, setup.plan, example_microbatch(setup))  # the split every rank will make
    check_loader(options, setup)
    on_cpu = setup.device.type == "cpu"
    if setup.cast_from is not None and setup.dtype is not None:
        own, profiled = str(setup.cast_from).removeprefix("torch."), str(setup.dtype).removeprefix("torch.")
        print(f"note: {options.model_file} builds {own} parameters; training casts them and its floating-point "
              f"inputs to {profiled}, as the profile measured (profile with --dtype {own} to train in {own})",
              file=sys.stderr)
    profile = setup.profile
    del setup  # the workers build their own models
    profiled = profile.settings.get("conditions") if profile is not None else None
    if profile is not None and profile.batch_coupling is not None:  # what the plan's microbatches change
        for note in profile.batch_coupling.notes(plan.microbatch_size, plan.microbatches):
            print(f"note: {note}", file=sys.stderr)
    threads = worker_threads(profiled.get("threads") if profiled else None, count)
    try:
        with tempfile.TemporaryDirectory(prefix="planner-train-", ignore_cleanup_errors=True) as folder:
            noted = Path(folder) / "interrupted"  # (a job of weeks may find it gone: /tmp is cleaned)
            try:
                run_module("runtime.train", argv, count, threads=threads, cpu=on_cpu,
                           before=lambda training: _warn_differences(profiled, training, plan.profile.path),
                           variables={INTERRUPTED_FILE: str(noted)}, on_interrupt=noted.touch)
            except KeyboardInterrupt as stopped:  # JobStopped, or Ctrl-C before torchrun's launcher took over
                signum = getattr(stopped, "signum", signal.SIGINT)
                raise JobStopped(signum, _interruption(noted, options.checkpoint_dir, _STOPPING[signum])) from None
    except ChildFailedError as exc:
        raise TrainingError(f"the training job failed: {_failures(exc)}; each rank's own error is above") from None


def measure_cluster(out: str, nproc: int = 2, quick: bool = False) -> None:
    """`python -m runtime.cluster_probe --out OUT` on `nproc` processes of this machine (module
    docstring of `runtime.cluster_probe`), with the workers' threads and malloc settings of `launch`; a line on
    stderr first when other processes keep the machine busy (their load would read as slow links)."""
    if nproc < 2:
        raise PlannerError(f"--nproc must be at least 2 to measure a link between two processes, got {nproc}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    if gpus is not None and nproc > gpus:
        raise PlannerError(f"--nproc {nproc} needs {nproc} GPUs (one per process under NCCL), but this machine has "
                           f"{gpus}: " + (f"use --nproc {gpus}" if gpus >= 2 else
                                          "one GPU has no link to another to measure; partition without --cluster"))
    try:
        run_module("runtime.cluster_probe", ["--out", out, *(["--quick"] if quick else [])], nproc,
                   before=lambda measuring: _warn_busy(measuring, "cluster"))
    except ChildFailedError as exc:
        raise PlannerError(f"measuring the cluster failed: {_failures(exc)}; each rank's own error is above") from None


def run_module(module: str, argv: Sequence[str], count: int, threads: int | None = None, cpu: bool = True,
               before: Callable[[dict[str, Any]], None] | None = None, variables: dict[str, str] | None = None,
               on_interrupt: Callable[[], None] | None = None) -> None:
    """`python -m MODULE *argv` on `count` processes under torchrun's launcher (`--standalone`);
    each worker gets `threads` torch threads (default cores // count; `OMP_NUM_THREADS` wins if
    set) and `planner.profiling.conditions.STEADY_MALLOC` glibc settings (as `planner profile`
    has, on CPU and GPU alike: they matter to host-side steps only). `before` sees the workers'
    conditions (`conditions.current_conditions`; processes: `count` on a CPU, None where each has a GPU, as a
    profile records them) first; the workers also get the environment `variables`. ChildFailedError when a worker
    fails; on Ctrl-C or SIGTERM, `on_interrupt` runs, the workers are stopped and JobStopped comes out
    (`_interruptible`).
    torchrun's own files (each rank's error file) go to a folder that is removed afterwards: given none, torchrun
    leaves a /tmp/torchelastic_* folder behind on every run."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads if threads is not None else worker_threads(None, count)))
    for name, value in STEADY_MALLOC.items():
        os.environ.setdefault(name, value)
    if before is not None:
        before(current_conditions(int(os.environ["OMP_NUM_THREADS"]), count if cpu else None))
    from torch.distributed.run import get_args_parser, run

    with tempfile.TemporaryDirectory(prefix="planner-torchrun-") as logs, _environment(variables or {}):
        with _quiet_torchrun(), _interruptible(on_interrupt):
            run(get_args_parser().parse_args(["--standalone", f"--nproc-per-node={count}", f"--log-dir={logs}",
                                              "--module", module, *argv]))


@contextmanager
def _interruptible(on_interrupt: Callable[[], None] | None = None) -> Iterator[None]:
    """Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption, `kill`, `timeout`) while torchrun's launcher runs:
    `on_interrupt`, then JobStopped once every worker is gone, instead of the traceback of torchrun's
    SignalException. The launcher stops the workers with SIGTERM (SIGKILL after 30 s), not with the SIGINT torchrun
    would pass on: a worker still starting (importing torch) dies of it without a word, where Python would print the
    KeyboardInterrupt's traceback; `on_interrupt` lets the others tell it from torchrun's stop after a rank failed.
    Another such signal meanwhile is ignored: torchrun would give up on the workers, still running."""
    if threading.current_thread() is not threading.main_thread():  # (signal handlers are the main thread's)
        yield
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException

    stopped_by: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        for stopping in _STOPPING:
            signal.signal(stopping, signal.SIG_IGN)
        stopped_by.append(signum)
        try:
            if on_interrupt is not None:
                on_interrupt()
        except OSError:  # (its folder gone) the workers then take the stop for torchrun's, and say so
            pass
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.SIGTERM)

    handled = ",".join(name for name in os.environ.get(_HANDLED_SIGNALS[0], _TORCHRUN_SIGNALS).split(",")
                       if name.strip() not in {each.name for each in _STOPPING})  # torchrun's would replace these
    previous = {stopping: signal.signal(stopping, interrupt) for stopping in _STOPPING}
    try:
        with _environment(dict.fromkeys(_HANDLED_SIGNALS, handled)):
            yield
    except SignalException:
        if not stopped_by:  # another signal torchrun handles (SIGHUP, SIGQUIT)
            raise
        raise JobStopped(stopped_by[0]) from None
    finally:
        for stopping, handler in previous.items():
            signal.signal(stopping, signal.SIG_DFL if handler is None else handler)


@contextmanager
def _terminable() -> Iterator[None]:
    """SIGTERM raises JobStopped in the block (main thread only), for what runs before `_interruptible` takes over:
    building and splitting the model can take a while, and the default action ended the launcher without a word."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise JobStopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextmanager
def _quiet_torchrun() -> Iterator[None]:
    """torchrun's launcher without its warnings and errors (`_TORCHRUN_LOGGERS`: "Sending process N closing signal
    SIGTERM", "failed (exitcode: 1) local_rank: 0 (pid: N) of binary: ..."), which came between the ranks' own
    lines and the job's; its loggers' levels as they were afterwards."""
    loggers = [logging.getLogger(name) for name in _TORCHRUN_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """This process's environment (which the workers inherit) with `variables` set; as it was afterwards."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _interruption(noted: Path, checkpoint_dir: str | None, word: str = "interrupted") -> str:
    """The line for a job ended by Ctrl-C (`word` "interrupted") or SIGTERM ("terminated"): after which step (rank 0
    writes it into `noted` if training began) and what is safe."""
    try:
        step = int(noted.read_text())
    except (OSError, ValueError):  # not there (stopped before the workers started) or empty
        return f"{word} before training started"
    return f"{word}: training stopped after step {step}; {resume_note(checkpoint_dir)}"


def _warn_differences(profiled: dict[str, Any] | None, training: dict[str, Any], profile_path: str) -> None:
    """One line on stderr per condition that differs between profile and training (or that none can be compared),
    and on a CPU job one if other processes keep this machine busy (`conditions.busy_cores`: 0.2 s)."""
    if training.get("processes"):
        _warn_busy(training, "training")
    if profiled is None:
        print(f"note: the plan's profile {profile_path or '(no path recorded)'} is not there or recorded no "
              "conditions: cannot check that training runs as it was measured", file=sys.stderr)
        return
    for line in differences(profiled, training):
        print(f"warning: {line}", file=sys.stderr)


def _warn_busy(conditions: dict[str, Any], job: str) -> None:
    """One line on stderr when other processes keep this machine busy before `job` starts (`conditions.busy_warning`;
    0.2 s of `/proc/stat`)."""
    busy = busy_warning(busy_cores(), os.cpu_count() or 1, conditions["processes"] or 1, conditions["threads"], job)
    if busy:
        print(f"warning: {busy}", file=sys.stderr)


def _failures(exc: ChildFailedError) -> str:
    """The failed ranks and how each ended."""
    return ", ".join(f"rank {rank} ({_exit(failure.exitcode)})" for rank, failure in sorted(exc.failures.items()))


def _exit(code: int) -> str:
    """An exit code as words: 'exit code 1' or 'killed by signal 9'."""
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
