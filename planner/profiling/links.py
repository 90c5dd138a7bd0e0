"""Link models from timings: latency and bandwidth of a link fitted to message times (pure, no I/O)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from planner.errors import PlannerError

__all__ = ["fit_allreduce", "fit_link"]


def fit_link(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) of the line t = latency + bytes / bandwidth through one-way
    message times, fitted by least squares on relative errors (sum of ((model - t) / t)^2): small
    messages fix the latency, large ones the bandwidth, and neither drowns the other.

    The latency is clamped at 0 (refitted as t = bytes / bandwidth); PlannerError for fewer than
    two distinct sizes, a time that is not positive, or times that do not grow with the size
    (no bandwidth can be read off them)."""
    sizes = np.asarray(sizes_bytes, dtype=float)
    times = np.asarray(times_s, dtype=float)
    if sizes.shape != times.shape or len(np.unique(sizes)) < 2:
        raise PlannerError(f"fitting a link needs times at two or more message sizes, got sizes {list(sizes)}")
    if not np.all(times > 0) or not np.all(np.isfinite(times)):
        raise PlannerError(f"message times must be positive seconds, got {list(times)}")
    weights = 1.0 / times
    design = np.column_stack([np.ones_like(sizes), sizes]) * weights[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(design, times * weights, rcond=None)
    if latency < 0:
        latency = 0.0
        per_byte = float(np.sum(sizes * weights * weights * times) / np.sum((sizes * weights) ** 2))
    if not per_byte > 0:
        raise PlannerError(f"message times {list(times)} do not grow with the sizes {list(sizes)}: "
                           "no bandwidth can be read off them; measure larger messages")
    return float(latency), float(1.0 / per_byte)


def fit_allreduce(sizes_bytes: Sequence[float], times_s: Sequence[float], ranks: int) -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) of the ring formula t = 2 (n - 1) (bytes / (n bandwidth) + latency)
    (`costs.schedule_cost.allreduce_s`) through all-reduce times over n = `ranks` ranks: `fit_link` on
    t = L + x / bandwidth with x = 2 (n - 1) / n bytes, then latency = L / (2 (n - 1)). The terms that
    price a library's all-reduce (its algorithm, copies, synchronisation) in the planner's formula;
    PlannerError as `fit_link`, or for fewer than 2 ranks."""
    if ranks < 2:
        raise PlannerError(f"an all-reduce over {ranks} rank(s) moves nothing; fitting one needs 2 or more")
    hops = 2.0 * (ranks - 1)
    latency, bandwidth = fit_link([hops / ranks * size for size in sizes_bytes], times_s)
    return latency / hops, bandwidth
