"""Optimizer solve times: every PipeDream profile for 4 to 64 GPUs, and a 1,000-layer profile on 1,024.

    python benchmarks/solve_time.py [--profiles ../shared/pipedream-profiles] [--cost-model pipedream|planner|auto]
                                    [--memory-limited]

`pipedream`: PipeDream's cost model on a flat cluster at 10 GB/s, with and without replication.
`planner`: the planner's cost model (1f1b with 8 microbatches, and pipedream) on a flat cluster
at 100 GB/s and on 8 GPUs per node (100 GB/s within, 10 GB/s between nodes). Prints one line per
solve and the slowest; targets: each PipeDream profile under 1 s, the synthetic profile under 10 s.
`auto`: the whole search of `planner partition --schedule auto --microbatches auto` (`partition`: every
synchronous schedule, microbatch count and recompute, then the simulated final choice), without a memory
limit, flat and 8 per node at 300 GB/s within and 25 GB/s between nodes; targets: under 1 s for profiles
of at most 200 layers, under 3 s for nasnetalarge (1,250 layers) on 16 GPUs at 8 per node.
`--memory-limited`: the same search where the memory limit binds (resnet50 and inception_v3 at 16 GB,
densenet121 and nasnetalarge at 8 GB, 16 GPUs at 8 per node), in one process against its solves ahead in child
processes (`planner.planning.solve_ahead`), side by side; only nasnetalarge's solves take the 3 s after which
children start (about 2.5 minutes of its 3 on 2 cores).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

from planner.files.cluster import make_cluster
from planner.costs.layer_arrays import LayerArrays
from planner.planning.optimizer import optimize
from planner.planning.partition import partition
from planner.files.pipedream import import_pipedream
from planner.planning.pipedream_optimizer import optimize_pipedream
from planner.profiling.conditions import cores
from planner.costs.schedule_cost import CostInputs

REPO = Path(__file__).resolve().parents[1]
BANDWIDTH_BPS = 10e9


def synthetic_arrays(num_layers: int, seed: int = 0) -> LayerArrays:
    """Layers with random times (1-20 ms), parameters (0-50 MB) and cuts (0.1-20 MB), reproducible."""
    rng = random.Random(seed)
    compute = [rng.uniform(0.001, 0.020) for _ in range(num_layers)]
    params = [rng.choice([0.0, rng.uniform(1e5, 5e7)]) for _ in range(num_layers)]
    cuts = [rng.uniform(1e5, 2e7) for _ in range(num_layers - 1)] + [0.0]
    return LayerArrays(
        np.concatenate([[0.0], np.cumsum(compute)]), np.concatenate([[0.0], np.cumsum(params)]), np.array(cuts),
        fwd_s=np.concatenate([[0.0], np.cumsum(compute)]) / 3.0,
    )


def timed(arrays: LayerArrays, gpus: int, straight: bool) -> tuple[float, float, int]:
    """(seconds to solve, objective in seconds, devices used)."""
    start = time.perf_counter()
    solution = optimize_pipedream(arrays, gpus, BANDWIDTH_BPS, straight)
    return time.perf_counter() - start, solution.objective_s, solution.devices


def timed_planner(arrays: LayerArrays, gpus: int, per_node: int | None, schedule: str) -> tuple[float, float, int]:
    """(seconds to solve, objective in seconds, devices used) under the planner's cost model."""
    cluster = make_cluster(gpus, per_node, ["100GB/s", "10GB/s"])
    start = time.perf_counter()
    solution = optimize(CostInputs(arrays, cluster, schedule, 8))
    return time.perf_counter() - start, solution.objective_s, solution.devices


def main() -> None:
    """Solve every case and print its time, objective and GPUs used."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, default=REPO.parent / "shared" / "pipedream-profiles")
    parser.add_argument("--cost-model", choices=("pipedream", "planner", "auto"), default="pipedream")
    parser.add_argument("--memory-limited", action="store_true",
                        help="the auto search where a memory limit binds, in one process and with its solves ahead")
    args = parser.parse_args()
    if args.memory_limited:
        memory_limited_main(args.profiles)
        return
    if args.cost_model == "auto":
        auto_main(args.profiles)
        return
    if args.cost_model == "planner":
        planner_main(args.profiles)
        return
    slowest = 0.0
    for graph in sorted(args.profiles.glob("*.txt")):
        arrays = LayerArrays.from_profile(import_pipedream(graph))
        for gpus in (4, 8, 16, 32, 64):
            for straight in (False, True):
                seconds, objective, used = timed(arrays, gpus, straight)
                slowest = max(slowest, seconds)
                print(f"{graph.stem:14s} layers {arrays.num_layers:5d} gpus {gpus:3d} "
                      f"{'straight  ' if straight else 'replicated'} {seconds:7.3f} s  "
                      f"bottleneck {objective * 1000:9.3f} ms on {used} GPUs")
    print(f"slowest PipeDream-profile solve: {slowest:.3f} s (target < 1 s)")
    arrays = synthetic_arrays(1000)
    for straight in (False, True):
        seconds, objective, used = timed(arrays, 1024, straight)
        print(f"synthetic 1000 layers, 1024 GPUs, {'straight' if straight else 'replicated'}: {seconds:.2f} s "
              f"(target < 10 s), bottleneck {objective * 1000:.3f} ms on {used} GPUs")


def planner_main(profiles: Path) -> None:
    """The planner cost model's solves: flat and 8 per node, 1f1b (m = 8) and pipedream."""
    slowest: dict[str, float] = {}
    for graph in sorted(profiles.glob("*.txt")):
        arrays = LayerArrays.from_profile(import_pipedream(graph))
        for gpus in (4, 8, 16, 32, 64):
            for per_node in (None, 8):
                if per_node is not None and per_node >= gpus:
                    continue
                for schedule in ("1f1b", "pipedream"):
                    seconds, objective, used = timed_planner(arrays, gpus, per_node, schedule)
                    shape = "flat" if per_node is None else f"{per_node}/node"
                    slowest[shape] = max(slowest.get(shape, 0.0), seconds)
                    print(f"{graph.stem:14s} layers {arrays.num_layers:5d} gpus {gpus:3d} {shape:7s} {schedule:9s} "
                          f"{seconds:7.3f} s  objective {objective * 1000:9.3f} ms on {used} GPUs", flush=True)
    for shape, seconds in slowest.items():
        print(f"slowest PipeDream-profile solve, {shape}: {seconds:.3f} s (target < 1 s)")
    arrays = synthetic_arrays(1000)
    for per_node in (None, 8):
        seconds, objective, used = timed_planner(arrays, 1024, per_node, "1f1b")
        print(f"synthetic 1000 layers, 1024 GPUs, {'flat' if per_node is None else '8/node'}, 1f1b: {seconds:.2f} s "
              f"(target < 10 s), objective {objective * 1000:.3f} ms on {used} GPUs", flush=True)


MEMORY_LIMITED = (("resnet50", 16, "16GB"), ("inception_v3", 16, "16GB"), ("densenet121", 16, "8GB"),
                  ("nasnetalarge", 16, "8GB"))


def memory_limited_main(profiles: Path) -> None:
    """`partition`'s auto search on 16 GPUs at 8 per node where the memory limit binds: each case in one process
    (`workers=1`) and with its solves ahead in child processes (the default: as many as this process has CPUs),
    one after the other; the same plan both ways."""
    print(f"{'case':28s} {'one process':>12s} {'solves ahead':>13s} {'ratio':>6s}   ({cores()} CPUs)")
    for name, gpus, memory in MEMORY_LIMITED:
        profile = import_pipedream(profiles / f"{name}.txt")
        cluster = make_cluster(gpus, 8, ["300GB/s", "25GB/s"], memory=memory)
        seconds, plans = [], []
        for workers in (1, None):
            start = time.perf_counter()
            plans.append(partition(profile, cluster, workers=workers))
            seconds.append(time.perf_counter() - start)
        assert plans[0] == plans[1], f"{name}: the plans differ"
        print(f"{name + f', {gpus} GPUs, {memory}':28s} {seconds[0]:10.1f} s {seconds[1]:11.1f} s "
              f"{seconds[0] / seconds[1]:5.2f}x", flush=True)


def auto_main(profiles: Path) -> None:
    """`partition` with --schedule auto --microbatches auto on every PipeDream profile, 4 to 64 GPUs."""
    slowest: dict[str, tuple[float, str]] = {}
    for graph in sorted(profiles.glob("*.txt")):
        profile = import_pipedream(graph)
        group = "at most 200 layers" if profile.num_layers <= 200 else f"{graph.stem} ({profile.num_layers} layers)"
        for gpus in (4, 8, 16, 32, 64):
            for per_node in (None, 8):
                if per_node is not None and per_node >= gpus:
                    continue
                cluster = make_cluster(gpus, per_node, ["300GB/s", "25GB/s"])
                start = time.perf_counter()
                plan = partition(profile, cluster)
                seconds = time.perf_counter() - start
                shape = "flat" if per_node is None else f"{per_node}/node"
                case = f"{graph.stem} {gpus} {shape}"
                if seconds > slowest.get(group, (0.0, ""))[0]:
                    slowest[group] = (seconds, case)
                print(f"{graph.stem:14s} layers {profile.num_layers:5d} gpus {gpus:3d} {shape:7s} {seconds:7.3f} s  "
                      f"{plan.schedule} x {plan.microbatches}, {len(plan.stages)} stages on "
                      f"{plan.predicted.devices_used} GPUs, {plan.predicted.iteration_ms:.1f} ms", flush=True)
    for group, (seconds, case) in slowest.items():
        target = "1 s" if group.startswith("at most") else "3 s"
        print(f"slowest auto search, {group}: {seconds:.3f} s ({case}; target < {target})")


if __name__ == "__main__":
    main()
