"""Pipeline runtime cost on CPU: our engine against torch.distributed.pipelining, measured against predicted.

    python benchmarks/runtime_overhead.py [--quick] [--batch-size 32] [--microbatches 4] [--rounds 10]

The GPT-like example (examples/gpt.py, train mode, so dropout is on for every side), one torch
thread per process, SGD (lr 1e-3); every measured step is a whole training step: forward,
backward, gradient sums and the optimizer step. Three parts, each side by side in one run:

1. Two processes under torchrun (gloo), the model split in two at `transformer.h.6`
   (`runtime.stages.split_model`): torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
   ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1) on manual PipelineStages of the same
   split modules, against `runtime.engine.Engine` with "gpipe", "1f1b" and "zb-h1", and zb-h1's
   time over 1f1b's on each side. Rounds interleave the runners (the order rotates each round); each step is
   timed between two barriers; medians and ratios are reported. pipelining does not sum the
   gradients of a parameter held by several stages (the tied `lm_head.weight` /
   `transformer.wte.weight`): the benchmark all-reduces that gradient itself after each
   pipelining step, so both sides do the same work (the cost of that all-reduce is printed).
2. Measured against predicted: the example is profiled (`planner.profiling.profiler.profile_model`, one
   thread, batch = the microbatch size), the loopback gloo bandwidth is measured between the two
   processes, `planner.planning.partition.partition` makes a straight 2-stage plan per schedule on
   `make_cluster(2, bandwidths=(measured,))`, and the engine runs that plan's own split
   (`build_stages`) in the same interleaved rounds. Besides the ratio measured / predicted, the
   stages' forward + backward (both ranks at once, without messages, in the schedule's order:
   GPipe keeps every microbatch's activations alive, which alone makes compute slower), the
   optimizer steps and the tied all-reduce are timed alone in the same processes, to say where a
   difference comes from.
3. In this process: `runtime.Pipeline` (1f1b, same split) plus the optimizer step against plain
   single-device training on the same batch, and against plain training accumulating gradients
   over the same microbatches (smaller microbatches alone change the speed: cache effects), one
   torch thread, first with the process pinned to one core (the pipeline's own cost: every side
   gets one core) and then with every core (its two stage threads may overlap).

Absolute times on shared machines drift by tens of percent within minutes; compare the ratios.

Why one script of ~700 lines: the three parts must run in one sitting, interleaved, for their
ratios to compare (the machine drifts between runs); the worker and the launcher share its runners.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from planner.files.cluster import make_cluster
from planner.profiling.model_file import ModelFile, load_model_file
from planner.planning.partition import partition
from planner.files.plan import Plan
from planner.files.profile import load_profile
from planner.profiling.profiler import ProfileSettings, profile_model
from runtime.engine import Engine, EngineError, init_distributed
from planner.profiling.conditions import steady_malloc
from runtime.stages import Stages, build_stages, split_model, stage_args

REPO = Path(__file__).resolve().parents[1]

MODEL = REPO / "examples" / "gpt.py"
SPLIT = "transformer.h.6"
LR = 1e-3
MODEL_SEED = 0
BATCH_SEED = 1000
PING_BYTES = 4 * 2**20
SCHEDULES = ("gpipe", "1f1b", "zb-h1")

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[torch.Tensor, torch.Tensor], "float | None"]


# --- shared helpers ------------------------------------------------------------------------------


def model_file() -> ModelFile:
    """The GPT-like example."""
    return load_model_file(MODEL)


def fresh_model(source: ModelFile) -> nn.Module:
    """The example's model, built from the same seed every time (identical weights), in train mode."""
    torch.manual_seed(MODEL_SEED)
    model = source.build_model()
    model.train()
    return model


def batch(source: ModelFile, size: int, index: int) -> Batch:
    """Mini-batch number `index` (the same on every process and for every runner)."""
    torch.manual_seed(BATCH_SEED + index)
    inputs, target = source.example_batch(size)
    return inputs, target


def median_ms(seconds: list[float]) -> float:
    """Median of `seconds`, in milliseconds."""
    return 1000.0 * statistics.median(seconds)


def sgd(parameters: Any) -> torch.optim.Optimizer:
    """The optimizer of every side."""
    return torch.optim.SGD(parameters, lr=LR)


# --- part 3: in-process pipeline against plain training ------------------------------------------


def plain_runner(source: ModelFile, microbatches: int = 1) -> StepFn:
    """One plain training step: forward, loss and backward of each of `microbatches` chunks, optimizer step.

    With one chunk, plain training on the whole batch; with several, gradient accumulation over
    the same chunks the pipeline runs (each loss scaled by its chunk's share of the batch).
    """
    model = fresh_model(source)
    optimizer = sgd(model.parameters())

    def step(inputs: torch.Tensor, target: torch.Tensor) -> float:
        total = 0.0
        for chunk, goal in zip(inputs.chunk(microbatches), target.chunk(microbatches)):
            loss = source.loss_fn(model(chunk), goal) * (chunk.shape[0] / inputs.shape[0])
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def in_process_runner(source: ModelFile, microbatches: int) -> tuple[StepFn, Callable[[], None]]:
    """One `runtime.Pipeline` 1f1b step of the split model plus the optimizer step; and its close()."""
    from runtime.pipeline import Pipeline

    model = fresh_model(source)
    stages = split_model(model, [SPLIT])
    pipeline = Pipeline(stages, ["cpu", "cpu"], "1f1b", microbatches, loss_fn=source.loss_fn)
    optimizer = sgd(model.parameters())

    def step(inputs: torch.Tensor, target: torch.Tensor) -> float:
        loss = pipeline.train_step(inputs, target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, pipeline.close


def in_process_ratio(source: ModelFile, batch_size: int, microbatches: int, rounds: int,
                     cores: set[int]) -> dict[str, Any]:
    """Median step times of plain, accumulated and pipelined training with this thread on `cores`.

    The pipeline's worker threads start after the affinity is set, so they inherit it.
    """
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)  # this thread only; threads started from now on inherit it
    try:
        runners = {"plain": plain_runner(source), "accumulated": plain_runner(source, microbatches)}
        runners["pipeline"], close = in_process_runner(source, microbatches)
        try:
            times = interleave(runners, source, batch_size, rounds, warmup=2, synchronize=lambda: None)
        finally:
            close()
    finally:
        os.sched_setaffinity(0, previous)
    row: dict[str, Any] = {"cores": len(cores)}
    row |= {f"{name}_ms": median_ms(values) for name, values in times.items()}
    row["ratio"] = round_ratio(times["pipeline"], times["plain"])
    row["ratio_accumulated"] = round_ratio(times["pipeline"], times["accumulated"])
    return row


def interleave(runners: dict[str, StepFn], source: ModelFile, batch_size: int, rounds: int, warmup: int,
               synchronize: Callable[[], None], losses: dict[str, list[float]] | None = None,
               progress: Callable[[str], None] | None = None,
               failures: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Seconds per step of each runner: `warmup` untimed rounds, then `rounds` timed ones.

    Every runner gets the same mini-batch in a round; the order of the runners rotates each round.
    `synchronize()` runs right before and right after each timed step (a barrier across processes).
    With `failures`, a runner whose step raises EngineError (raised on every rank alike) is
    dropped and the error recorded there; the others go on.
    """
    errors = (EngineError,) if failures is not None else ()
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        inputs, target = batch(source, batch_size, index)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize()
            start = time.perf_counter()
            try:
                loss = runners[name](inputs, target)
            except errors as error:
                assert failures is not None
                failures[name] = f"round {index + 1 - warmup} ({'warmup' if index < warmup else 'timed'}): {error}"
                names.remove(name)
                continue
            synchronize()
            elapsed = time.perf_counter() - start
            if index >= warmup:
                times[name].append(elapsed)
            if losses is not None and loss is not None:
                losses.setdefault(name, []).append(float(loss))
        if progress is not None:
            progress(f"warmup round {index + 1}/{warmup}" if index < warmup else
                     f"round {index - warmup + 1}/{rounds}: " + ", ".join(
                         f"{name} {1000 * times[name][-1]:.0f} ms" for name in names))
    return times


# --- part 1 and 2: the torchrun worker -----------------------------------------------------------


@dataclass
class World:
    """This process's place in the torchrun job, and a process group of its own for timing and sums."""

    rank: int
    size: int
    group: Any


def init_world() -> World:
    """Initialise torch.distributed with the engine's init_distributed (gloo on CPU)."""
    init_distributed()
    # a separate group: barriers and the tied all-reduce never share a group with the runtimes' traffic
    return World(dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo"))


def barrier(world: World) -> None:
    """Every process reaches this point before any goes on."""
    dist.barrier(group=world.group)


def ping_pong_ms(world: World, nbytes: int, trials: int) -> float:
    """Median one-way time (half a round trip) of a tensor of `nbytes` between ranks 0 and 1."""
    tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    times = []
    for trial in range(trials + 2):
        barrier(world)
        start = time.perf_counter()
        if world.rank == 0:
            dist.send(tensor, 1, group=world.group)
            dist.recv(tensor, 1, group=world.group)
        elif world.rank == 1:
            dist.recv(tensor, 0, group=world.group)
            dist.send(tensor, 0, group=world.group)
        if trial >= 2:
            times.append((time.perf_counter() - start) / 2)
    return median_ms(times)


def tied_parameters(stages: Stages, rank: int) -> list[nn.Parameter]:
    """The parameters of this rank's stage that other stages also hold (their gradients must be summed)."""
    own = dict(stages[rank].named_parameters())
    found = []
    for shared in stages.shared:
        if rank in shared.stages:
            if len(shared.stages) != len(stages):
                raise SystemExit(f"shared parameter {shared.names} is in stages {shared.stages}: this benchmark "
                                 "sums tied gradients over every stage only")
            found.append(own[shared.stage_names[shared.stages.index(rank)]])
    return found


def sum_tied_gradients(world: World, parameters: list[nn.Parameter]) -> None:
    """All-reduce (sum) the gradients of the tied parameters across the stages holding them."""
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, group=world.group)


def pipelining_runner(world: World, source: ModelFile, schedule: str, microbatches: int) -> StepFn:
    """torch.distributed.pipelining on this rank's stage of the split at SPLIT, plus the tied sum and SGD."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble

    stages = split_model(fresh_model(source), [SPLIT])
    module = stages[world.rank]
    # no input_args/output_args: the stage infers shapes from the first step's microbatch
    stage = PipelineStage(module, world.rank, len(stages), torch.device("cpu"))
    # scale_grads (default True) divides gradients by the microbatch count: mean-loss semantics; zb-h1 is the
    # zero-bubble class on one stage per rank (it takes a list of the rank's stages)
    if schedule == "zb-h1":
        runner: Any = ScheduleInterleavedZeroBubble([stage], n_microbatches=microbatches, loss_fn=source.loss_fn)
    else:
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        runner = kind(stage, n_microbatches=microbatches, loss_fn=source.loss_fn)
    optimizer = sgd(module.parameters())
    tied = tied_parameters(stages, world.rank)
    first, last = world.rank == 0, world.rank == len(stages) - 1

    def step(inputs: torch.Tensor, target: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        if first:
            runner.step(inputs)
        elif last:
            runner.step(target=target, losses=losses, return_outputs=False)
        else:
            runner.step()
        sum_tied_gradients(world, tied)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else None

    return step


def engine_runner(stages: Stages, source: ModelFile, schedule: str, microbatches: int
                  ) -> tuple[StepFn, Callable[[], None]]:
    """Our engine on `stages` (every rank passes them all and keeps its own); its step and close()."""
    engine = Engine(stages, schedule=schedule, stage_ranks=[[index] for index in range(len(stages))],
                    microbatches=microbatches, optimizer=sgd, loss_fn=source.loss_fn, checkpoint=False)

    def step(inputs: torch.Tensor, target: torch.Tensor) -> float | None:
        loss = engine.train_step(inputs, target)
        return None if loss is None else float(loss)

    return step, engine.close


def make_plans(profile_path: Path, bandwidth_Bps: float, microbatches: int, microbatch_size: int
               ) -> dict[str, Plan]:
    """A straight 2-stage plan per schedule for the profiled model on a flat 2-device cluster."""
    profile = load_profile(profile_path)
    cluster = make_cluster(2, bandwidths=(bandwidth_Bps,))
    return {schedule: partition(profile, cluster, straight=True, optimizer="sgd", schedule=schedule,
                                microbatches=microbatches, microbatch_size=microbatch_size, recompute=False,
                                profile_path=str(profile_path))
            for schedule in SCHEDULES}


class StagesAlone:
    """A runner: this rank's stage of `stages` alone (no pipeline, no messages) on the microbatches, then SGD.

    `schedule` gives the order: "1f1b" runs each microbatch's forward and backward before the
    next (at most one in flight, as 1F1B's steady state on the last stage); "gpipe" runs every
    forward, then every backward (all microbatches' activations alive at once, as GPipe).
    Both ranks compute at the same time, as in the pipeline; records forward + backward seconds
    per microbatch (the step's compute over the microbatch count; loss included on the last
    stage) and the optimizer step. Ranks after the first get their inputs from the earlier
    stages once, on the first step's batch (the time depends on shapes, not values), untimed.
    """

    def __init__(self, world: World, stages: Stages, source: ModelFile, microbatches: int, schedule: str) -> None:
        self.world, self.stages, self.source, self.microbatches = world, stages, source, microbatches
        self.schedule = schedule
        self.module = stages[world.rank]
        self.optimizer = sgd(self.module.parameters())
        self.compute_s: list[float] = []
        self.optimizer_s: list[float] = []
        self._later: list[tuple[Any, ...]] | None = None  # stage inputs of ranks after the first

    def _arguments(self, inputs: torch.Tensor) -> tuple[Any, ...]:
        """This rank's stage's arguments for `inputs`, from the stages before it (no grad)."""
        with torch.no_grad():
            value: Any = self.stages[0](inputs)
            for index in range(1, self.world.rank):
                value = self.stages[index](*stage_args(self.stages[index - 1], value))
        return tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                     for a in stage_args(self.stages[self.world.rank - 1], value))

    def _forward(self, args: tuple[Any, ...], target: torch.Tensor) -> list[torch.Tensor]:
        """The stage's forward: the tensors to backpropagate from (the scaled loss on the last stage)."""
        output = self.module(*args)
        if self.world.rank == len(self.stages) - 1:
            return [self.source.loss_fn(output, target) / self.microbatches]
        return [t for t in stage_args(self.module, output) if isinstance(t, torch.Tensor) and t.requires_grad]

    def __call__(self, inputs: torch.Tensor, target: torch.Tensor) -> None:
        chunks = list(zip(inputs.chunk(self.microbatches), target.chunk(self.microbatches)))
        if self.world.rank == 0:
            arguments = [(chunk,) for chunk, _ in chunks]
        else:
            if self._later is None:
                self._later = [self._arguments(chunk) for chunk, _ in chunks]
            arguments = [tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                               for a in args) for args in self._later]
        barrier(self.world)
        start = time.perf_counter()
        if self.schedule == "gpipe":
            pending = [self._forward(args, goal) for args, (_, goal) in zip(arguments, chunks)]
            for outputs in pending:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        else:
            for args, (_, goal) in zip(arguments, chunks):
                outputs = self._forward(args, goal)
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        middle = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.compute_s.append((middle - start) / self.microbatches)
        self.optimizer_s.append(time.perf_counter() - middle)

    def summary(self, warmup_steps: int) -> dict[str, float]:
        """Medians after the warmup steps: forward + backward per microbatch, and the optimizer step (ms)."""
        return {"compute_ms": median_ms(self.compute_s[warmup_steps:]),
                "optimizer_ms": median_ms(self.optimizer_s[warmup_steps:])}


def tied_allreduce_ms(world: World, stages: Stages, trials: int) -> float:
    """Median time of the tied-gradient all-reduce alone."""
    tied = tied_parameters(stages, world.rank)
    for parameter in tied:
        parameter.grad = torch.ones_like(parameter)
    times = []
    for trial in range(trials + 2):
        barrier(world)
        start = time.perf_counter()
        sum_tied_gradients(world, tied)
        if trial >= 2:
            times.append(time.perf_counter() - start)
    for parameter in tied:
        parameter.grad = None
    return median_ms(times)


def plan_summary(plan: Plan) -> dict[str, Any]:
    """What the comparison needs from a plan."""
    return {
        "split": [stage.first_layer for stage in plan.stages[1:]],
        "stages": len(plan.stages),
        "schedule": plan.schedule,
        "microbatches": plan.microbatches,
        "predicted_ms": plan.predicted.iteration_ms,
        "objective_ms": plan.predicted.objective_ms,
        "bubble_fraction": plan.predicted.bubble_fraction,
        "stage_compute_ms": [stage.compute_ms for stage in plan.stages],
        "stage_comm_ms": [stage.comm_ms for stage in plan.stages],
    }


def gather(world: World, value: Any) -> list[Any]:
    """`value` from every rank, in rank order (on every rank)."""
    values: list[Any] = [None] * world.size
    dist.all_gather_object(values, value, group=world.group)
    return values


def measure_links(world: World, source: ModelFile, microbatch_size: int, trials: int) -> dict[str, Any]:
    """Gloo loopback: one-way time of PING_BYTES (the bandwidth) and of the boundary tensor at SPLIT."""
    stages = split_model(fresh_model(source), [SPLIT])
    with torch.no_grad():
        sent = stage_args(stages[0], stages[0](batch(source, microbatch_size, 0)[0]))
    boundary_bytes = sum(t.numel() * t.element_size() for t in sent if isinstance(t, torch.Tensor))
    ping_ms = ping_pong_ms(world, PING_BYTES, trials)
    return {"ping_ms": ping_ms, "bandwidth_Bps": PING_BYTES / (ping_ms / 1000), "boundary_bytes": boundary_bytes,
            "boundary_ms": ping_pong_ms(world, boundary_bytes, trials),
            "tied_allreduce_ms": tied_allreduce_ms(world, stages, trials)}


def build_runners(world: World, source: ModelFile, plans: dict[str, Plan], microbatches: int
                  ) -> tuple[dict[str, StepFn], list[Callable[[], None]], dict[str, StagesAlone]]:
    """Every runner of parts 1 and 2 (by name), the engines' close(), the stages-alone runners by schedule."""
    runners: dict[str, StepFn] = {}
    closers: list[Callable[[], None]] = []
    alone: dict[str, StagesAlone] = {}
    for schedule in SCHEDULES:
        runners[f"pipelining {schedule}"] = pipelining_runner(world, source, schedule, microbatches)
    for schedule in SCHEDULES:
        step, close = engine_runner(split_model(fresh_model(source), [SPLIT]), source, schedule, microbatches)
        runners[f"engine {schedule}"], closers = step, closers + [close]
    for schedule, plan in plans.items():
        if len(plan.stages) != 2:
            continue
        step, close = engine_runner(build_stages(fresh_model(source), plan), source, schedule, microbatches)
        runners[f"engine plan {schedule}"], closers = step, closers + [close]
        alone[schedule] = StagesAlone(world, build_stages(fresh_model(source), plan), source, microbatches,
                                      schedule)
        runners[f"stages alone, {schedule} order"] = alone[schedule]
    return runners, closers, alone


def worker(args: argparse.Namespace) -> None:
    """One torchrun process: measure parts 1 and 2; rank 0 writes the results to `args.result`."""
    torch.set_num_threads(1)
    world = init_world()
    if world.size != 2:
        raise SystemExit(f"this benchmark runs on 2 processes, got {world.size}")
    say = (lambda text: print(text, flush=True)) if world.rank == 0 else (lambda text: None)
    source = model_file()
    microbatch_size = args.batch_size // args.microbatches
    results = measure_links(world, source, microbatch_size, trials=5 if args.quick else 10)
    say(f"gloo loopback: {PING_BYTES / 2**20:.0f} MiB one way {results['ping_ms']:.2f} ms "
        f"({results['bandwidth_Bps'] / 1e9:.2f} GB/s); boundary {results['boundary_bytes'] / 1024:.0f} KiB "
        f"{results['boundary_ms']:.3f} ms; tied all-reduce {results['tied_allreduce_ms']:.2f} ms")

    plans = make_plans(Path(args.profile), results["bandwidth_Bps"], args.microbatches, microbatch_size)
    results["plans"] = {schedule: plan_summary(plan) for schedule, plan in plans.items()}
    for schedule, plan in plans.items():
        say(f"plan {schedule}: split at {', '.join(results['plans'][schedule]['split']) or '(none)'}, "
            f"predicted {plan.predicted.iteration_ms:.1f} ms per iteration")

    runners, closers, alone = build_runners(world, source, plans, args.microbatches)
    losses: dict[str, list[float]] = {}
    results["failures"] = {}
    results["times_s"] = interleave(runners, source, args.batch_size, args.rounds, args.warmup,
                                    lambda: barrier(world), losses, say, results["failures"])
    for name, failure in results["failures"].items():
        say(f"{name} failed in {failure}")
    for close in closers:
        close()
    results["losses"] = merge_losses(gather(world, losses))
    results["alone"] = {schedule: gather(world, runner.summary(args.warmup)) for schedule, runner in alone.items()}
    if world.rank == 0:
        Path(args.result).write_text(json.dumps(results, indent=1))
    barrier(world)


def merge_losses(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """The losses reported on any rank (the last stage's rank reports them)."""
    merged: dict[str, list[float]] = {}
    for losses in per_rank:
        for name, values in losses.items():
            merged.setdefault(name, values)
    return merged


# --- the parent: profile, launch torchrun, report ------------------------------------------------


def profile_microbatch(path: Path, microbatch_size: int, quick: bool) -> None:
    """Profile the example at the microbatch size with one thread (train mode, as the profiler runs it), on the CPU
    that the benchmark's processes train on."""
    settings = ProfileSettings(batch_size=microbatch_size, device="cpu", threads=1, warmup=2 if quick else 3,
                               iters=5 if quick else 10)
    profile_model(model_file(), settings).save(path)


def launch_workers(args: argparse.Namespace, profile: Path, result: Path) -> dict[str, Any]:
    """Run this file under torchrun on 2 processes; their results."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), "--worker", "--profile", str(profile), "--result", str(result),
               "--batch-size", str(args.batch_size), "--microbatches", str(args.microbatches),
               "--rounds", str(args.rounds), "--warmup", str(args.warmup)] + (["--quick"] if args.quick else [])
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(command, check=False, env=environment, cwd=REPO, timeout=1200)
    if not result.exists():
        raise SystemExit(f"torchrun workers failed (exit code {completed.returncode}); see their output above")
    results = json.loads(result.read_text())
    if completed.returncode != 0:  # after writing the results: e.g. a failed engine's thread aborting at exit
        results["exit_note"] = (f"torchrun exited with code {completed.returncode} after the workers wrote "
                                "their results (see their output above)")
    return results


def round_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of numerator / denominator (the same round: the same machine drift)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def report(args: argparse.Namespace, results: dict[str, Any], in_process: list[dict[str, Any]],
           foreign: str) -> None:
    """Print the three parts, then the summary table."""
    steps = {name: values for name, values in results["times_s"].items() if values}
    times = {name: median_ms(values) for name, values in steps.items()}
    summary: list[tuple[str, str]] = []
    print()
    print(f"model gpt.py (train mode), batch {args.batch_size}, {args.microbatches} microbatches, "
          f"{args.rounds} interleaved rounds (+{args.warmup} warmup), 1 torch thread per process, SGD lr {LR}")
    print(f"gloo loopback: {PING_BYTES / 2**20:.0f} MiB one way {results['ping_ms']:.2f} ms "
          f"({results['bandwidth_Bps'] / 1e9:.2f} GB/s); the {results['boundary_bytes'] / 1024:.0f} KiB boundary "
          f"tensor {results['boundary_ms']:.3f} ms")
    print(foreign)
    print()
    print(f"1. two processes, split at {SPLIT}; median step (ms); ratio = engine throughput / pipelining "
          "throughput (median of per-round ratios)")
    print(f"   torch.distributed.pipelining does not sum the tied lm_head/wte gradient across its stages (the "
          f"engine does): the benchmark all-reduces it after each pipelining step ({results['tied_allreduce_ms']:.2f}"
          " ms alone)")
    print(f"   {'schedule':9s} {'pipelining':>10s} {'engine':>8s} {'ratio':>6s}")
    for schedule in SCHEDULES:
        theirs, ours = f"pipelining {schedule}", f"engine {schedule}"
        if ours not in steps:
            print(f"   {schedule:9s} {times[theirs]:10.1f} {'n/a':>8s} {'n/a':>6s}")
            continue
        ratio = round_ratio(steps[theirs], steps[ours])
        print(f"   {schedule:9s} {times[theirs]:10.1f} {times[ours]:8.1f} {ratio:6.2f}")
        summary.append((f"engine / pipelining throughput, {schedule}", f"{ratio:.2f}"))
    for split, whole in (("engine zb-h1", "engine 1f1b"), ("pipelining zb-h1", "pipelining 1f1b"),
                         ("engine plan zb-h1", "engine plan 1f1b")):
        if split in steps and whole in steps:
            ratio = round_ratio(steps[split], steps[whole])
            print(f"   {split} / {whole.split()[-1]} time: {ratio:.2f} (B and W apart, W deferred into the bubbles"
                  f"{'; the plan split of part 2' if 'plan' in split else ''})")
            summary.append((f"{split} / {whole} time", f"{ratio:.2f}"))
    for name, failure in results["failures"].items():
        print(f"   {name} FAILED in {failure}; its medians cover the rounds before")
    if "exit_note" in results:
        print(f"   {results['exit_note']}")
    print_losses(results["losses"])
    print()
    print("2. measured against predicted: the engine on the plan's own split; profile at the microbatch size, "
          "1 thread")
    summary += print_predictions(args, results, times)
    print()
    print(f"3. one process: runtime.Pipeline (1f1b, split at {SPLIT}) + SGD against plain training, 1 torch thread;")
    print(f"   accumulated = plain training over the same {args.microbatches} microbatches one after the other; "
          "ratios = pipeline time / other time, median of per-round ratios")
    print(f"   {'cores':>5s} {'plain':>7s} {'accumulated':>11s} {'pipeline':>8s} {'/ plain':>8s} {'/ accumulated':>13s}")
    for row in in_process:
        print(f"   {row['cores']:5d} {row['plain_ms']:7.1f} {row['accumulated_ms']:11.1f} {row['pipeline_ms']:8.1f} "
              f"{row['ratio']:8.2f} {row['ratio_accumulated']:13.2f}")
        summary.append((f"in-process pipeline / plain time, {row['cores']} core(s)", f"{row['ratio']:.2f}"))
        summary.append((f"in-process pipeline / accumulated time, {row['cores']} core(s)",
                        f"{row['ratio_accumulated']:.2f}"))
    print("   (1 core: the process pinned to one core, so the two stage threads cannot overlap)")
    print()
    width = max(len(what) for what, _ in summary)
    print(f"{'summary':{width}s}  ratio")
    for what, value in summary:
        print(f"{what:{width}s}  {value}")


def print_losses(losses: dict[str, list[float]]) -> None:
    """Mean loss per runner over the run: every side trains the same model on the same batches."""
    if losses:
        print("   mean loss over the run (same start, same batches; dropout differs): " + ", ".join(
            f"{name} {statistics.mean(values):.3f}" for name, values in losses.items()))


def print_predictions(args: argparse.Namespace, results: dict[str, Any], times: dict[str, float]
                      ) -> list[tuple[str, str]]:
    """Measured / predicted per schedule, and where the difference comes from; the summary rows."""
    m = args.microbatches
    rows = []
    for schedule, plan in results["plans"].items():
        measured = times.get(f"engine plan {schedule}")
        print(f"   {schedule}: split at {', '.join(plan['split']) or '(none)'}; predicted {plan['predicted_ms']:.1f} ms "
              f"(closed form {plan['objective_ms']:.1f}, bubbles {100 * plan['bubble_fraction']:.0f}%)")
        if plan["stages"] != 2 or measured is None:
            print("      not run" + (f": the plan has {plan['stages']} stage(s)" if plan["stages"] != 2 else ""))
            continue
        ratio = measured / plan["predicted_ms"]
        rows.append((f"measured / predicted iteration, {schedule}", f"{ratio:.2f}"))
        print(f"      measured {measured:.1f} ms: measured / predicted {ratio:.2f} (the issue asks within 15%)")
        parts = results["alone"][schedule]
        profiled = plan["stage_compute_ms"]
        alone = [part["compute_ms"] for part in parts]
        optimizer = max(part["optimizer_ms"] for part in parts)
        flush_profiled = sum(profiled) + (m - 1) * max(profiled)
        flush_alone = sum(alone) + (m - 1) * max(alone)
        extras = optimizer + results["tied_allreduce_ms"] + 2 * results["boundary_ms"]
        print(f"      fwd+bwd per microbatch, stage 0 / 1: profile {profiled[0]:.1f} / {profiled[1]:.1f} ms; "
              f"both stages alone at once in {schedule} order, same rounds {alone[0]:.1f} / {alone[1]:.1f} ms")
        print(f"      compute, sum t + (m-1) max t: profile {flush_profiled:.1f} ms, stages alone {flush_alone:.1f} ms "
              f"({flush_alone / flush_profiled:.2f}x)")
        print(f"      not in the cost model: optimizer step {optimizer:.1f} ms, tied all-reduce "
              f"{results['tied_allreduce_ms']:.1f} ms, fill + drain transfers {2 * results['boundary_ms']:.1f} ms")
        print(f"      measured - stages alone - those: {measured - flush_alone - extras:+.1f} ms "
              "(the engine's own cost and waits)")
    return rows


def cpu_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (/proc/stat), None where there is no /proc/stat."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (torchrun and its workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def foreign_load(busy_before: float | None, own_before: float, wall_s: float) -> str:
    """A line on the CPU time other processes took during the run (they slow every side alike)."""
    busy_after = cpu_busy_s()
    if busy_before is None or busy_after is None:
        return f"run took {wall_s:.0f} s"
    other = max(0.0, (busy_after - busy_before) - (own_cpu_s() - own_before))
    return (f"run took {wall_s:.0f} s; other processes on the machine used {other:.0f} CPU-s meanwhile "
            f"({other / wall_s:.2f} of {os.cpu_count()} cores on average)")


def main() -> None:
    """Parent: part 3 here, profile, parts 1 and 2 under torchrun, then the tables. Worker: see `worker`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=None, help="timed interleaved rounds (default 10, quick 4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and trials")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steady_malloc(sys.argv)
    if args.rounds is None:
        args.rounds = 4 if args.quick else 10
    if args.batch_size % args.microbatches:
        parser.error("--batch-size must be a multiple of --microbatches")
    if args.worker:
        from runtime.worker_exit import exit_worker

        worker(args)
        exit_worker(0)  # (torch's gloo teardown at exit aborts now and then: runtime.worker_exit)
    torch.set_num_threads(1)
    busy_before, own_before, started = cpu_busy_s(), own_cpu_s(), time.perf_counter()
    source = model_file()
    print("part 3: in-process pipeline against plain training", flush=True)
    in_process = [in_process_ratio(source, args.batch_size, args.microbatches, args.rounds, cores)
                  for cores in ({min(os.sched_getaffinity(0))}, os.sched_getaffinity(0))]
    with tempfile.TemporaryDirectory() as directory:
        profile = Path(directory) / "gpt.json"
        print(f"profiling at batch {args.batch_size // args.microbatches} with 1 thread", flush=True)
        profile_microbatch(profile, args.batch_size // args.microbatches, args.quick)
        print("parts 1 and 2: torchrun, 2 processes", flush=True)
        results = launch_workers(args, profile, Path(directory) / "result.json")
    report(args, results, in_process, foreign_load(busy_before, own_before, time.perf_counter() - started))


if __name__ == "__main__":
    main()
