"""partition(): from a profile and a cluster to a Plan, with its predictions (pure, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.baselines import baseline_plans
from planner.cluster import Cluster, ClusterError
from planner.costmodel import (
    OPTIMIZER_STATE_COPIES,
    LayerArrays,
    pipedream_bottleneck_s,
    pipedream_stage_memory_bytes,
    pipedream_stage_time_s,
)
from planner.errors import PlannerError
from planner.optimizer import optimize_pipedream
from planner.plan import Plan, Prediction, ProfileRef, StagePlan, profile_digest
from planner.profile import Profile

COST_MODELS = ("pipedream",)


def partition(
    profile: Profile, cluster: Cluster, cost_model: str = "pipedream", straight: bool = False,
    optimizer: str = "adam", profile_path: str = "",
) -> Plan:
    """The best plan for `profile` on `cluster` under `cost_model` (see `costmodel`, `optimizer`).

    `straight` forbids replication. With `cluster.memory_bytes`, every device's memory must fit
    (`optimizer` says how many optimizer state copies weights have). The plan may use fewer
    devices than the cluster has when more would not lower the objective; its notes then say so.
    """
    if cost_model not in COST_MODELS:
        raise PlannerError(f"unknown cost model {cost_model!r}; available: {', '.join(COST_MODELS)}")
    bandwidth = _flat_bandwidth(cluster)
    arrays = LayerArrays.from_profile(profile)
    solution = optimize_pipedream(
        arrays, cluster.num_devices, bandwidth, straight, cluster.memory_bytes, optimizer
    )
    stages = []
    next_rank = 0
    busy_s = 0.0
    for index, (start, stop, replicas) in enumerate(solution.stages):
        compute_s = float(arrays.compute_s[stop] - arrays.compute_s[start])
        params = float(arrays.param_bytes[stop] - arrays.param_bytes[start])
        cut_in, cut_out = arrays.cut_before(start), arrays.cut_after(stop)
        comm_s = 2.0 * max(cut_in, cut_out) / (bandwidth * replicas)
        stage_time_s = pipedream_stage_time_s(compute_s, params, replicas, bandwidth)
        busy_s += replicas * stage_time_s
        stages.append(StagePlan(
            start=start, stop=stop, first_layer=profile.layers[start].name, last_layer=profile.layers[stop - 1].name,
            replicas=replicas, ranks=tuple(range(next_rank, next_rank + replicas)), recompute=False,
            compute_ms=compute_s * 1000.0, comm_ms=comm_s * 1000.0, value_ms=max(stage_time_s, comm_s) * 1000.0,
            memory_bytes=_stage_memory_bytes(arrays, list(solution.stages), index, optimizer),
        ))
        next_rank += replicas
    bottleneck_s = solution.objective_s
    total_s = float(arrays.compute_s[-1])
    devices = cluster.num_devices
    data_parallel_s = pipedream_bottleneck_s(arrays, [(0, arrays.num_layers, devices)], bandwidth)
    per_batch = profile.batch_size or 1
    predicted = Prediction(
        bottleneck_s=bottleneck_s,
        iteration_ms=bottleneck_s * 1000.0,
        samples_per_s=per_batch / bottleneck_s if bottleneck_s > 0 else 0.0,
        bubble_fraction=1.0 - busy_s / (solution.devices * bottleneck_s) if bottleneck_s > 0 else 0.0,
        speedup_vs_single_device=total_s / bottleneck_s if bottleneck_s > 0 else 1.0,
        speedup_vs_data_parallel=data_parallel_s / bottleneck_s if bottleneck_s > 0 else 1.0,
        devices_used=solution.devices,
        peak_memory_bytes=max(stage.memory_bytes for stage in stages),
    )
    notes = []
    if solution.devices < devices:
        notes.append(f"uses {solution.devices} of {devices} GPUs: more would not lower the bottleneck")
    if profile.batch_size is None:
        notes.append("the profile does not say its batch size: samples/s counts profiled mini-batches")
    memory_note = (
        f"each device's memory fits {cluster.memory_bytes / 1e9:.4g} GB" if cluster.memory_bytes is not None
        else "memory is reported but not constrained (give --memory)"
    )
    notes.append(
        f"pipedream cost model: asynchronous 1F1B with weight stashing in steady state, one profiled mini-batch "
        f"per replica; iteration_ms is the time per mini-batch; {memory_note} ({optimizer} optimizer state)"
    )
    return Plan(
        profile=ProfileRef(profile.model_name, profile_path or profile.source, profile_digest(profile)),
        cluster=cluster, cost_model=cost_model, schedule="pipedream", microbatches=None,
        microbatch_size=profile.batch_size, straight=straight, stages=tuple(stages), predicted=predicted,
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class BaselineResult:
    """A baseline plan's stages and its objective under the same cost model."""

    name: str
    stages: tuple[tuple[int, int, int], ...]
    bottleneck_s: float
    peak_memory_bytes: int

    @property
    def devices(self) -> int:
        """Devices the baseline uses: the sum of its replicas."""
        return sum(replicas for _, _, replicas in self.stages)


def compare_baselines(profile: Profile, cluster: Cluster, optimizer: str = "adam") -> list[BaselineResult]:
    """The baselines of `baselines.baseline_plans` evaluated under PipeDream's objective on `cluster`."""
    bandwidth = _flat_bandwidth(cluster)
    arrays = LayerArrays.from_profile(profile)
    return [
        BaselineResult(name, tuple(stages), pipedream_bottleneck_s(arrays, stages, bandwidth),
                       max(_stage_memory_bytes(arrays, stages, index, optimizer) for index in range(len(stages))))
        for name, stages in baseline_plans(arrays, cluster.num_devices).items()
    ]


def _stage_memory_bytes(arrays: LayerArrays, stages: list[tuple[int, int, int]], index: int, optimizer: str) -> int:
    """Memory per device of stage `index` of a plan (`costmodel.pipedream_stage_memory_bytes`)."""
    start, stop, replicas = stages[index]
    downstream = sum(r for _, _, r in stages[index + 1:])
    return int(pipedream_stage_memory_bytes(
        arrays.stage_weight_bytes(start, stop), arrays.stage_saved_bytes(start, stop), replicas, downstream,
        OPTIMIZER_STATE_COPIES[optimizer],
    ))


def _flat_bandwidth(cluster: Cluster) -> float:
    """The single bandwidth of a flat cluster (PipeDream's objective knows no hierarchy)."""
    if len(cluster.levels) != 1:
        raise ClusterError(
            f"the pipedream cost model assumes a flat cluster of one level and one bandwidth, got "
            f"{len(cluster.levels)} levels; omit --gpus-per-node, or give one level in the cluster file"
        )
    return cluster.levels[0].bandwidth_Bps
