"""PipeDream's cost model: its stage value, bottleneck objective and memory, as pure functions (no I/O).

PipeDream's published objective (Narayanan et al., SOSP 2019), on a flat cluster of G devices
with bandwidth B bytes/s, times in seconds per profiled mini-batch. For a stage s with total
forward+backward time T_s, parameter bytes P_s and r_s replicas:

    stage_time = (T_s + 4 (r_s - 1) P_s / (B r_s)) / r_s
    comm_in    = 2 cut_before(s) / (B r_s)        (not for the first stage)
    comm_out   = 2 cut_after(s) / (B r_s)         (not for the last stage)
    value(s)   = max(stage_time, comm_in, comm_out)

and a plan's objective, its bottleneck, is the maximum of value(s) over its stages.

Memory per device of a stage (used as a constraint when a device memory is given), for the
asynchronous 1F1B schedule PipeDream runs with weight stashing: with W the stage's weight bytes,
A its saved activation bytes per mini-batch, k optimizer state copies (Adam 2, SGD with
momentum 1) and n = 1 + ceil(D / r) mini-batches in flight per replica (D: devices of the
stages after it; PipeDream's NOAM = ceil(devices from this stage on / r)),

    memory = W (weights) + W (gradients) + k W (optimizer) + (n - 1) W (stashed versions) + n A
           = W (1 + k) + n (W + A)
"""

from __future__ import annotations

from typing import NamedTuple, Union

import numpy as np

from planner.costs.layer_arrays import LayerArrays
from planner.schedules.schedule import ArrayOrInt

ArrayOrFloat = Union[float, np.ndarray]


class PipeDreamStage(NamedTuple):
    """A stage of a PipeDream plan: layers [start, stop) on `replicas` devices."""

    start: int
    stop: int
    replicas: int


def pipedream_unit_terms(param_bytes: ArrayOrFloat, cut_in_bytes: ArrayOrFloat, cut_out_bytes: ArrayOrFloat,
                         bandwidth_Bps: float) -> tuple[ArrayOrFloat, ArrayOrFloat]:
    """(a, c) = (4 P / B, 2 max(cut_before, cut_after) / B): the all-reduce and transfer terms at one replica,
    seconds; the optimizer keeps them per candidate stage and the formulas below divide them by r."""
    return 4.0 * param_bytes / bandwidth_Bps, 2.0 * np.maximum(cut_in_bytes, cut_out_bytes) / bandwidth_Bps


def pipedream_time_from_units(compute_s: ArrayOrFloat, allreduce_unit_s: ArrayOrFloat,
                              replicas: ArrayOrInt) -> ArrayOrFloat:
    """stage_time = (T + a (r - 1) / r) / r, element-wise, seconds."""
    return (compute_s + allreduce_unit_s * (replicas - 1.0) / replicas) / replicas


def pipedream_value_from_units(compute_s: ArrayOrFloat, allreduce_unit_s: ArrayOrFloat, comm_unit_s: ArrayOrFloat,
                               replicas: ArrayOrInt) -> ArrayOrFloat:
    """value = max(stage_time, c / r), element-wise, seconds: the one formula behind the optimizer's table of
    candidate stages, the plan's reported values and `pipedream_stage_value_s`."""
    return np.maximum(pipedream_time_from_units(compute_s, allreduce_unit_s, replicas), comm_unit_s / replicas)


def pipedream_stage_value_s(
    compute_s: float, param_bytes: float, cut_in_bytes: float, cut_out_bytes: float, replicas: int,
    bandwidth_Bps: float,
) -> float:
    """max(stage_time, comm_in, comm_out) of one stage under PipeDream's objective, in seconds."""
    allreduce_unit, comm_unit = pipedream_unit_terms(param_bytes, cut_in_bytes, cut_out_bytes, bandwidth_Bps)
    return float(pipedream_value_from_units(compute_s, allreduce_unit, comm_unit, replicas))


def pipedream_in_flight(replicas: int, downstream_devices: int) -> int:
    """Mini-batches in flight per replica of a stage: 1 + ceil(downstream_devices / replicas)."""
    return 1 + -(-downstream_devices // replicas)


def pipedream_stage_memory_bytes(
    weight_bytes: float, saved_bytes: float, replicas: int, downstream_devices: int, optimizer_copies: int
) -> float:
    """Bytes per device of a stage: W (1 + k) + n (W + A), n = `pipedream_in_flight` (module docstring)."""
    return weight_bytes * (1 + optimizer_copies) + pipedream_in_flight(replicas, downstream_devices) * (weight_bytes + saved_bytes)


def pipedream_bottleneck_s(
    arrays: LayerArrays, stages: list[tuple[int, int, int]], bandwidth_Bps: float
) -> float:
    """The objective of a plan given as (start, stop, replicas) stages: max of their values."""
    return max(
        pipedream_stage_value_s(
            float(arrays.compute_s[stop] - arrays.compute_s[start]),
            float(arrays.param_bytes[stop] - arrays.param_bytes[start]),
            arrays.cut_before(start), arrays.cut_after(stop), replicas, bandwidth_Bps,
        )
        for start, stop, replicas in stages
    )
