"""A global batch cut into microbatches smaller than the profiled batch: predictions from one profiled size scaled
linearly against those from `planner profile`'s default sizes, trained side by side.

    python benchmarks/global_batch_prediction.py [--models gpt llama] [--global-batch-size 32] [--steps 8]
                                                 [--schedule 1f1b] [--keep DIR]

Per model, in a fresh folder: `planner profile MODEL --no-smaller-sizes` (8 samples only) and `planner profile
MODEL` (the default: 8, 2 and 1), then for each profile `planner partition PROFILE --gpus 2 --straight --schedule S
--global-batch-size B` (the planner chooses the microbatch size and count), `planner train` and the run report. It
prints each plan's microbatches, predicted and measured iteration and their ratio, the stages' compute ratios and the
measured samples/s, the two profiles' rows one after the other, so both meet the machine within minutes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from planner.files.plan import load_plan
from planner.files.profile import load_profile
from planner.files.run_report import load_run_report
from measured_vs_predicted import planner, ratio  # (beside this script)
from model_files import MODEL_FILES

PROFILES = {"one size, scaled": ["--no-smaller-sizes"], "default sizes": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=list(MODEL_FILES))
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep its files")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="global-batch-"))
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    headers = ["model", "profile", "measured sizes", "microbatches", "predicted ms", "measured ms", "iteration",
               "compute per stage", "samples/s measured"]
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers), flush=True)
    for model in args.models:
        for name, options in PROFILES.items():
            stem = f"{model}-{'one' if options else 'sizes'}"
            planner("profile", str(MODEL_FILES[model]), *options, "--out", f"{stem}.json", folder=folder)
            planner("partition", f"{stem}.json", "--gpus", "2", "--straight", "--schedule", args.schedule,
                    "--global-batch-size", str(args.global_batch_size), "--out", f"{stem}-plan.json", folder=folder)
            planner("train", str(MODEL_FILES[model]), "--plan", f"{stem}-plan.json", "--steps", str(args.steps),
                    "--report", f"{stem}.report.json", folder=folder)
            plan, report = load_plan(folder / f"{stem}-plan.json"), load_run_report(folder / f"{stem}.report.json")
            sizes = ", ".join(map(str, load_profile(folder / f"{stem}.json").batch_sizes))
            cells = [model, name, sizes, f"{plan.microbatches} of {plan.microbatch_size}", f"{report.predicted_iteration_ms:.1f}",
                     f"{report.iteration_ms:.1f}", ratio(report.iteration_ms, report.predicted_iteration_ms),
                     ", ".join(ratio(found.compute_ms, expected.compute_ms)
                               for found, expected in zip(report.measured, report.predicted)),
                     f"{args.global_batch_size / report.iteration_ms * 1000:.1f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\n(measured / predicted; {args.steps} steps, the first two a warm-up; global batch "
          f"{args.global_batch_size}; {time.perf_counter() - started:.0f} s; files in {folder})")


if __name__ == "__main__":
    main()
