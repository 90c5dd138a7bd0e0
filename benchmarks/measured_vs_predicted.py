"""Measured against predicted on the default path a user takes: no hand-set bandwidth, no calibration.

    python benchmarks/measured_vs_predicted.py [--steps 12] [--models mlp gpt resnet gpt2]
                                               [--schedules gpipe 1f1b zb-h1 interleaved-1f1b zbv] [--gpus 2]
                                               [--keep DIR] [--repeats R]

In a fresh folder, exactly the commands of the README, with their defaults:

1. `planner cluster` measures this machine (2 processes: link latency and bandwidth; `--default-cluster`
   skips it and partitions with `--gpus 2`, the links `partition` assumes for the profile's device);
2. per model, `planner profile MODEL` (defaults: batch 8, on CPU cores / 2 threads);
3. per schedule, `planner partition PROFILE --cluster cluster.json --straight --schedule S --microbatches 4`;
4. `planner train MODEL --plan PLAN --steps N --report REPORT` (2 processes under torchrun);
5. per schedule again on devices with less memory than that plan needs (`memory_bytes` in a copy of
   the cluster file: halfway to the least any plan needs), where the planner recomputes activations
   (`--no-recompute` leaves these rows out);
6. the report's ratios measured / predicted: the iteration, each stage's compute per microbatch,
   its transfers per microbatch, its optimizer step and its peak memory (second step, the first with optimizer state).

`--gpus 1` (a machine with one GPU, where NCCL cannot put two ranks on the device) skips step 1 and
partitions with `--gpus 1` instead (the default cluster; `--memory` in step 5): one stage whose
microbatches accumulate gradients, so the table checks compute, optimizer step and peak memory.
On a GPU machine the profile and the training run on the GPU by default (`--device auto`).

Models: examples/mlp.py, examples/gpt.py, examples/resnet.py, benchmarks/models/gpt2.py (a
transformers GPT-2 that no test or example uses) and benchmarks/models/gpt2_medium.py (the same
at width 1024, 12 layers, context 512: big enough for a GPU's kernels to dominate; not a default,
it takes minutes per step on CPU); examples/llama.py (a transformers Llama), examples/vgg.py, and the
transformers BERT, ViT and T5 of benchmarks/models (bert, vit, t5: an attention mask, patches and a class token,
an encoder-decoder with a shared embedding and position bias) can be asked for too. The lines `planner train` printed about
conditions that differ from the profile's are shown under the table. Takes about 3 minutes on
the 2-core CPU machine; absolute times on a shared machine drift by tens of percent within
minutes, so compare ratios, and rerun before reading much into one: `--repeats R` runs steps 2-6 R times
per model (each time a fresh profile, so each pair of profile and training meets the machine anew), prints
every run's row, and then each ratio's median over the runs (rows without a memory limit) with the iteration's
range (`--keep` keeps the last run's files).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planner.files.cluster import MIN_MEMORY_BYTES
from planner.files.run_report import RunReport, load_run_report
from model_files import MODEL_FILES  # (beside this script)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = ("mlp", "gpt", "resnet", "gpt2")
SCHEDULES = ("gpipe", "1f1b")  # the default; zb-h1 (one stage per rank, B and W apart) can be asked for too, and
ASKABLE = (*SCHEDULES, "zb-h1", "interleaved-1f1b", "zbv")  # the chunked ones (a row's stages: every chunk)
MICROBATCHES = 4
TIMEOUT_S = 600


def planner(*arguments: str, folder: Path) -> str:
    """Run `planner ARGUMENTS` in `folder`; its stderr lines (stdout too when it fails)."""
    done = subprocess.run([sys.executable, "-m", "planner", *arguments], cwd=folder, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if done.returncode != 0:
        sys.exit(f"`planner {' '.join(arguments)}` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stderr


def ratio(measured: float, predicted: float) -> str:
    return f"x{measured / predicted:.2f}" if predicted > 0 and measured > 0 else "-"


STAGE_FIGURES = ("compute_ms", "comm_ms", "step_ms", "peak_memory_bytes")  # the table's per-stage columns


def summary_row(model: str, schedule: str, reports: list[RunReport]) -> list[str]:
    """A row of medians over `reports` (runs of one model and schedule): the iteration's median ratio with its
    range, then each stage's median ratio of each figure of STAGE_FIGURES."""
    def median_ratio(found: list[float], expected: list[float]) -> str:
        ratios = [m / p for m, p in zip(found, expected) if m > 0 and p > 0]
        return f"x{statistics.median(ratios):.2f}" if ratios else "-"

    iterations = sorted(r.iteration_ms / r.predicted_iteration_ms for r in reports)
    cells = [model, f"{schedule}, median of {len(reports)}", "", "",
             f"x{statistics.median(iterations):.2f} [{iterations[0]:.2f}-{iterations[-1]:.2f}]"]
    for name in STAGE_FIGURES:
        cells.append(", ".join(
            median_ratio([getattr(r.measured[stage], name) for r in reports],
                         [getattr(r.predicted[stage], name) for r in reports])
            for stage in range(min(len(r.measured) for r in reports))))  # (a plan of fewer stages: the common ones)
    return cells


def row(model: str, schedule: str, report: RunReport) -> list[str]:
    """One table row: iteration, then per stage compute, transfers, step, peak memory."""
    cells = [model, schedule, f"{report.predicted_iteration_ms:.1f}", f"{report.iteration_ms:.1f}",
             ratio(report.iteration_ms, report.predicted_iteration_ms)]
    for name in STAGE_FIGURES:
        cells.append(", ".join(ratio(getattr(found, name), getattr(expected, name))
                               for found, expected in zip(report.measured, report.predicted)))
    return cells


def cluster_arguments(folder: Path, gpus: int, memory_bytes: int | None = None, measured: bool = True) -> list[str]:
    """`planner partition`'s cluster options: the measured cluster file (a copy whose devices have
    `memory_bytes` each, when given), or on one GPU or without `measured` `--gpus N` (and `--memory`): the
    links `partition` assumes for the profile's device."""
    if gpus == 1 or not measured:
        return ["--gpus", str(gpus), *([] if memory_bytes is None else ["--memory", str(memory_bytes)])]
    if memory_bytes is None:
        return ["--cluster", "cluster.json"]
    cluster = json.loads((folder / "cluster.json").read_text())
    cluster["memory_bytes"] = memory_bytes
    (folder / "cluster-small.json").write_text(json.dumps(cluster))
    return ["--cluster", "cluster-small.json"]


def recompute_row(model: str, schedule: str, free_plan: str, steps: int, gpus: int, folder: Path,
                  measured: bool) -> list[str]:
    """The same path on devices halfway between the least memory any plan needs (with recompute; the planner
    says it when asked for the least it accepts) and what the plan without a limit needs: the planner recomputes
    activations where they no longer fit."""
    needed = max(stage["memory_bytes"] for stage in json.loads((folder / free_plan).read_text())["stages"])
    arguments = ("--straight", "--schedule", schedule, "--microbatches", str(MICROBATCHES))
    refused = subprocess.run([sys.executable, "-m", "planner", "partition", f"{model}.json",
                              *cluster_arguments(folder, gpus, MIN_MEMORY_BYTES, measured), *arguments, "--out", "refused.json"],
                             cwd=folder, capture_output=True, text=True, timeout=TIMEOUT_S)
    least = re.search(r"smallest memory that admits a plan is ([0-9.]+) GB", refused.stderr)
    if least is None:
        sys.exit(f"`planner partition` did not name the least memory for {model}:\n{refused.stderr[-2000:]}")
    limit = int((float(least.group(1)) * 1e9 + needed) / 2)
    plan, report = f"{model}-{schedule}-small.json", f"{model}-{schedule}-small.report.json"
    planner("partition", f"{model}.json", *cluster_arguments(folder, gpus, limit, measured), *arguments, "--out", plan,
            folder=folder)
    flags = "".join("r" if stage["recompute"] else "-" for stage in json.loads((folder / plan).read_text())["stages"])
    planner("train", str(MODEL_FILES[model]), "--plan", plan, "--steps", str(steps), "--report", report, folder=folder)
    return row(model, f"{schedule}, {limit / 1e6:.0f} MB, recompute {flags}", load_run_report(folder / report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(MODEL_FILES))
    parser.add_argument("--gpus", type=int, default=2, help="processes (GPUs); 1 plans one stage, no cluster probe")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(ASKABLE))
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep its files")
    parser.add_argument("--no-recompute", dest="recompute", action="store_false",
                        help="leave out the plans made for devices too small to hold the activations")
    parser.add_argument("--default-cluster", dest="measured", action="store_false",
                        help="skip `planner cluster`: partition with --gpus N and the links it assumes")
    parser.add_argument("--repeats", type=int, default=1,
                        help="profile, partition and train each model this many times; then the medians")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="default-path-"))
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.gpus > 1 and args.measured:
        planner("cluster", "--nproc", str(args.gpus), "--out", "cluster.json", folder=folder)
    headers = ["model", "schedule", "predicted ms", "measured ms", "iteration", "compute per stage",
               "transfers per stage", "optimizer step per stage", "peak memory per stage"]
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers), flush=True)
    warnings = []
    runs: dict[tuple[str, str], list[RunReport]] = {}
    for model, repeat in ((model, repeat) for model in args.models for repeat in range(args.repeats)):
        planner("profile", str(MODEL_FILES[model]), "--out", f"{model}.json", folder=folder)
        for schedule in args.schedules:
            plan = f"{model}-{schedule}.json"
            planner("partition", f"{model}.json", *cluster_arguments(folder, args.gpus, measured=args.measured),
                    "--straight", "--schedule", schedule, "--microbatches", str(MICROBATCHES), "--out", plan, folder=folder)
            said = planner("train", str(MODEL_FILES[model]), "--plan", plan, "--steps", str(args.steps), "--report",
                           f"{model}-{schedule}.report.json", folder=folder)
            warnings += [f"{model} {schedule}: {line}" for line in said.splitlines()
                         if line.startswith(("warning:", "note:"))]
            report = load_run_report(folder / f"{model}-{schedule}.report.json")
            runs.setdefault((model, schedule), []).append(report)
            rows = [row(model, schedule if args.repeats == 1 else f"{schedule} (run {repeat + 1})", report)]
            if args.recompute:
                rows.append(recompute_row(model, schedule, plan, args.steps, args.gpus, folder, args.measured))
            for cells in rows:  # each row as soon as it is measured: a run cut short keeps what it found
                print("| " + " | ".join(cells) + " |", flush=True)
            print(f"  {model} {schedule} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.repeats > 1:
        print()
        for (model, schedule), reports in runs.items():
            print("| " + " | ".join(summary_row(model, schedule, reports)) + " |")
    print(f"\n(measured / predicted; {args.steps} steps, the first two a warm-up; {time.perf_counter() - started:.0f} s; "
          f"files in {folder})")
    for line in dict.fromkeys(warnings) or ["(planner train printed no warning about conditions)"]:  # once each
        print(line)


if __name__ == "__main__":
    main()
