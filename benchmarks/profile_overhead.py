"""Profiler wall time against the same number of plain training steps, side by side in one run.

    python benchmarks/profile_overhead.py [--model examples/gpt.py] [--batch-size 8] [--rounds 3]

A plain step is forward + loss + backward + zeroing gradients, the work the profiler measures.
The profiler runs `warmup` single steps, then `iters` instrumented steps each paired with a plain step, and
one-off passes (contract check, layer discovery, dataflow, memory); the ratio is its wall time over
`warmup + iters` plain steps. Rounds alternate which goes first; the median ratio is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from planner.profiling.model_file import checked_example_batch, default_loss, load_model_file
from planner.profiling.profiler import ProfileSettings, profile_model

REPO = Path(__file__).resolve().parents[1]


def plain_steps_s(model_path: Path, batch_size: int, steps: int) -> float:
    """Seconds for `steps` plain training steps (model built and batch made beforehand)."""
    model_file = load_model_file(model_path)
    model = model_file.build_model()
    inputs, target = checked_example_batch(model_file, batch_size)
    loss_fn = model_file.loss_fn or default_loss
    start = time.perf_counter()
    for _ in range(steps):
        loss_fn(model(*inputs), target).backward()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def profiler_s(model_path: Path, settings: ProfileSettings) -> float:
    """Seconds for one `profile_model` call."""
    model_file = load_model_file(model_path)
    start = time.perf_counter()
    profile_model(model_file, settings)
    return time.perf_counter() - start


def main() -> None:
    """Run the rounds and print each ratio and their median."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "gpt.py")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = ProfileSettings(batch_size=args.batch_size)
    steps = settings.warmup + settings.iters
    plain_steps_s(args.model, args.batch_size, 2)  # warm the allocator and kernels once for both
    ratios = []
    print(f"model {args.model.name}, batch {args.batch_size}, {steps} steps "
          f"(warmup {settings.warmup} + iters {settings.iters}), {torch.get_num_threads()} threads")
    for round_index in range(args.rounds):
        if round_index % 2 == 0:
            plain = plain_steps_s(args.model, args.batch_size, steps)
            profiled = profiler_s(args.model, settings)
        else:
            profiled = profiler_s(args.model, settings)
            plain = plain_steps_s(args.model, args.batch_size, steps)
        ratios.append(profiled / plain)
        print(f"round {round_index + 1}: profiler {profiled:.2f} s, {steps} plain steps {plain:.2f} s, "
              f"ratio {profiled / plain:.2f}")
    print(f"median ratio profiler / plain steps: {statistics.median(ratios):.2f} (target <= 3)")


if __name__ == "__main__":
    main()
