"""scaling_table: re-planned throughput per GPU count, its ideal and data-parallel columns, infeasible counts as NaN."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import planner.planning.optimizer as optimizer_module
import planner.planning.pipedream_optimizer as pipedream_module
from planner.files.cluster import Cluster, ClusterError, Level, make_cluster
from planner.planning.partition import compare_baselines, partition
from planner.files.profile import Profile, load_profile
from planner.planning.scaling import COLUMNS, default_gpu_counts, scaling_table, subcluster

PROFILES = Path(__file__).resolve().parents[3] / "profiles"
FAST = dict(schedule="1f1b", microbatches=4)  # fixed choices keep each solve short


@pytest.fixture(scope="module")
def gpt() -> Profile:
    return load_profile(PROFILES / "gpt.json")


def test_default_gpu_counts_are_powers_of_two_then_the_cluster() -> None:
    assert default_gpu_counts(1) == [1]
    assert default_gpu_counts(8) == [1, 2, 4, 8]
    assert default_gpu_counts(12) == [1, 2, 4, 8, 12]


def test_subcluster_of_two_nodes() -> None:
    """Within a node: flat at the node's bandwidth; whole nodes: two levels; the full count: the cluster itself."""
    cluster = make_cluster(16, 8, ("300GB/s", "25GB/s"), memory="80GB")
    assert subcluster(cluster, 16) == cluster
    assert subcluster(cluster, 3) == Cluster((Level("node", 3, 300e9),), cluster.memory_bytes)
    assert subcluster(cluster, 8) == Cluster((Level("node", 8, 300e9),), cluster.memory_bytes)
    # 12 GPUs are a node and a half: one flat level at the slowest link among them
    assert subcluster(cluster, 12) == Cluster((Level("cluster", 12, 25e9),), cluster.memory_bytes)
    for gpus in (0, 17):
        with pytest.raises(ClusterError):
            subcluster(cluster, gpus)


def test_subcluster_of_three_levels_keeps_whole_groups() -> None:
    levels = (Level("node", 8, 300e9), Level("rack", 4, 50e9), Level("cluster", 4, 10e9))
    cluster = Cluster(levels)
    assert subcluster(cluster, 24) == Cluster((levels[0], Level("rack", 3, 50e9)))
    assert subcluster(cluster, 64) == Cluster((levels[0], levels[1], Level("cluster", 2, 10e9)))
    # every link of the smaller cluster is one the original has between the same ranks
    small = subcluster(cluster, 32)
    for first, last in ((0, 7), (0, 8), (5, 31)):
        assert small.levels[small.span_level(first, last)] == cluster.levels[cluster.span_level(first, last)]


def test_table_without_memory_limit(gpt: Profile) -> None:
    """Rows 1, 2, 4; one GPU is the ideal; ideal = gpus x single; every row matches a direct partition."""
    cluster = make_cluster(4, bandwidths=("2GB/s",))
    table = scaling_table(gpt, cluster, **FAST)
    assert list(table.columns) == list(COLUMNS)
    assert list(table["gpus"]) == [1, 2, 4]
    single = table.loc[0, "pipeline_samples_per_s"]
    assert single > 0
    assert table.loc[0, "ideal_samples_per_s"] == pytest.approx(single)
    assert list(table["ideal_samples_per_s"]) == pytest.approx([single * g for g in (1, 2, 4)])
    for row in table.itertuples(index=False):
        plan = partition(gpt, subcluster(cluster, row.gpus), **FAST)
        assert row.pipeline_samples_per_s == pytest.approx(plan.predicted.samples_per_s)
        assert row.devices_used == plan.predicted.devices_used <= row.gpus
        assert row.stages == len(plan.stages)
        assert row.data_parallel_samples_per_s > 0  # fits: no limit
    # data parallel: the plan's samples per iteration over the data-parallel baseline's iteration
    plan = partition(gpt, cluster, **FAST)
    baseline = next(b for b in compare_baselines(gpt, plan) if b.name == "data-parallel")
    samples = plan.predicted.samples_per_s * plan.predicted.iteration_ms / 1000
    assert table.loc[2, "data_parallel_samples_per_s"] == pytest.approx(samples / baseline.iteration_s)
    # on one GPU data parallelism is the plan itself
    assert table.loc[0, "data_parallel_samples_per_s"] == pytest.approx(single)
    assert table.attrs["model_name"] == gpt.model_name


def test_too_little_memory_for_one_gpu_gives_a_nan_row(gpt: Profile) -> None:
    """gpt needs ~180 MB on one GPU: with 120 MB the 1-GPU row is NaN, 2 GPUs fit; data parallel never fits."""
    cluster = make_cluster(2, memory="120MB")
    table = scaling_table(gpt, cluster, gpu_counts=[1, 2], **FAST)
    one, two = table.iloc[0], table.iloc[1]
    assert math.isnan(one["pipeline_samples_per_s"]) and math.isnan(one["data_parallel_samples_per_s"])
    assert one[["devices_used", "stages"]].isna().all()
    assert two["pipeline_samples_per_s"] > 0 and 1 <= two["devices_used"] <= 2
    assert math.isnan(two["data_parallel_samples_per_s"])  # the whole model on each GPU does not fit
    plan = partition(gpt, cluster, **FAST)
    single = plan.predicted.samples_per_s / plan.predicted.speedup_vs_single_device
    assert list(table["ideal_samples_per_s"]) == pytest.approx([single, 2 * single])


@pytest.mark.parametrize("cost_model", ["planner", "pipedream"])
def test_nothing_fits_gives_all_nan_without_raising_or_searching_the_least_memory(
        gpt: Profile, cost_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row where nothing fits is NaN: the least memory that would fit, a bisection of its own that only the
    error's message needs, is never searched."""
    searched: list[object] = []
    for module in (optimizer_module, pipedream_module):
        smallest = module._smallest_memory
        monkeypatch.setattr(module, "_smallest_memory",
                            lambda *args, smallest=smallest: searched.append(args) or smallest(*args))
    kwargs = FAST if cost_model == "planner" else dict(cost_model="pipedream")
    table = scaling_table(gpt, make_cluster(2, memory="2MB"), **kwargs)
    assert searched == []
    assert list(table["gpus"]) == [1, 2]
    for column in ("pipeline_samples_per_s", "data_parallel_samples_per_s", "ideal_samples_per_s",
                   "devices_used", "stages"):
        assert table[column].isna().all(), column
