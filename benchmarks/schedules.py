"""Simulated schedules side by side: each schedule's best plan of one profile, and bubbles against the textbook.

    python benchmarks/schedules.py [--profile PROFILE.json] [--gpus 4] [--global-batch 64] [--microbatch-size 8]
                                   [--figure docs/gpt-4gpu-schedules.png]

1. The profile (default: examples/gpt.py profiled here at the microbatch size, so that its layers
   carry measured input-gradient times, `bwd_input_ms`) planned straight on `--gpus` devices
   (a flat cluster at the planner's default links) with `--global-batch` samples per step in
   microbatches of `--microbatch-size`, once per synchronous schedule and once with `--schedule
   auto`: the simulated iteration of each, its ratio to 1f1b's, the bubble and the peak memory,
   and which schedule auto picks. `--figure` draws 1f1b's plan over auto's (`plots.schedules_figure`,
   the README's schedules figure).
2. Equal stages (F = B = W = 1 ms, no transfers) on p stages and m microbatches: each schedule's
   simulated bubble against its textbook formula: gpipe and 1f1b (p - 1)(F + B + W), zb-h1
   (p - 1)(F + B - W) (Qi et al., ICLR 2024), interleaved-1f1b with 2 chunks per rank (the same work
   cut into 2p chunks) (p - 1)(F + B + W) / 2 (Narayanan et al., SC 2021), zbv (2p chunks in a V)
   (p - 1) F / 2, the first forward's way down to the last rank (what Qi et al. call zero bubble),
   over m (F + B + W) of work.

Everything here is simulated (planner/simulation): no training runs; `benchmarks/runtime_overhead.py`
measures the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import tempfile
from pathlib import Path

from planner.display.plots import schedules_figure
from planner.files.cluster import make_cluster
from planner.files.profile import Profile, load_profile
from planner.files.timeline import StageTimes
from planner.planning.partition import partition
from planner.profiling.model_file import load_model_file
from planner.profiling.profiler import ProfileSettings, profile_model
from planner.schedules.schedule import CHUNKED_SCHEDULES, FLUSH_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, build_schedule
from planner.simulation.plan_simulation import simulate
from planner.simulation.simulator import simulate_schedule

REPO = Path(__file__).resolve().parents[1]
TEXTBOOK_BUBBLE = {"gpipe": lambda p: 3 * (p - 1), "1f1b": lambda p: 3 * (p - 1), "zb-h1": lambda p: (p - 1),
                   "interleaved-1f1b": lambda p: 3 * (p - 1) / CHUNKS, "zbv": lambda p: (p - 1) / CHUNKS}
CHUNKS = 2  # chunks per rank of the chunked schedules in part 2 (zbv's only choice)


def measured_profile(microbatch_size: int) -> Profile:
    """examples/gpt.py profiled on this machine at the microbatch size (input-gradient times included)."""
    settings = ProfileSettings(batch_size=microbatch_size, min_seconds=1.0)
    profile = profile_model(load_model_file(REPO / "examples" / "gpt.py"), settings)
    with tempfile.TemporaryDirectory() as folder:  # through the file format, as a user's profile goes
        return load_profile(profile.save(Path(folder) / "gpt.json"))


def plans_side_by_side(profile: Profile, gpus: int, microbatches: int, microbatch_size: int,
                       figure: Path | None = None) -> None:
    """Part 1: one straight plan per schedule and auto's, simulated; 1f1b's over auto's drawn into `figure`."""
    cluster = make_cluster(gpus)
    print(f"1. {profile.model_name} on {gpus} devices, straight, {microbatches} microbatches of {microbatch_size} "
          f"(global batch {microbatches * microbatch_size}); input-gradient times "
          f"{'measured' if all(layer.bwd_input_ms is not None for layer in profile.layers) else 'assumed 50%'}")
    print(f"   {'schedule':16s} {'iteration ms':>12s} {'/ 1f1b':>7s} {'bubble':>7s} {'peak MB':>8s}  stages (layers)")
    found = {}
    for schedule in ("1f1b", *(name for name in FLUSH_SCHEDULES if name != "1f1b"), "auto"):
        plan = partition(profile, cluster, straight=True, schedule=schedule, microbatches=microbatches,
                         microbatch_size=microbatch_size)
        found[schedule] = plan
        name = schedule if schedule != "auto" else f"auto={plan.schedule}"
        ratio = plan.predicted.iteration_ms / found["1f1b"].predicted.iteration_ms
        print(f"   {name:16s} {plan.predicted.iteration_ms:12.1f} {ratio:7.3f} {plan.predicted.bubble_fraction:7.1%} "
              f"{plan.predicted.peak_memory_bytes / 1e6:8.1f}  {[(s.start, s.stop) for s in plan.stages]}")
    if profile.split_backward_ratio not in (None, 1.0):  # the same without the split's own cost
        free = partition(dataclasses.replace(profile, split_backward_ratio=None), cluster, straight=True,
                         schedule="zb-h1", microbatches=microbatches, microbatch_size=microbatch_size)
        ratio = free.predicted.iteration_ms / found["1f1b"].predicted.iteration_ms
        print(f"   {'zb-h1*':16s} {free.predicted.iteration_ms:12.1f} {ratio:7.3f} "
              f"{free.predicted.bubble_fraction:7.1%} "
              f"{free.predicted.peak_memory_bytes / 1e6:8.1f}  {[(s.start, s.stop) for s in free.stages]}")
        print(f"   (zb-h1*: if B then W cost no more than one backward; this profile measured them "
              f"{profile.split_backward_ratio:.2f}x, which zb-h1's row counts)")
    best = min(FLUSH_SCHEDULES, key=lambda schedule: found[schedule].predicted.iteration_ms)
    print(f"   fastest: {best}; auto picked {found['auto'].schedule}")
    if figure is not None:
        schedules_figure([simulate(found[name], profile) for name in ("1f1b", "auto")]).savefig(figure, dpi=110)
        print(f"   wrote {figure}: 1f1b over auto's {found['auto'].schedule}")


def textbook_bubbles() -> None:
    """Part 2: simulated bubbles of equal stages against the formulas."""
    print("2. equal stages, F = B = W = 1 ms, no transfers: simulated bubble (iteration - m (F + B + W)) "
          "against the textbook")
    print(f"   {'p':>3s} {'m':>3s}  " + "  ".join(f"{name:>18s}" for name in TEXTBOOK_BUBBLE))
    for stages, microbatches in ((2, 4), (4, 8), (4, 16), (8, 16), (8, 32)):
        cells = []
        for name in TEXTBOOK_BUBBLE:
            split, chunks = name in SPLIT_BACKWARD_SCHEDULES, CHUNKS if name in CHUNKED_SCHEDULES else 1
            times = [StageTimes(1e-3 / chunks, (1 if split else 2) * 1e-3 / chunks, 0.0, 0.0,
                                weight_s=1e-3 / chunks if split else 0.0) for _ in range(stages * chunks)]
            schedule = build_schedule(name, [1] * stages * chunks, microbatches, chunks=chunks)
            simulated = simulate_schedule(schedule, times).iteration_s()
            bubble_ms = simulated * 1e3 - 3 * microbatches
            cells.append(f"{bubble_ms:5.1f} vs {TEXTBOOK_BUBBLE[name](stages):5.1f}")
        print(f"   {stages:3d} {microbatches:3d}  " + "  ".join(f"{cell:>18s}" for cell in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, help="a profile file (default: profile examples/gpt.py here)")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--figure", type=Path, help="write 1f1b's plan over auto's as a PNG here")
    args = parser.parse_args()
    print(f"# {datetime.date.today()}: schedules simulated side by side")
    profile = load_profile(args.profile) if args.profile else measured_profile(args.microbatch_size)
    plans_side_by_side(profile, args.gpus, args.global_batch // args.microbatch_size, args.microbatch_size,
                       args.figure)
    textbook_bubbles()


if __name__ == "__main__":
    main()
