"""`planner train`: check a training job here, then start it on this machine with torchrun's launcher."""

from __future__ import annotations

import os
from typing import Sequence

from runtime.malloc import STEADY_MALLOC
from runtime.stages import build_stages
from runtime.train import TrainingError, check_setup, example_microbatch, parse_args

__all__ = ["launch"]


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
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
    if setup.device.type == "cpu":
        for name, value in STEADY_MALLOC.items():
            os.environ.setdefault(name, value)
    del setup  # the workers build their own models

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    arguments = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={count}", "--module", "runtime.train", *argv])
    try:
        run(arguments)
    except ChildFailedError as exc:
        failed = ", ".join(f"rank {rank} ({_exit(failure.exitcode)})" for rank, failure in sorted(exc.failures.items()))
        raise TrainingError(f"the training job failed: {failed}; each rank's own error is above") from None


def _exit(code: int) -> str:
    """An exit code as words: 'exit code 1' or 'killed by signal 9'."""
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
