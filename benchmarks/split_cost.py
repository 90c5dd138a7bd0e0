"""What splitting a model into stages costs, against one plain training step of it, side by side in one run.

    python benchmarks/split_cost.py [--stages 4] [--batch-size 4] [--rounds 3]

For each example (mlp, vgg, resnet, gpt: sliced or traced by torch.fx; llama: a transformers
model, captured by torch.export) the model is split at evenly spaced layers (`find_layers`) with
`runtime.stages.split_model` at one example microbatch, as every process of a training job does
once at start. Printed: the split's method, its median seconds over `rounds`, one plain step
(forward + loss + backward) of the same microbatch, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from planner.profiling.layers import find_layers
from planner.profiling.model_file import checked_example_batch, default_loss, load_model_file
from runtime.stages import split_model

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ("mlp", "vgg", "resnet", "gpt", "llama")


def seconds(function: object) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    function()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'example':8} {'method':10} {'split s':>8} {'step s':>8} {'split/step':>10}")
    for name in EXAMPLES:
        model_file = load_model_file(REPO / "examples" / f"{name}.py")
        torch.manual_seed(0)
        model = model_file.build_model().train()
        inputs, target = checked_example_batch(model_file, options.batch_size)
        layers = [layer.name for layer in find_layers(model, lambda: model(*inputs))]
        points = [layers[len(layers) * k // options.stages] for k in range(1, options.stages)]
        loss_fn = model_file.loss_fn or default_loss

        def step() -> None:
            loss_fn(model(*inputs), target).backward()
            model.zero_grad(set_to_none=True)

        splits, steps, method = [], [], ""
        for _ in range(options.rounds):
            steps.append(seconds(step))
            start = time.perf_counter()
            method = split_model(model, points, inputs).method
            splits.append(time.perf_counter() - start)
        split_s, step_s = statistics.median(splits), statistics.median(steps)
        print(f"{name:8} {method:10} {split_s:8.3f} {step_s:8.3f} {split_s / step_s:10.1f}")


if __name__ == "__main__":
    main()
