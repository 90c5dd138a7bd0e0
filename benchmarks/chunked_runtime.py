"""The schedules of issue 17 trained side by side: our engine against torch.distributed.pipelining, per schedule.

    python benchmarks/chunked_runtime.py [--rounds 8] [--microbatch-size 8] [--microbatches 4] [--schedules 1f1b ...]
                                         [--model gpt]

examples/gpt.py (train mode; `--model` another example), two CPU processes under torchrun (gloo), one torch
thread each, SGD. For each of 1f1b, zb-h1, interleaved-1f1b and zbv the planner makes its straight plan of the
example's shipped profile (profiles/gpt.json) on 2 GPUs with `--microbatches` microbatches (`partition(..., schedule=)`),
and both runtimes train that same plan, the same split and the same batches:

- ours: `runtime.engine.Engine.from_plan` (the schedule as data, B and W apart where it splits);
- torch's: `runtime.pippy.build`, which wraps the plan's stages in PipelineStages and runs torch's own
  class for the schedule (Schedule1F1B, ScheduleInterleavedZeroBubble on one stage per rank for zb-h1,
  ScheduleInterleaved1F1B, ScheduleZBVZeroBubble), then `finish_gradients` (the tied embedding's sum).

Every step is a whole training step (forward, backward, gradient sums, optimizer step), timed between
two barriers; rounds run every runner once, in an order that rotates each round, after two warm-up
rounds. Printed: the median step per runner, torch's over ours per schedule (above 1: ours is faster),
and each schedule over 1f1b on both sides. Absolute times on a shared 2-core machine drift; compare
ratios measured in the same run. The paired columns take torch's step over ours within each round (the two
ran seconds apart, so a slow spell of the machine moves both) and give the median and the quartiles of those
ratios: where the quartiles straddle 1.0, the run cannot tell the two runtimes apart. The second paired column
does the same for each schedule's step over 1f1b's in our engine (issue 17's zb-h1 target: at most 0.95).

Then each rank's CPU seconds a step (`time.process_time`, every thread of the process: the compute, the runtime's
own threads, gloo's), the median over the rounds: where the two runtimes take the same wall time, this tells whether
one does more work in it.

Then the peak memory of a step per rank, MB (CPU: the live tensors of `planner.profiling.memory`, receive
buffers included): ours as the engine measured its memory step (`Engine.peak_memory`), torch's over one more
step after the rounds, measured the same way (`peak_memory_of` with `count_inputs`).
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
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b", "zbv")
LR = 1e-3
# the engine measures the memory its step needs on its second step (`Engine.memory_step`), which that slows (gpt:
# 838 ms against 580-620): timed, it counted against ours in one round of every run
WARMUP_ROUNDS = 2


def make_plans(folder: Path, model: str, microbatches: int, microbatch_size: int,
               schedules: tuple[str, ...]) -> dict[str, str]:
    """The planner's straight 2-GPU plan of the example's shipped profile per schedule, saved; name -> path."""
    from planner.files.cluster import make_cluster
    from planner.files.profile import load_profile
    from planner.planning.partition import partition

    profile = load_profile(REPO / "profiles" / f"{model}.json")
    paths = {}
    for schedule in schedules:
        plan = partition(profile, make_cluster(2), straight=True, schedule=schedule, microbatches=microbatches,
                         microbatch_size=microbatch_size)
        paths[schedule] = str(plan.save(folder / f"{schedule}.json"))
    return paths


def worker(spec_path: str) -> None:
    """One rank: build every runner, run the rounds, rank 0 writes the medians."""
    from planner.files.plan import load_plan
    from planner.profiling.model_file import load_model_file
    from planner.profiling.memory import peak_memory_of
    from runtime.engine import Engine, init_distributed
    from runtime.pippy import build

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    rank, _, _ = init_distributed()
    timing = dist.new_group(backend="gloo")  # barriers apart from the runtimes' traffic
    source = load_model_file(REPO / "examples" / f"{spec['model']}.py")
    batch = spec["microbatch_size"] * spec["microbatches"]

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return source.build_model().train()

    runners: dict[str, Callable[[Any, Any], None]] = {}
    engines: dict[str, Engine] = {}
    torch_modules: dict[str, torch.nn.Module] = {}  # per schedule, this rank's stages under torch's runtime
    for schedule, path in spec["plans"].items():
        plan = load_plan(path)
        engine = Engine.from_plan(fresh(), plan, optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                                  loss_fn=source.loss_fn)
        engines[schedule] = engine
        runners[f"ours {schedule}"] = lambda inputs, target, engine=engine: engine.train_step(inputs, target)
        torch.manual_seed(1)
        example = source.example_batch(spec["microbatch_size"])[0]
        built = build(fresh(), plan, example, loss_fn=source.loss_fn)
        torch_modules[schedule] = torch.nn.ModuleList([stage.submod for stage in built.stages])
        parameters = {id(p): p for stage in built.stages for p in stage.submod.parameters()}
        optimizer = torch.optim.SGD(list(parameters.values()), lr=LR)

        def torch_step(inputs: Any, target: Any, built: Any = built, optimizer: Any = optimizer) -> None:
            built.forward_backward(inputs, target)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        runners[f"torch {schedule}"] = torch_step
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # this rank's CPU seconds, every thread
    for round_index in range(spec["rounds"] + WARMUP_ROUNDS):
        torch.manual_seed(1000 + round_index)
        inputs, target = source.example_batch(batch)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier(group=timing)
            started, used = time.perf_counter(), time.process_time()
            runners[name](inputs, target)
            used = time.process_time() - used
            dist.barrier(group=timing)
            if round_index >= WARMUP_ROUNDS:
                times[name].append(time.perf_counter() - started)
                cpu[name].append(used)
    memory: dict[str, float] = {}
    for schedule, engine in engines.items():
        memory[f"ours {schedule}"] = float(engine.peak_memory[0]) if engine.peak_memory else 0.0
        dist.barrier(group=timing)
        memory[f"torch {schedule}"] = float(peak_memory_of(
            lambda: runners[f"torch {schedule}"](inputs, target), torch_modules[schedule], (), torch.device("cpu"),
            count_inputs=True)[0])
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (memory, {name: statistics.median(values) for name, values in cpu.items()}),
                           group=timing)
    for engine in engines.values():
        engine.close()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({
            "steps_ms": {name: [1000.0 * value for value in values] for name, values in times.items()},
            "peak_bytes": {name: [found[name] for found, _ in per_rank] for name in memory},
            "cpu_s": {name: [used[name] for _, used in per_rank] for name in names}}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES),
                        help="which to run (1f1b always runs: the others are given over it)")
    parser.add_argument("--model", default="gpt", choices=("gpt", "mlp", "resnet", "vgg"), help="the example")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from runtime.worker_exit import exit_worker

        worker(args.worker)
        exit_worker(0)  # (torch's gloo teardown at exit aborts now and then: runtime.worker_exit)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        schedules = tuple(schedule for schedule in SCHEDULES if schedule == "1f1b" or schedule in args.schedules)
        spec = {"plans": make_plans(folder, args.model, args.microbatches, args.microbatch_size, schedules),
                "model": args.model, "rounds": args.rounds,
                "microbatch_size": args.microbatch_size, "microbatches": args.microbatches,
                "out": str(folder / "steps.json")}
        (folder / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
               "MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
        started = time.perf_counter()
        finished = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                   __file__, "--worker", str(folder / "spec.json")], env=env, text=True,
                                  capture_output=True)
        if finished.returncode != 0:
            raise SystemExit(finished.stdout[-3000:] + finished.stderr[-5000:])
        found = json.loads((folder / "steps.json").read_text())
        steps_ms, peak_bytes, cpu_s = found["steps_ms"], found["peak_bytes"], found["cpu_s"]
    medians = {name: statistics.median(values) for name, values in steps_ms.items()}
    print(f"# {time.strftime('%Y-%m-%d')}: {args.model} example, 2 CPU processes, {args.microbatches} microbatches of "
          f"{args.microbatch_size}, {args.rounds} rounds ({time.perf_counter() - started:.0f} s); median step ms; "
          f"paired: the ratio within each round (torch / ours; ours / ours' 1f1b), median [quartiles]")
    print(f"{'schedule':18s} {'ours':>8s} {'torch':>8s} {'torch/ours':>11s} {'paired':>22s} {'ours / 1f1b':>12s} "
          f"{'paired':>22s} {'torch / 1f1b':>13s}")
    for schedule in schedules:
        ours, theirs = medians[f"ours {schedule}"], medians[f"torch {schedule}"]
        print(f"{schedule:18s} {ours:8.1f} {theirs:8.1f} {theirs / ours:11.3f} "
              f"{paired(steps_ms[f'torch {schedule}'], steps_ms[f'ours {schedule}']):>22s} "
              f"{ours / medians['ours 1f1b']:12.3f} {paired(steps_ms[f'ours {schedule}'], steps_ms['ours 1f1b']):>22s} "
              f"{theirs / medians['torch 1f1b']:13.3f}")
    print("\nCPU seconds a step per rank, every thread of the process, median (torch / ours above 1: ours uses less)")
    print_per_rank(schedules, cpu_s, lambda value: f"{value:.3f}")
    print("\npeak memory of a step per rank, MB (torch / ours above 1: ours holds less)")
    print_per_rank(schedules, peak_bytes, lambda value: f"{value / 1e6:.2f}")


def print_per_rank(schedules: tuple[str, ...], found: dict[str, list[float]], shown: Callable[[float], str]) -> None:
    """A line per schedule: ours and torch's value on each rank (`found["ours 1f1b"]` etc., each `shown`) and
    torch / ours per rank ('-' where ours is 0)."""
    for schedule in schedules:
        ours, theirs = found[f"ours {schedule}"], found[f"torch {schedule}"]
        print(f"{schedule:18s} ours {', '.join(map(shown, ours)):>16s}   torch {', '.join(map(shown, theirs)):>16s}   "
              f"torch / ours {', '.join(f'{b / a:.3f}' if a else '-' for a, b in zip(ours, theirs))}")


def paired(numerators: list[float], denominators: list[float]) -> str:
    """'median [lower quartile, upper quartile]' of the per-round ratios numerator / denominator (the two ran seconds
    apart in each round, so a slow spell of the machine moves both)."""
    ratios = [top / bottom for top, bottom in zip(numerators, denominators)]
    low, middle, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{middle:.3f} [{low:.3f}, {high:.3f}]"


if __name__ == "__main__":
    main()
