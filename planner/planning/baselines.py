"""Baseline plans that tools use without a planner, to compare an optimized plan against.

Each is a list of (start, stop, replicas) stages over layer indices:
- `uniform`: equal layer counts per stage (DeepSpeed's partition_method="uniform");
- `parameters`: stages balanced by parameter bytes (DeepSpeed's "parameters");
- `time`: stages balanced by forward+backward time (torchgpipe's balance by time);
- `data-parallel`: one stage replicated on every device.
The pipelines use one device per stage and min(devices, layers) stages.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from planner.costs.layer_arrays import LayerArrays

Stages = list[tuple[int, int, int]]


def uniform_stages(num_layers: int, parts: int) -> Stages:
    """`parts` contiguous stages whose layer counts differ by at most one (larger ones first)."""
    parts = min(parts, num_layers)
    base, extra = divmod(num_layers, parts)
    stages, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        stages.append((start, stop, 1))
        start = stop
    return stages


def balanced_stages(weights: Sequence[float], parts: int) -> Stages:
    """`parts` non-empty contiguous stages minimising the largest stage weight (linear partition).

    Bisection on the largest weight W with a greedy check (cut before a layer that would push the
    current stage over W) finds the optimum of max-weight; stages are then split further, at the
    heaviest stage first, until there are exactly `parts`.
    """
    values = np.asarray(weights, dtype=float)
    parts = min(parts, len(values))
    low, high = float(values.max(initial=0.0)), float(values.sum())

    def greedy(limit: float) -> list[int]:
        cuts, running = [0], 0.0
        for index, value in enumerate(values):
            if running + value > limit and index > cuts[-1]:
                cuts.append(index)
                running = 0.0
            running += value
        return cuts + [len(values)]

    for _ in range(100):
        if high - low <= 1e-12 * max(high, 1e-30):
            break
        middle = (low + high) / 2
        if len(greedy(middle)) - 1 <= parts:
            high = middle
        else:
            low = middle
    bounds = greedy(high)
    while len(bounds) - 1 < parts:  # split the heaviest stage that has more than one layer
        spans = [(values[a:b].sum(), a, b) for a, b in zip(bounds, bounds[1:]) if b - a > 1]
        _, a, b = max(spans)
        bounds.insert(bounds.index(b), a + (b - a) // 2)
    return [(a, b, 1) for a, b in zip(bounds, bounds[1:])]


def baseline_plans(arrays: LayerArrays, devices: int) -> dict[str, Stages]:
    """Every baseline of the module docstring for `devices` devices."""
    layer_time = np.diff(arrays.compute_s)
    layer_params = np.diff(arrays.param_bytes)
    n = arrays.num_layers
    return {
        "uniform": uniform_stages(n, devices),
        "parameters": balanced_stages(layer_params, devices),
        "time": balanced_stages(layer_time, devices),
        "data-parallel": [(0, n, devices)],
    }
