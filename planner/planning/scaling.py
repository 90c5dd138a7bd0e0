"""scaling_table(): predicted throughput of re-planning a profile on 1, 2, 4, ... GPUs of a cluster (pure)."""

from __future__ import annotations

import dataclasses

import math
from typing import Any, Sequence

import pandas as pd

from planner.files.cluster import Cluster, ClusterError, Level
from planner.errors import InfeasiblePlanError
from planner.planning.partition import compare_baselines, partition
from planner.files.plan import Plan
from planner.files.profile import Profile
from planner.units import plural

COLUMNS = ("gpus", "pipeline_samples_per_s", "data_parallel_samples_per_s", "ideal_samples_per_s",
           "devices_used", "stages")
DATA_PARALLEL = "data-parallel"  # the name of that baseline in `baselines.baseline_plans`


def scaling_table(
    profile: Profile, cluster: Cluster, gpu_counts: Sequence[int] | None = None, **partition_kwargs: Any
) -> pd.DataFrame:
    """One row per GPU count (default: 1, 2, 4, ... below `cluster.num_devices`, and that count):
    the plan `partition(profile, subcluster(cluster, gpus), **partition_kwargs)` makes and its
    predicted samples/s (`pipeline_samples_per_s`), the data-parallel baseline on those GPUs under
    the same cost model and schedule (`data_parallel_samples_per_s`; NaN where it does not fit the
    device memory), `ideal_samples_per_s` (one device's throughput x gpus), `devices_used` and
    `stages` of the plan.

    `gpus` is int; the other columns are float, NaN where unknown (not the nullable Int64, so a row
    read alone keeps NaN rather than pd.NA). A count with no plan that fits the memory gives NaN in
    every column but `gpus` and the ideal, not an error. One device's throughput is the 1-GPU
    plan's when there is one, else any plan's samples/s over its `speedup_vs_single_device` (NaN
    if nothing fits). `table.attrs["model_name"]` names the profile's model.
    """
    counts = default_gpu_counts(cluster.num_devices) if gpu_counts is None else [int(c) for c in gpu_counts]
    plans = {gpus: _plan_or_none(profile, subcluster(cluster, gpus), partition_kwargs) for gpus in counts}
    single = _single_device_samples_per_s(plans)
    rows = []
    for gpus, plan in plans.items():
        rows.append({
            "gpus": gpus,
            "pipeline_samples_per_s": math.nan if plan is None else plan.predicted.samples_per_s,
            "data_parallel_samples_per_s": math.nan if plan is None else _data_parallel_samples_per_s(profile, plan),
            "ideal_samples_per_s": single * gpus,
            "devices_used": math.nan if plan is None else plan.predicted.devices_used,
            "stages": math.nan if plan is None else len(plan.stages),
        })
    table = pd.DataFrame(rows, columns=list(COLUMNS)).astype({column: "float64" for column in COLUMNS[1:]})
    table.attrs["model_name"] = profile.model_name
    return table


def default_gpu_counts(gpus: int) -> list[int]:
    """Powers of two below `gpus`, then `gpus`: 1, 2, 4, 8 for 8; 1, 2, 4, 8, 12 for 12."""
    counts, count = [], 1
    while count < gpus:
        counts.append(count)
        count *= 2
    return counts + [gpus]


def subcluster(cluster: Cluster, gpus: int) -> Cluster:
    """The cluster made of ranks 0 .. gpus - 1 of `cluster` (same memory per device).

    Within one innermost group (e.g. fewer GPUs than a node holds) it is flat at that level's
    bandwidth. Otherwise it keeps every inner level whose group size divides `gpus`, and the
    groups of the last kept one form an outer level at the bandwidth of the slowest link among
    those ranks (exact when they lie in one group of the next level; pessimistic for pairs on a
    faster link otherwise, e.g. 12 GPUs of 8-GPU nodes become one flat level at the inter-node
    bandwidth). ClusterError unless 1 <= gpus <= cluster.num_devices.
    """
    if not 1 <= gpus <= cluster.num_devices:
        raise ClusterError(f"cannot take {plural(gpus, 'GPU')} from a cluster of {cluster.num_devices}")
    if gpus == cluster.num_devices:
        return cluster
    innermost = cluster.levels[0]
    if gpus <= innermost.size:
        return Cluster((dataclasses.replace(innermost, size=gpus),), cluster.memory_bytes)
    kept: list[Level] = []
    group = 1
    for level in cluster.levels:
        if (group * level.size) >= gpus or gpus % (group * level.size):
            break
        kept.append(level)
        group *= level.size
    outer = cluster.levels[cluster.span_level(0, gpus - 1)]
    return Cluster(tuple(kept) + (dataclasses.replace(outer, size=gpus // group),), cluster.memory_bytes)


def _plan_or_none(profile: Profile, cluster: Cluster, partition_kwargs: dict[str, Any]) -> Plan | None:
    try:
        return partition(profile, cluster, **partition_kwargs)
    except InfeasiblePlanError:
        return None


def _single_device_samples_per_s(plans: dict[int, Plan | None]) -> float:
    one = plans.get(1)
    if one is not None:
        return one.predicted.samples_per_s
    for plan in plans.values():
        if plan is not None and plan.predicted.speedup_vs_single_device > 0:
            return plan.predicted.samples_per_s / plan.predicted.speedup_vs_single_device
    return math.nan


def _data_parallel_samples_per_s(profile: Profile, plan: Plan) -> float:
    """The data-parallel baseline's samples/s: the plan's samples per iteration over the baseline's
    iteration time (both under the plan's cost model, schedule and microbatches); NaN if it does
    not fit the device memory."""
    baseline = next(b for b in compare_baselines(profile, plan) if b.name == DATA_PARALLEL)
    limit = plan.cluster.memory_bytes
    if (limit is not None and baseline.peak_memory_bytes > limit) or baseline.iteration_s <= 0:
        return math.nan
    samples_per_iteration = plan.predicted.samples_per_s * plan.predicted.iteration_ms / 1000.0
    return samples_per_iteration / baseline.iteration_s
