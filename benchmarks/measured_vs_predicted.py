"""Measured against predicted with `runtime.train` on the examples, before and after calibration.

    python benchmarks/measured_vs_predicted.py [--quick] [--steps 20] [--examples mlp gpt resnet]
                                               [--schedules gpipe 1f1b] [--keep DIR]

For each example model file (examples/<name>.py) and each schedule:

1. the example is profiled in this process (`planner.profiling.profiler.profile_model`, one torch thread,
   batch = the microbatch size: mlp 64, gpt 8, resnet 32);
2. `planner.planning.partition.partition` makes a straight plan for 2 devices with 4 microbatches of that
   schedule on `make_cluster(2, bandwidths=(--bandwidth,))` (default 3.3 GB/s: the gloo loopback
   bandwidth measured on this machine, RESULTS.md, 2026-11-21) with the planner's default
   optimizer (Adam);
3. `python -m runtime.train MODEL --plan PLAN --steps S --data example --report R` runs it under
   `torchrun --standalone` on as many processes as the plan has ranks (OMP_NUM_THREADS=1, gloo);
4. the run report gives the measured iteration time (median train step after one warm-up step)
   against the plan's prediction, and per stage the compute ratio (measured / predicted forward +
   backward per microbatch) and the idle share (measured; the simulated one in parentheses);
5. the profile is calibrated from that report (`planner.files.calibration.calibrate_profile`: each
   stage's layers scaled by its compute ratio), the same settings partition it again, the new plan
   is trained the same way, and its measured / predicted ratio is reported with whether the cut moved.

The planner's cost model does not predict the optimizer step; the report measures it per stage
(`step_ms`: the tied parameters' all-reduce, then the optimizer). With flush schedules the first
stage finishes last (it runs the last backward), so its step ends the iteration: "w/o step" is
the measured iteration minus the first stage's `step_ms`, against the same prediction. The
report times a step from the earliest rank's start to the latest rank's end; the last stage
starts the next step while the first stage still finishes the previous one, so part of each
measured step overlaps the one before: "lead-in" is when the first stage's first forward starts
in the report's representative step (ms after the step's start).

Takes about 100 s on the 2-core CPU machine (--quick: about 70 s); the training runs dominate.
The runs are sequential, not interleaved: absolute times on this shared machine drift by tens of
percent within minutes, so a ratio off by a few percent between two runs may be drift.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from planner.files.cluster import make_cluster
from planner.profiling.model_file import load_model_file
from planner.planning.partition import partition
from planner.files.plan import Plan
from planner.simulation.plan_simulation import simulate
from planner.files.profile import Profile
from planner.profiling.profiler import ProfileSettings, profile_model
from planner.files.calibration import calibrate_profile
from planner.files.run_report import RunReport, comparison_table, load_run_report
from planner.profiling.conditions import steady_malloc

REPO = Path(__file__).resolve().parents[1]
MICROBATCH_SIZES = {"mlp": 64, "gpt": 8, "resnet": 32}  # samples per microbatch, by example
MICROBATCHES = 4
SCHEDULES = ("gpipe", "1f1b")
BANDWIDTH_BPS = 3.3e9  # gloo loopback on this machine, bytes/s (RESULTS.md, 2026-11-21)
OPTIMIZER = "adam"  # the planner's default; runtime.train uses the plan's
TRAIN_TIMEOUT_S = 600


@dataclass(frozen=True)
class RunFigures:
    """One training run of one plan, read off its report (times in ms; ratios measured / predicted)."""

    cut: str
    predicted_ms: float
    measured_ms: float
    stage_step_ms: tuple[float, ...]
    compute_ratios: tuple[float, ...]
    idle_measured: tuple[float, ...]
    idle_predicted: tuple[float, ...]
    lead_in_ms: float
    wall_s: float

    @property
    def ratio(self) -> float:
        """measured / predicted iteration time."""
        return self.measured_ms / self.predicted_ms

    @property
    def without_step_ms(self) -> float:
        """Measured iteration minus the first stage's optimizer step (its step ends a flush iteration), ms."""
        return self.measured_ms - self.stage_step_ms[0]

    @property
    def ratio_without_step(self) -> float:
        """(measured iteration - first stage's step) / predicted iteration."""
        return self.without_step_ms / self.predicted_ms

    @property
    def ratio_without_step_and_lead_in(self) -> float:
        """(measured iteration - first stage's step - lead-in) / predicted iteration."""
        return (self.without_step_ms - self.lead_in_ms) / self.predicted_ms


@dataclass(frozen=True)
class Row:
    """One example and schedule: the run of the profile's plan and of the calibrated profile's plan."""

    example: str
    schedule: str
    microbatch_size: int
    before: RunFigures
    after: RunFigures

    @property
    def cut_moved(self) -> bool:
        """Whether calibration changed the stage boundary."""
        return self.before.cut != self.after.cut


def cut_of(plan: Plan) -> str:
    """The stage boundaries: the first layer of every stage after the first ('(one stage)' for none)."""
    return ", ".join(stage.first_layer for stage in plan.stages[1:]) or "(one stage)"


def make_plan(profile: Profile, profile_path: Path, schedule: str, bandwidth_Bps: float) -> Plan:
    """The straight plan for 2 devices at `bandwidth_Bps` with MICROBATCHES microbatches of `schedule`."""
    return partition(profile, make_cluster(2, bandwidths=(bandwidth_Bps,)), straight=True, optimizer=OPTIMIZER,
                     schedule=schedule, microbatches=MICROBATCHES, profile_path=str(profile_path))


def train(model_path: Path, plan: Plan, plan_path: Path, report_path: Path, steps: int) -> tuple[RunReport, float]:
    """Run `runtime.train` on `plan` under torchrun (one process per rank); its report and the run's wall seconds."""
    ranks = sum(stage.replicas for stage in plan.stages)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "runtime.train", str(model_path), "--plan", str(plan_path), "--steps", str(steps),
               "--data", "example", "--report", str(report_path), "--log-every", str(steps)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=REPO,
                               timeout=TRAIN_TIMEOUT_S, check=False)
    wall_s = time.perf_counter() - started
    if completed.returncode != 0 or not report_path.exists():
        tail = "\n".join((completed.stdout + completed.stderr).splitlines()[-20:])
        raise SystemExit(f"runtime.train on {plan_path} failed (exit code {completed.returncode}):\n{tail}")
    return load_run_report(report_path), wall_s


@dataclass(frozen=True)
class Trained:
    """One plan made and trained: its file, its report, and the figures read off the report."""

    plan: Plan
    plan_path: Path
    report: RunReport
    figures: RunFigures


def plan_and_train(folder: Path, stem: str, model_path: Path, profile: Profile, profile_path: Path, schedule: str,
                   bandwidth_Bps: float, steps: int) -> Trained:
    """Plan `profile` for `schedule`, train the plan with runtime.train, and say how it went."""
    plan = make_plan(profile, profile_path, schedule, bandwidth_Bps)
    plan_path = folder / f"{stem}.plan.json"
    plan.save(plan_path)
    report, wall_s = train(model_path, plan, plan_path, folder / f"{stem}.report.json", steps)
    found = figures(plan, profile, report, wall_s)
    say(f"{stem}: cut {found.cut}, predicted {found.predicted_ms:.1f} ms, measured {found.measured_ms:.1f} ms "
        f"({found.ratio:.2f}), {wall_s:.0f} s")
    return Trained(plan, plan_path, report, found)


def figures(plan: Plan, profile: Profile, report: RunReport, wall_s: float) -> RunFigures:
    """What the table shows of one run: the report against the plan, the simulated idle shares."""
    table = comparison_table(report, simulate(plan, profile))
    stages = range(len(plan.stages))
    return RunFigures(
        cut=cut_of(plan), predicted_ms=report.predicted_iteration_ms, measured_ms=report.iteration_ms,
        stage_step_ms=tuple(stage.step_ms for stage in report.measured),
        compute_ratios=tuple(float(table.loc[f"stage {i} compute (ms/microbatch)", "ratio"]) for i in stages),
        idle_measured=tuple(float(table.loc[f"stage {i} idle (share)", "measured"]) for i in stages),
        idle_predicted=tuple(float(table.loc[f"stage {i} idle (share)", "predicted"]) for i in stages),
        lead_in_ms=lead_in_ms(report), wall_s=wall_s)


def lead_in_ms(report: RunReport) -> float:
    """When the first stage's first forward starts in the report's representative step, ms from its start.

    A step's time in the report runs from the earliest rank's start to the latest rank's end; the
    last stage finishes a flush step first and starts the next one (waiting for activations) while
    the first stage still runs its last backward and optimizer step, so this much of the measured
    step overlaps the step before.
    """
    first = report.events[(report.events["stage"] == 0) & (report.events["op"] == "forward")]
    return 1000.0 * float(first["start_s"].min()) if len(first) else float("nan")


def run_example(name: str, schedules: Sequence[str], steps: int, bandwidth_Bps: float, folder: Path,
                quick: bool) -> list[Row]:
    """Profile example `name`, then per schedule: plan, train, calibrate, plan again, train again."""
    model_path = REPO / "examples" / f"{name}.py"
    microbatch_size = MICROBATCH_SIZES[name]
    profile_path = folder / f"{name}.profile.json"
    say(f"{name}: profiling at batch {microbatch_size}, 1 thread")
    torch.set_num_threads(1)
    settings = ProfileSettings(batch_size=microbatch_size, threads=1, warmup=2 if quick else 3,
                               iters=5 if quick else 10)
    profile = profile_model(load_model_file(model_path), settings)
    profile.save(profile_path)
    rows = []
    for schedule in schedules:
        before = plan_and_train(folder, f"{name}.{schedule}", model_path, profile, profile_path, schedule,
                                bandwidth_Bps, steps)
        plan, report = before.plan, before.report
        calibrated = calibrate_profile(profile, plan, report, str(before.plan_path), str(profile_path))
        calibrated_path = folder / f"{name}.{schedule}.calibrated.profile.json"
        calibrated.save(calibrated_path)
        after = plan_and_train(folder, f"{name}.{schedule}.calibrated", model_path, calibrated, calibrated_path,
                               schedule, bandwidth_Bps, steps)
        before, after = before.figures, after.figures
        rows.append(Row(name, schedule, microbatch_size, before, after))
    return rows


def say(text: str) -> None:
    """A progress line on stdout, at once."""
    print(text, flush=True)


def pair(values: Sequence[float], pattern: str) -> str:
    """Per-stage values joined with ' / '."""
    return " / ".join(pattern.format(value) for value in values)


def print_table(rows: Sequence[Row]) -> None:
    """The results as one Markdown table, then the per-stage idle shares."""
    print("| example | schedule | cut | predicted ms | measured ms | ratio | step ms (stage 0 / 1) | "
          "ratio w/o step | lead-in ms | ratio w/o step, lead-in | compute ratio (stage 0 / 1) | "
          "cut after calibration | predicted after | measured after | ratio after (w/o step, lead-in) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        b, a = row.before, row.after
        print(f"| {row.example} (mb {row.microbatch_size}) | {row.schedule} | `{b.cut}` | {b.predicted_ms:.1f} | "
              f"{b.measured_ms:.1f} | {b.ratio:.2f} | {pair(b.stage_step_ms, '{:.1f}')} | "
              f"{b.ratio_without_step:.2f} | {b.lead_in_ms:.1f} | {b.ratio_without_step_and_lead_in:.2f} | "
              f"{pair(b.compute_ratios, '{:.2f}')} | {'moved: `' + a.cut + '`' if row.cut_moved else 'same'} | "
              f"{a.predicted_ms:.1f} | {a.measured_ms:.1f} | {a.ratio:.2f} ({a.ratio_without_step_and_lead_in:.2f}) |")
    print()
    print("per stage (0 / 1): idle share measured (simulated); compute ratio of the run after calibration; lead-in "
          "(ms) before and after")
    for row in rows:
        print(f"  {row.example:6s} {row.schedule:5s} idle before {idle(row.before)}, after {idle(row.after)}; "
              f"compute ratio after {pair(row.after.compute_ratios, '{:.2f}')}; lead-in before "
              f"{row.before.lead_in_ms:.1f}, after {row.after.lead_in_ms:.1f}")


def idle(run: RunFigures) -> str:
    """Each stage's idle share, measured (simulated)."""
    return " / ".join(f"{found:.0%} ({expected:.0%})" for found, expected in zip(run.idle_measured, run.idle_predicted))


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (/proc/stat), None where there is none."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (torchrun and the training ranks)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def main() -> None:
    """Parse the command line, run every example and schedule, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=list(MICROBATCH_SIZES), choices=list(MICROBATCH_SIZES))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 20, quick 8)")
    parser.add_argument("--bandwidth", type=float, default=BANDWIDTH_BPS, help="link bandwidth, bytes/s")
    parser.add_argument("--quick", action="store_true", help="8 steps per run, shorter profiling")
    parser.add_argument("--keep", default=None, help="folder to keep the profiles, plans and reports in")
    args = parser.parse_args()
    steady_malloc(sys.argv)
    steps = args.steps if args.steps is not None else (8 if args.quick else 20)
    if steps < 2:
        parser.error("--steps must be at least 2 (the report leaves the first step out as warm-up)")
    started, busy_before, own_before = time.perf_counter(), machine_busy_s(), own_cpu_s()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep) if args.keep else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.examples:
            rows += run_example(name, args.schedules, steps, args.bandwidth, folder, args.quick)
    print()
    print(f"{steps} steps per run (median step after 1 warm-up), {MICROBATCHES} microbatches, straight 2-stage "
          f"plans on {args.bandwidth / 1e9:.2f} GB/s, optimizer {OPTIMIZER}; {os.cpu_count()} cores, "
          f"torch {torch.__version__}, 1 thread per process, gloo")
    print_table(rows)
    print()
    walls = [run.wall_s for row in rows for run in (row.before, row.after)]
    wall_s, busy_after = time.perf_counter() - started, machine_busy_s()
    print(f"took {wall_s:.0f} s; runtime.train runs {min(walls):.0f}-{max(walls):.0f} s each", end="")
    if busy_before is not None and busy_after is not None:
        other_s = max(0.0, busy_after - busy_before - (own_cpu_s() - own_before))
        print(f"; other processes used {other_s:.0f} CPU-s meanwhile ({other_s / wall_s:.2f} of "
              f"{os.cpu_count()} cores on average)", end="")
    print()


if __name__ == "__main__":
    main()
