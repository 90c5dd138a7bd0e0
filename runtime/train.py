"""Train a model file with a plan under torchrun: `torchrun --nproc-per-node N -m runtime.train MODEL --plan PLAN`.

Every process builds the whole model (same seed), keeps its stage (`runtime.engine.Engine`; its
`plan.chunks` stages under interleaved-1f1b, one process per rank still: `rank_count`) and runs
`--steps` optimizer steps on mini-batches of `microbatch_size x microbatches` samples (the plan's,
unless overridden). Before any work, every rank checks, and reports in one line:
the torchrun environment, that the world size is the plan's rank count, that the model file
matches the profile the plan was made from (its layer names are modules of the model), that the
device suits the backend, and that the checkpoint folder can be written.

Data: the model file's `data_loader(batch_size)` (called once, an iterable of (inputs, target)
iterated once per epoch; every rank must get the same batches in the same order, so seed any
shuffling) if it has one, else one `example_batch(batch_size)` reused every step (`--data`). A
resumed run skips the batches the checkpoint's steps trained on.

Checkpoints (`--checkpoint-dir`, `--checkpoint-every K`, `runtime.checkpoint`): after every K
steps and at the end, the first replica of each stage saves its weights, optimizer state and the
RNG state (a rank of several stages one file per stage, each with its share of the rank's one
optimizer state: `_save`); rank 0 writes the manifest once all are saved. `--resume` continues from the newest
complete checkpoint, also one made with another plan (weights and optimizer state are re-split
by parameter name).

Faults: a rank that fails, exits or stops answering for `--timeout` seconds ends every rank
with one line naming it and the last complete checkpoint (`runtime.engine`; the heartbeat in
`runtime.liveness`). Ctrl-C (SIGINT from torchrun's launcher, or under `planner train` SIGTERM with its
INTERRUPTED_FILE there) ends every rank without a word (the engine blames no rank for it); rank 0 writes the last
step it finished into that file, and `planner train` says in one line where training stopped and which checkpoint
continues it. At the end rank 0 writes the run report (`runtime.report`): measured times next to the plan's
predictions, for `planner compare`.

Why one module of ~580 lines: it is one job read top to bottom: options, the checks every rank makes
before any collective, the training loop with its checkpoints and log, and the run report.
"""

from __future__ import annotations

import argparse
import difflib
import math
from contextlib import contextmanager
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import ModelFileError, PlannerError
from planner.profiling.model_file import (
    ModelFile, build_checked_model, checked_batch, checked_example_batch, load_model_file,
)
from planner.files.fileformat import keep_previous
from planner.files.plan import Plan, load_plan, plan_digest
from planner.files.profile import Profile, load_profile
from planner.profiling.devices import resolve_dtype
from planner.profiling.tensors import tensor_nbytes
from planner.units import plural
from planner.schedules.schedule import pipedream_microbatches
from runtime.checkpoint import (
    Checkpoint, CheckpointError, check_writable, latest_complete, load_stages, merged_model_state,
    merged_optimizer_state, prune, save_stage, write_manifest,
)
from runtime.engine import Engine, EngineError, init_distributed
from runtime.nested import batch_size, map_tensors, tensors
from planner.profiling.conditions import steady_malloc
from planner.profiling.optimizer_step import make_optimizer
from runtime.optimizer_state import load_named_optimizer_state, named_optimizer_state
from runtime.report import save_run_report
from runtime.worker_exit import Stopped, exit_worker

__all__ = ["INTERRUPTED_FILE", "TrainOptionError", "TrainOptions", "TrainingError", "UnknownTrainOptionError",
           "parse_args", "main", "resume_note",
           "check_loader", "check_setup", "example_microbatch", "rank_count"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3}
LAUNCHER_OPTIONS = ("--nproc", "--debug")  # `planner train`'s own options, beside what it passes to `parse_args`
INTERRUPTED_EXIT = 130  # the exit code of a rank ended by Ctrl-C (128 + SIGINT, as a shell reports it)
# the variable naming the file `planner train` makes on Ctrl-C before torchrun's launcher stops every rank with
# SIGTERM: a rank that finds it ends as on SIGINT, and rank 0 writes into it the last step it finished (if training began)
INTERRUPTED_FILE = "PLANNER_INTERRUPTED_FILE"
_INTERRUPT = threading.Event()  # set by the first SIGINT: from then on this rank ends without a word


class TrainingError(PlannerError):
    """The training job cannot start or go on; the message is the one line every rank prints."""


class TrainOptionError(TrainingError):
    """A command line of `planner train` (`prog`) that cannot be read: argparse's `problem`, in one line."""

    def __init__(self, prog: str, problem: str) -> None:
        self.prog, self.problem = prog, problem
        super().__init__(f"{prog}: {problem}")


class UnknownTrainOptionError(TrainOptionError):
    """An option `planner train` does not take: names it, and the closest it takes (`closest`, "" for none) or them
    all (`options`)."""

    def __init__(self, prog: str, option: str, closest: str, options: Sequence[str]) -> None:
        self.option, self.closest, self.options = option, closest, tuple(options)
        fix = f"did you mean {closest}?" if closest else f"the options are {', '.join(options)}"
        super().__init__(prog, f"unknown option {option}; {fix}")


class _OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are TrainOptionError (one line) instead of its usage on stderr and exit 2."""

    def error(self, message: str) -> NoReturn:
        """Raise the problem argparse found as a TrainOptionError naming the command."""
        raise TrainOptionError(self.prog, message)


class _CollectiveFailed(Exception):
    """A collective of the training loop (log, checkpoint, report) failed; the message says why."""


@dataclass(frozen=True)
class TrainOptions:
    """The command line of `runtime.train` (see `parse_args` for each option's meaning)."""

    model_file: str
    plan: str
    steps: int = 100
    lr: float | None = None
    optimizer: str | None = None
    data: str = "auto"
    microbatches: int | None = None
    microbatch_size: int | None = None
    seed: int = 0
    device: str = "auto"
    backend: str = "auto"
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep: int = 2
    resume: bool = False
    timeout_s: float = 300.0
    report: str | None = None
    log_every: int = 10


def parse_args(argv: Sequence[str], prog: str = "planner train",
               launcher_options: Sequence[str] = LAUNCHER_OPTIONS) -> TrainOptions:
    """TrainOptions from a command line of `prog` (whose own options, beside these, are `launcher_options`);
    TrainOptionError (one line) on a bad one, UnknownTrainOptionError naming the closest option for a mistyped one."""
    parser = _OneLineParser(
        prog=prog, description="Train MODEL_FILE with PLAN; launch one process per rank "
        "of the plan with torchrun (or `planner train`).")
    parser.add_argument("model_file", help="Python file with build_model() and example_batch(batch_size)")
    parser.add_argument("--plan", required=True, help="plan file written by `planner partition`")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to reach (default 100)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: sgd 0.01, adam 0.001)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default=None,
                        help="default: the one the plan counted memory for")
    parser.add_argument("--data", choices=("auto", "loader", "example"), default="auto",
                        help="loader: the model file's data_loader(batch_size); example: one example_batch "
                        "reused; auto (default): loader if the file defines one")
    parser.add_argument("--microbatches", type=int, default=None, help="default: the plan's")
    parser.add_argument("--microbatch-size", type=int, default=None, help="samples; default: the plan's")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights and dropout")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: one GPU per local rank if CUDA is available, else cpu")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="auto: nccl on cuda, gloo on cpu")
    parser.add_argument("--checkpoint-dir", default=None, help="folder for training checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="save every K steps (default: only at the end) into --checkpoint-dir")
    parser.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep (default 2)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--timeout", type=float, default=300.0, dest="timeout_s",
                        help="seconds a rank may stop answering before every rank stops (default 300)")
    parser.add_argument("--report", default=None,
                        help="run report written by rank 0 (default runs/<plan name>.report.json)")
    parser.add_argument("--log-every", type=int, default=10, help="rank 0 logs every N steps (default 10)")
    options, unknown = parser.parse_known_args(list(argv))
    if unknown:
        raise _unknown_option(parser, unknown, launcher_options)
    return TrainOptions(**vars(options))


def _unknown_option(parser: argparse.ArgumentParser, unknown: Sequence[str],
                    launcher_options: Sequence[str]) -> TrainOptionError:
    """The error for the words `parser` did not take: the first option among them with the closest known one (or all
    of them), else the first stray word."""
    options = [option for option in (*launcher_options, *parser._option_string_actions) if option.startswith("--")
               and option != "--help"]
    option = next((word.split("=", 1)[0] for word in unknown if word.startswith("-")), None)
    if option is None:
        return TrainOptionError(parser.prog, f"unexpected argument {unknown[0]!r} (MODEL_FILE is given once, first)")
    closest = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
    return UnknownTrainOptionError(parser.prog, option, closest[0] if closest else "", options)


@dataclass(frozen=True)
class Setup:
    """What the checks found: the plan, the model (built, weights not yet restored) and where to run."""

    plan: Plan
    model_file: ModelFile
    model: nn.Module
    rank: int
    world: int
    device: torch.device
    backend: str
    microbatches: int
    batch_size: int
    optimizer: str
    dtype: torch.dtype | None = None  # the profile's: floating-point parameters, inputs and targets are cast to it
    cast_from: torch.dtype | None = None  # the model's own floating-point dtype where it was another
    profile: Profile | None = None  # the plan's, where its file is there (`_plan_profile`)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m runtime.train`; returns the exit code (0, or 1 after the one-line error)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        options = parse_args(arguments, "python -m runtime.train", ())
    except TrainOptionError as exc:
        _say_error(os.environ.get("RANK", "?"), str(exc))
        return 1
    if options.device != "cuda" and not torch.cuda.is_available() and argv is None:
        steady_malloc(["-m", "runtime.train", *arguments])
    rank = os.environ.get("RANK", "?")
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, _raise_interrupted)
    try:
        try:
            setup = check_and_build(options)
        except PlannerError as exc:
            _say_error(rank, str(exc))
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # said already: torchrun's stop adds no second line
            _wait_for_checks()
            return 1
        _wait_for_checks()
        init_distributed(setup.backend, options.timeout_s, setup.device)
        try:
            train(options, setup)
        finally:
            dist.destroy_process_group()
    except KeyboardInterrupt:  # Ctrl-C, which torchrun's launcher passes on to every rank: `planner train` says it
        return INTERRUPTED_EXIT
    except PlannerError as exc:  # TrainingError, CheckpointError, EngineError, model-file errors
        _say_error(rank, str(exc))
        return 1
    except Stopped:
        _say_error(rank, "stopped by SIGTERM")
        return 1
    return 0


def _wait_for_checks(limit_s: float = 10.0) -> None:
    """Wait (at most `limit_s`) until every rank has run its checks, so that each prints its own line.

    A rank that fails a check exits at once, and torchrun then stops the others with SIGTERM,
    possibly before a slower rank got to say the same thing. Counted in torchrun's store (only
    under torchrun's agent, which keeps it alive; a job started otherwise does not wait).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        from datetime import timedelta

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=limit_s))
        key = f"planner/checked/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        world = int(os.environ["WORLD_SIZE"])
        store.add(key, 1)
        deadline = time.monotonic() + limit_s
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except (KeyError, ValueError, RuntimeError, dist.DistStoreError):  # no store: nothing to wait for
        pass


def _raise_stopped(signum: int, frame: Any) -> None:
    """SIGTERM: Stopped, or as SIGINT where `planner train` was interrupted (its INTERRUPTED_FILE is there)."""
    noted = os.environ.get(INTERRUPTED_FILE)
    if noted and Path(noted).exists():
        _raise_interrupted(signum, frame)
    raise Stopped()


def _raise_interrupted(signum: int, frame: Any) -> None:
    """Ctrl-C: KeyboardInterrupt, once; this rank then ends quietly."""
    _INTERRUPT.set()
    for ignored in (signal.SIGINT, signal.SIGTERM):  # its clean-up runs to the end
        signal.signal(ignored, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT wait for the block to end (a checkpoint file being written), then are raised again, to
    the handlers that were there (`signal.raise_signal`: a default action too).
    Raised inside `torch.save`, a stop left its zip writer to fail on the half-written file ("unexpected pos"), and
    that RuntimeError, not the stop, reached the top: a traceback instead of the rank's line. (The file is written
    atomically either way: a stop never leaves a partial one.) Main thread only, as every signal handler."""
    caught: list[int] = []
    handlers = {stop: signal.getsignal(stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    for stop in handlers:
        signal.signal(stop, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for stop, handler in handlers.items():
            signal.signal(stop, signal.SIG_DFL if handler is None else handler)  # (None: set outside Python)
        if caught:
            signal.raise_signal(caught[0])


def _stopping() -> None:
    """This rank is ending training and composing its one line (which may look for a gone peer for a
    second): torchrun's SIGTERM, sent when another rank exits, must not cut it short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _say_error(rank: str | int, message: str) -> None:
    if _INTERRUPT.is_set():  # whatever failed after a Ctrl-C (a peer gone first): the launcher says what stopped
        return
    text = " | ".join(line.strip() for line in message.splitlines() if line.strip())
    sys.stderr.write(f"error: rank {rank}: {text}\n")  # one write: the ranks share torchrun's stderr
    sys.stderr.flush()


# --- checks before any work ---------------------------------------------------------------------


def check_and_build(options: TrainOptions) -> Setup:
    """`check_setup` for this torchrun worker (its rank and world size from torchrun's variables)."""
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise TrainingError(f"not started by torchrun ({', '.join(missing)} unset): run `planner train "
                            f"{options.model_file} --plan {options.plan}` or `torchrun --nproc-per-node N -m "
                            "runtime.train ...`")
    rank, world, local_rank = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    return check_setup(options, rank, world, local_rank)


def check_setup(options: TrainOptions, rank: int, world: int, local_rank: int) -> Setup:
    """Every check that needs no other rank, then the model built with `options.seed`; TrainingError
    (or the model file's or plan file's own error) if one fails."""
    _check_options(options)
    plan = load_plan(options.plan)
    needed = rank_count(plan)
    if world != needed:
        raise TrainingError(f"{options.plan} has {plural(needed, 'rank')} ({plural(len(plan.stages), 'stage')}) but "
                            f"the job has {plural(world, 'process', 'processes')}: start {needed} (`planner train` "
                            f"does by default, or --nproc {needed}; torchrun --nproc-per-node {needed}), or make a plan "
                            f"for {plural(world, 'GPU')} with `planner partition PROFILE --gpus {world}`")
    device, backend = _device_and_backend(options, local_rank)
    model_file = load_model_file(options.model_file)
    torch.manual_seed(options.seed)
    model = build_checked_model(model_file)
    profile = _plan_profile(plan, options.plan)
    dtype = resolve_dtype(profile.dtype) if profile is not None else None
    cast_from = _floating_dtype(model) if dtype is not None else None
    if cast_from is not None and cast_from != dtype:
        model = model.to(dtype=dtype)  # as the profile measured it (`planner profile --dtype`)
    else:
        cast_from = None
    _check_model_matches(model, plan, options, profile)
    if options.checkpoint_dir is not None:
        check_writable(options.checkpoint_dir)
        found = latest_complete(options.checkpoint_dir)
        if found is not None and not options.resume:
            raise TrainingError(f"{options.checkpoint_dir} already holds checkpoints (the newest: step {found.step}): "
                                "continue from it with --resume, or give another --checkpoint-dir")
    if options.data == "loader" and model_file.data_loader is None:
        raise TrainingError(f"{options.model_file} has no data_loader(batch_size): define one, or use --data example")
    # pipedream plans have no microbatch count: at least twice the ranks per train_step, so the pipeline is mostly full
    microbatches = options.microbatches or plan.microbatches or pipedream_microbatches(
        [stage.replicas for stage in plan.stages], 2 * needed)
    microbatch_size = options.microbatch_size or plan.microbatch_size
    if microbatch_size is None:
        raise TrainingError(f"{options.plan} does not know its microbatch size (its profile has no batch size): "
                            "give --microbatch-size")
    setup = Setup(plan, model_file, model, rank, world, device, backend, microbatches, microbatch_size * microbatches,
                  options.optimizer or plan.optimizer, dtype, cast_from, profile)
    if profile is not None:
        _check_inputs_match(setup, profile, options)
    return setup


def _plan_profile(plan: Plan, plan_path: str) -> Profile | None:
    """The plan's profile where its file is there (checked to be the one the plan was made from), else None."""
    path = Path(plan.profile.path) if plan.profile.path else None
    if path is None or not path.is_file():
        return None
    profile = load_profile(path)
    plan.check_profile(profile, plan_path, str(path), profile_option=False)  # train takes no --profile
    return profile


def _floating_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter (or buffer), None if it has none."""
    return next((t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()), None)


def _check_inputs_match(setup: Setup, profile: Profile, options: TrainOptions) -> None:
    """The model file's example inputs at the profile's batch size must have the bytes the profile measured
    (`Profile.input_bytes`): another sequence length or image size moves every activation, and the plan's memory
    with it; TrainingError naming both."""
    if not profile.batch_size or not profile.input_bytes:
        return
    with torch.random.fork_rng(devices=[]):
        inputs, _ = checked_example_batch(setup.model_file, profile.batch_size)
    found = sum(tensor_nbytes(t) for t in tensors(_cast(inputs, setup.dtype)))
    if found != profile.input_bytes:
        raise TrainingError(f"{options.model_file} does not match the profile {setup.plan.profile.path}: "
                            f"example_batch({profile.batch_size})'s inputs have {found:,} bytes, the profile's "
                            f"{profile.input_bytes:,} (were their shapes changed since?); profile this model "
                            f"(`planner profile {options.model_file}`) and partition again")


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    """`value` with its floating-point tensors cast to `dtype` (None: as they are)."""
    if dtype is None:
        return value
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def rank_count(plan: Plan) -> int:
    """The processes a job of `plan` runs: its distinct ranks. Not the sum of the stages' replicas: under
    interleaved-1f1b a rank runs `plan.chunks` stages (stage s on rank s mod p)."""
    return len({rank for stage in plan.stages for rank in stage.ranks})


def _check_options(options: TrainOptions) -> None:
    for name, value in (("--steps", options.steps), ("--microbatches", options.microbatches),
                        ("--microbatch-size", options.microbatch_size), ("--checkpoint-every", options.checkpoint_every),
                        ("--keep", options.keep), ("--log-every", options.log_every)):
        if value is not None and value < 1:
            raise TrainingError(f"{name} must be at least 1, got {value}")
    if options.timeout_s <= 2:
        raise TrainingError(f"--timeout must be more than 2 seconds, got {options.timeout_s:g}")
    if options.lr is not None and not options.lr > 0:
        raise TrainingError(f"--lr must be positive, got {options.lr:g}")
    if options.checkpoint_dir is None and (options.resume or options.checkpoint_every is not None):
        flag = "--resume" if options.resume else "--checkpoint-every"
        raise TrainingError(f"{flag} needs --checkpoint-dir DIR")


def _device_and_backend(options: TrainOptions, local_rank: int) -> tuple[torch.device, str]:
    """The rank's device and the process-group backend, or TrainingError when they do not go together."""
    cuda = torch.cuda.is_available()
    kind = options.device if options.device != "auto" else ("cuda" if cuda else "cpu")
    if kind == "cuda" and not cuda:
        raise TrainingError("--device cuda but torch finds no CUDA device on this machine: use --device cpu")
    backend = options.backend if options.backend != "auto" else ("nccl" if kind == "cuda" else "gloo")
    if backend == "nccl" and kind != "cuda":
        raise TrainingError("--backend nccl needs CUDA devices, but the device is cpu: use --backend gloo")
    if kind == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise TrainingError(f"local rank {local_rank} needs GPU {local_rank}, but this machine has {count}: "
                                f"start at most {plural(count, 'process', 'processes')} per machine (--nproc-per-node)")
        return torch.device("cuda", local_rank), backend
    return torch.device("cpu"), backend


def _check_model_matches(model: nn.Module, plan: Plan, options: TrainOptions, profile: Profile | None) -> None:
    """The model must have a module for each layer of the plan's profile (or, without the profile file,
    for each stage's first and last layer), and as many parameter bytes as that profile counted
    (`Profile.total_param_bytes`: every parameter once, so a model built wider or deeper from the same file has the
    same layer names but not the same bytes, and its plan's memory is wrong); TrainingError naming what differs."""
    modules = {name for name, _ in model.named_modules() if name}
    if profile is not None:
        names, source = [layer.name for layer in profile.layers], f"the profile {plan.profile.path}"
    else:
        names = [name for stage in plan.stages for name in (stage.first_layer, stage.last_layer)]
        source = f"the plan {options.plan}"
    missing = [name for name in dict.fromkeys(names) if name not in modules]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise TrainingError(f"{options.model_file} does not match {source}: its layers {shown} are not modules "
                            f"of the model; profile this model (`planner profile {options.model_file}`) and "
                            "partition again")
    found = sum(tensor_nbytes(parameter) for parameter in model.parameters())
    if profile is not None and found != profile.total_param_bytes:
        raise TrainingError(f"{options.model_file} does not match {source}: the model has {found:,} bytes of "
                            f"parameters, the profile {profile.total_param_bytes:,} (was the model's configuration "
                            f"changed since?); profile this model (`planner profile {options.model_file}`) and "
                            "partition again")


# --- training ------------------------------------------------------------------------------------


def example_microbatch(setup: Setup) -> Any:
    """One microbatch of the model file's example inputs (for torch.export), leaving the random state as it was."""
    with torch.random.fork_rng(devices=[]):
        return _cast(setup.model_file.example_batch(setup.batch_size // setup.microbatches)[0], setup.dtype)


def train(options: TrainOptions, setup: Setup) -> None:
    """Restore (--resume), build the engine, run the steps with checkpoints, then write the report."""
    plan, rank = setup.plan, setup.rank
    digest = plan_digest(plan)
    resumed = _restore_weights(options, setup, digest)
    start_step = resumed[0].step if resumed is not None else 0
    lr = options.lr if options.lr is not None else DEFAULT_LR[setup.optimizer]
    example = example_microbatch(setup)
    engine = Engine.from_plan(setup.model, plan, optimizer=_optimizer_factory(setup.optimizer, lr),
                              loss_fn=setup.model_file.loss_fn, microbatches=setup.microbatches,
                              device=setup.device, timeout_s=options.timeout_s, example_inputs=example)
    if resumed is not None and engine.optimizer is not None:  # this rank's optimizer state, by parameter name
        load_named_optimizer_state(engine.optimizer, _named_parameters(engine, engine.stages),
                                   merged_optimizer_state(*resumed))
    last_rank = plan.stages[-1].ranks[0]
    losses: list[tuple[int, float]] = []
    log = _Progress(rank == 0, options.steps, setup.batch_size, options.log_every, start_step)
    batches = _batches(options, setup, start_step, example)
    step = start_step
    try:
        if start_step >= options.steps:
            if rank == 0:
                print(f"the checkpoint is at step {start_step}, --steps is {options.steps}: nothing to do", flush=True)
            return
        while step < options.steps:
            inputs, target = next(batches)
            loss = engine.train_step(inputs, target)
            step += 1
            if loss is not None and rank == last_rank:
                losses.append((step, loss))
            if log.due(step):
                log.write(step, _latest_loss(engine, losses, last_rank, setup.device))
            if options.checkpoint_dir and (step == options.steps or (options.checkpoint_every
                                                                      and step % options.checkpoint_every == 0)):
                _save(options, engine, setup, step, digest)
        _finish(options, setup, engine, losses, start_step)
    except (EngineError, _CollectiveFailed) as exc:
        _stopping()
        stopped = isinstance(exc.__cause__, Stopped)
        raise TrainingError(_stop_message(str(exc), step, options.checkpoint_dir, stopped, engine)) from None
    except Stopped:
        _stopping()
        raise TrainingError(_stop_message("", step, options.checkpoint_dir, True, engine)) from None
    finally:
        engine.close()
        if _INTERRUPT.is_set() and rank == 0:
            _note_interrupted_step(step)


@contextmanager
def _collective(engine: Engine, what: str) -> Iterator[None]:
    """Turn a failed collective of the training loop into _CollectiveFailed, naming a rank that exited or froze."""
    try:
        yield
    except RuntimeError as exc:  # torch.distributed's errors: a peer gone or frozen, or a timeout
        raise _CollectiveFailed(str(engine.lost(what, exc))) from None


def _stop_message(reason: str, step: int, checkpoint_dir: str | None, stopped: bool, engine: Engine) -> str:
    """The one line a rank prints when training ends early: why, at which step, and what is safe."""
    if stopped:  # (a Ctrl-C or SIGTERM to `planner train` ends the ranks quietly: a stop here came otherwise)
        # the ranks gone when the engine caught the signal, before it told the others (who then exit), if it did
        gone = engine.gone_at_failure if engine.gone_at_failure is not None else engine.gone(wait_s=1.0)
        reason = (f"stopped by SIGTERM from the launcher (torchrun stops every rank when one exits: rank "
                  f"{', '.join(map(str, gone))} exited first)" if gone else
                  "stopped by SIGTERM while no rank of this machine had exited (a rank of another machine "
                  "exited, the job was cancelled, or the signal was sent to this rank alone)")
    return f"training stopped after step {step}: {reason}; {resume_note(checkpoint_dir)}"


def resume_note(checkpoint_dir: str | None) -> str:
    """What is safe once training stopped early: the last complete checkpoint in `checkpoint_dir`, or that none was."""
    found = latest_complete(checkpoint_dir) if checkpoint_dir else None
    return (f"the last complete checkpoint is {found.path}: continue with --resume" if found
            else "no checkpoint was written (use --checkpoint-dir DIR --checkpoint-every K to keep progress)")


def _note_interrupted_step(step: int) -> None:
    """Write `step` into the INTERRUPTED_FILE `planner train` named (if it did), which reads it once the job ended."""
    path = os.environ.get(INTERRUPTED_FILE)
    if path:
        try:
            Path(path).write_text(str(step))
        except OSError:  # the launcher then cannot say the step
            pass


def _optimizer_factory(name: str, lr: float) -> Any:
    return lambda params: make_optimizer(name, params, lr)


def _batches(options: TrainOptions, setup: Setup, skip: int, example: Any = None) -> Iterator[tuple[Any, Any]]:
    """(inputs, target) mini-batches of `setup.batch_size`: the loader's, epoch after epoch, after the
    `skip` batches a resumed run has already trained on; or one example batch, repeated. `example`: a microbatch
    of example_batch's inputs (`example_microbatch`), whose shapes past the first dimension rank 0 warns where the
    loader's inputs do not have (`_LoaderShapes`; None: not checked)."""
    loader = setup.model_file.data_loader
    if loader is None or options.data == "example":
        with torch.random.fork_rng(devices=[]):  # the training's random stream stays as it was
            torch.manual_seed(options.seed + 1)
            batch = _cast(setup.model_file.example_batch(setup.batch_size), setup.dtype)
        while True:
            yield batch
    batches, seen, noted = loader(setup.batch_size), 0, False
    unlike_example = _LoaderShapes(setup.rank, setup.batch_size, options.model_file, None if example is None else
                                   [(setup.batch_size, *t.shape[1:]) for t in tensors(example)])
    while True:
        empty = True
        for batch in batches:
            size = batch_size(batch)
            if size is not None and size != setup.batch_size:  # a loader's last, short batch: the plan's size only
                if not noted and setup.rank == 0:
                    print(f"note: data_loader({setup.batch_size}) yielded a batch of {size} samples; such batches "
                          "are skipped, as every step trains the plan's global batch (give the loader "
                          "drop_last=True to drop them yourself)", flush=True)
                noted = True
                continue
            empty = False
            seen += 1
            if seen > skip:
                batch = _cast(batch, setup.dtype)
                unlike_example.check(batch)
                yield batch
        if empty:
            raise TrainingError(f"{options.model_file}: data_loader({setup.batch_size}) yielded no batch of "
                                f"{setup.batch_size} samples; is the dataset smaller than one mini-batch?")


def check_loader(options: TrainOptions, setup: Setup) -> None:
    """The data loader's first batch keeps the model file's contract (`checked_batch`: a pair, inputs a tensor, a
    tuple of tensors or a dict of them named as example_batch's, a target tensor), where training reads the loader:
    ModelFileError naming what does not (a Hugging Face collator's one dict, labels inside, failed in the first
    stage's first op on every rank). `planner train` checks it before any worker starts; the loader is made once
    more here, for its first batch only."""
    loader = setup.model_file.data_loader
    if loader is None or options.data == "example":
        return
    said, nothing = f"data_loader({setup.batch_size})", object()
    try:
        first = next(iter(loader(setup.batch_size)), nothing)
    except (Exception, SystemExit) as exc:
        raise ModelFileError(options.model_file, f"{said} raised {type(exc).__name__}: {exc}",
                             "fix data_loader()") from exc
    if first is not nothing:  # (none: training says that no batch came)
        size = batch_size(first)  # a short batch (a dataset smaller than one) is training's to say
        checked_batch(setup.model_file, first, min(size or setup.batch_size, setup.batch_size), f"{said} yielded")


class _LoaderShapes:
    """Warns once (rank 0) where a loader's inputs differ in shape from `example_batch`'s at the same batch size
    (`example_shapes`; None: not checked), for which the profile measured the layers: another sequence length or
    image size moves every time and activation the plan predicts, and its memory (the run may not fit). A warning,
    not an error: batches padded to each one's longest sequence differ from step to step by design."""

    def __init__(self, rank: int, batch_size: int, model_file: str,
                 example_shapes: list[tuple[int, ...]] | None) -> None:
        self.batch_size, self.model_file, self.example = batch_size, model_file, example_shapes
        self.warned = rank != 0 or example_shapes is None

    def check(self, batch: tuple[Any, Any]) -> None:
        if self.warned or self.example is None:
            return
        found = [tuple(t.shape) for t in tensors(batch[0])]
        if found != self.example:
            self.warned = True
            size = self.batch_size
            print(f"warning: {self.model_file}: data_loader({size}) yielded inputs of shapes {_shapes(found)} where "
                  f"example_batch({size})'s are {_shapes(self.example)}, the shapes the profile measured: the plan's "
                  "times and memory hold for those (make example_batch() like the loader's batches, then profile "
                  "and partition again)", file=sys.stderr, flush=True)


def _shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join(str(shape) for shape in shapes) or "none"


class _Progress:
    """Rank 0's log: one line every `every` steps (and the first and last): step, loss, samples/s."""

    def __init__(self, enabled: bool, steps: int, batch_size: int, every: int, start: int) -> None:
        self.enabled, self.steps, self.batch_size, self.every = enabled, steps, batch_size, every
        self.first = start + 1
        self.since_step, self.since_s = start, time.perf_counter()

    def due(self, step: int) -> bool:
        """True on every rank at the same steps (the loss is fetched collectively)."""
        return step % self.every == 0 or step in (self.first, self.steps)

    def write(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        if self.enabled:
            rate = (step - self.since_step) * self.batch_size / max(now - self.since_s, 1e-9)
            print(f"step {step}/{self.steps}  loss {loss:.4f}  {rate:.1f} samples/s", flush=True)
        self.since_step, self.since_s = step, now


def _latest_loss(engine: Engine, losses: list[tuple[int, float]], last_rank: int, device: torch.device) -> float:
    """The last stage's newest loss, on every rank (a broadcast from the last stage's first rank)."""
    value = torch.tensor([losses[-1][1] if losses else math.nan], dtype=torch.float64,
                         device=device if dist.get_backend() == "nccl" else "cpu")
    with _collective(engine, "the loss broadcast"):
        dist.broadcast(value, src=last_rank)
    return float(value.item())


# --- checkpoints ---------------------------------------------------------------------------------


def _restore_weights(options: TrainOptions, setup: Setup,
                     digest: str) -> tuple[Checkpoint, list[dict[str, Any]]] | None:
    """With --resume: load the newest complete checkpoint's weights into the whole model and its RNG
    state; returns that checkpoint and its stage files, each read once (None when there is none)."""
    if not options.resume:
        return None
    found = latest_complete(options.checkpoint_dir)
    if found is None:
        if setup.rank == 0:
            print(f"no complete checkpoint in {options.checkpoint_dir}: starting from step 0", flush=True)
        return None
    stages = load_stages(found)
    state = merged_model_state(found, stages)
    missing, unexpected = setup.model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise TrainingError(f"{found.path} does not fit {options.model_file}: missing {list(missing)[:3]}, "
                            f"unexpected {list(unexpected)[:3]}; resume with the model it was trained with")
    torch.set_rng_state(stages[0]["rng_state"]["torch"])
    if setup.rank == 0:
        same = found.manifest.get("plan_digest") == digest
        print(f"resuming from {found.path} (step {found.step})"
              + ("" if same else ", made with another plan: weights and optimizer state re-split for this one"),
              flush=True)
    return found, stages


def _save(options: TrainOptions, engine: Engine, setup: Setup, step: int, digest: str) -> None:
    """Checkpoint after `step`: stage files by each stage's first replica, then rank 0's manifest once
    every rank reports success; a failure anywhere is a TrainingError on every rank.

    A rank of several stages (interleaved-1f1b) writes one file per own stage, as if each were on a rank
    of its own: its module's weights and the share of the rank's one optimizer state that its parameters'
    names hold (`_stage_share`). The optimizer state of SGD and Adam is per parameter, so the shares add
    up to the whole of it: the layout is the same as any plan's, and a resume under this plan or another
    re-splits it by name exactly (`merged_optimizer_state`)."""
    root = options.checkpoint_dir
    assert root is not None
    problem = None
    if engine.replica == 0:
        try:
            named = (named_optimizer_state(engine.optimizer, _named_parameters(engine, engine.stages))
                     if engine.optimizer is not None else None)
            for stage in engine.stages:
                module = engine.modules[stage]
                with signals_deferred():
                    save_stage(root, step, stage, model_state=module.state_dict(),
                               optimizer_state=None if named is None else _stage_share(named, engine, stage),
                               rng_state={"torch": torch.get_rng_state()}, plan_digest=digest,
                               meta={"rank": setup.rank})
        except CheckpointError as exc:
            problem = f"rank {setup.rank}: {exc}"
    problems: list[str | None] = [None] * setup.world
    with _collective(engine, "the checkpoint's all-gather"):
        dist.all_gather_object(problems, problem)
    verdict = [next((p for p in problems if p), None)]
    if setup.rank == 0 and verdict[0] is None:
        try:
            with signals_deferred():
                write_manifest(root, step, num_stages=len(setup.plan.stages), plan_digest=digest,
                               meta={"plan": options.plan, "model_file": options.model_file})
            prune(root, options.keep)
        except CheckpointError as exc:
            verdict[0] = f"rank 0: {exc}"
    with _collective(engine, "the checkpoint's broadcast"):
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:  # the CheckpointError says which complete checkpoint is intact
        raise TrainingError(f"checkpoint of step {step} failed: {verdict[0]}")


def _named_parameters(engine: Engine, stages: Sequence[int]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the modules of this rank's `stages`, every name of a tied parameter included
    (`remove_duplicate=False`): `runtime.optimizer_state` keeps a parameter once however many names it
    has, and a stage that knows a tied parameter by another name finds its state under that name."""
    return [named for stage in stages for named in engine.modules[stage].named_parameters(remove_duplicate=False)]


def _stage_share(named: dict[str, Any], engine: Engine, stage: int) -> dict[str, Any]:
    """The part of the rank's `named_optimizer_state` that names `stage`'s parameters: their state,
    shapes, and each param group's hyper-parameters with its parameters of this stage (all of it on a
    rank of one stage)."""
    names = {name for name, _ in _named_parameters(engine, [stage])}
    return {"state": {name: value for name, value in named["state"].items() if name in names},
            "param_groups": [{**group, "params": [name for name in group["params"] if name in names]}
                             for group in named["param_groups"]],
            "shapes": {name: shape for name, shape in named["shapes"].items() if name in names}}


# --- the end --------------------------------------------------------------------------------------


def warmup_steps(steps: int, memory_step: int) -> int:
    """The steps a run's report leaves out: the first (allocations, caches) up to the one whose memory was
    measured (which measuring slowed), while at least one step is left; none when there is only one."""
    return max(min(memory_step + 1, steps - 1), 0)


def _finish(options: TrainOptions, setup: Setup, engine: Engine, losses: list[tuple[int, float]],
            start_step: int) -> None:
    """Gather the traces and losses on rank 0 and write the run report there."""
    path = Path(options.report or Path("runs") / f"{Path(options.plan).stem}.report.json")
    meta = {"model_file": options.model_file, "optimizer": setup.optimizer, "first_step": start_step + 1}
    with _collective(engine, "gathering the run report"):
        kept = keep_previous(path) if setup.rank == 0 else None  # (rank 0 writes the report)
        if kept is not None:
            print(f"note: {path} held a report already; it is kept as {kept}", flush=True)
        written = save_run_report(engine, setup.plan, path, batch_size=setup.batch_size, losses=losses,
                                  warmup_steps=warmup_steps(len(engine.step_spans), engine.memory_step),
                                  plan_path=options.plan,
                                  meta=meta)
    if written is not None:
        print(f"wrote {written} (compare with `planner compare {options.plan} {written}`)", flush=True)


if __name__ == "__main__":
    exit_worker(main())  # every file is written and synced by now
