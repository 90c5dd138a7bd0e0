"""`planner train` and `planner cluster`: check a job here, then start it on this machine with torchrun's launcher."""

from __future__ import annotations

import os
from typing import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from planner.errors import PlannerError
from runtime.malloc import STEADY_MALLOC
from runtime.stages import build_stages
from runtime.train import TrainingError, check_setup, example_microbatch, parse_args

__all__ = ["launch", "measure_cluster", "run_module"]


def launch(argv: Sequence[str], nproc: int | None = None) -> None:
    """Run `python -m runtime.train *argv` on `nproc` processes of this machine (default: the plan's
    rank count) under torchrun's launcher (`--standalone`), after `runtime.train.check_setup` ran
    here and the model was split for the plan, so that a bad plan, model file, option or folder,
    or a model that cannot be split (StageSplitError), is one line and nothing is started.

    The workers get one torch thread per core share (`OMP_NUM_THREADS` = cores // nproc, unless
    set) and, on CPU, glibc settings that keep freed memory (`runtime.malloc`). Raises
    TrainingError when the job fails; each failing rank has printed its own line by then.
    """
    options = parse_args(argv)
    from planner.files.plan import load_plan

    plan = load_plan(options.plan)
    count = nproc if nproc is not None else sum(stage.replicas for stage in plan.stages)
    if count < 1:
        raise TrainingError(f"--nproc must be at least 1, got {count}")
    setup = check_setup(options, 0, count, 0)
    build_stages(setup.model, setup.plan, example_microbatch(setup))  # the split every rank will make
    device_type = setup.device.type
    del setup  # the workers build their own models
    try:
        run_module("runtime.train", argv, count, cpu=device_type == "cpu")
    except ChildFailedError as exc:
        raise TrainingError(f"the training job failed: {_failures(exc)}; each rank's own error is above") from None


def measure_cluster(out: str, nproc: int = 2, quick: bool = False) -> None:
    """`python -m runtime.cluster_probe --out OUT` on `nproc` processes of this machine (module
    docstring of `runtime.cluster_probe`), with the workers' threads and malloc settings of `launch`."""
    if nproc < 2:
        raise PlannerError(f"--nproc must be at least 2 to measure a link between two processes, got {nproc}")
    import torch

    try:
        run_module("runtime.cluster_probe", ["--out", out, *(["--quick"] if quick else [])], nproc,
                   cpu=not torch.cuda.is_available())
    except ChildFailedError as exc:
        raise PlannerError(f"measuring the cluster failed: {_failures(exc)}; each rank's own error is above") from None


def run_module(module: str, argv: Sequence[str], count: int, cpu: bool) -> None:
    """`python -m MODULE *argv` on `count` processes under torchrun's launcher (`--standalone`);
    each worker gets cores // count torch threads (`OMP_NUM_THREADS`, unless set) and, on CPU,
    `runtime.malloc`'s glibc settings. ChildFailedError when a worker fails."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
    if cpu:
        for name, value in STEADY_MALLOC.items():
            os.environ.setdefault(name, value)
    from torch.distributed.run import get_args_parser, run

    run(get_args_parser().parse_args(["--standalone", f"--nproc-per-node={count}", "--module", module, *argv]))


def _failures(exc: ChildFailedError) -> str:
    """The failed ranks and how each ended."""
    return ", ".join(f"rank {rank} ({_exit(failure.exitcode)})" for rank, failure in sorted(exc.failures.items()))


def _exit(code: int) -> str:
    """An exit code as words: 'exit code 1' or 'killed by signal 9'."""
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
