"""The schedule cost model on hand-checked cases: objectives, all-reduce, memory in flight, placement."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs.layer_arrays import optimizer_terms, per_weight_byte, scratch_per_largest
from planner.files.cluster import Cluster, make_cluster
from planner.files.profile import load_profile
from planner.costs.layer_arrays import ASSUMED_WEIGHT_SHARE, LayerArrays
from planner.costs.schedule_cost import (
    CostInputs,
    Stage,
    first_ranks,
    objective_s,
    placement_ok,
    plan_fits,
    reduce_terms,
    stage_costs,
    tied_allreduce_s,
)
from planner.schedules.schedule import CHUNKED_SCHEDULES, FLUSH_SCHEDULES, SCHEDULES, SPLIT_BACKWARD_SCHEDULES, WEIGHT
from planner.simulation.simulator import simulate_stages
from tests.planner.layer_strategies import layer_arrays
from tests.planner.planning.test_optimizer import clusters

WHOLE_BACKWARD = ("gpipe", "1f1b")  # flush schedules whose backward is one op

REL = 1e-12
REPO = Path(__file__).resolve().parents[3]


def prefix(values: Sequence[float]) -> np.ndarray:
    """Prefix sums starting at 0 (length len(values) + 1)."""
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])


def layers(
    compute: Sequence[float], fwd: Sequence[float] | None = None, params: Sequence[float] | None = None,
    cuts: Sequence[float] | None = None, saved: Sequence[float] | None = None,
    shared: tuple[tuple[int, tuple[int, ...], float], ...] = (), workspace: Sequence[float] | None = None,
) -> LayerArrays:
    """LayerArrays from per-layer values (missing ones are zero)."""
    n = len(compute)
    zeros = [0.0] * n
    return LayerArrays(
        compute_s=prefix(compute),
        param_bytes=prefix(params if params is not None else zeros),
        cut_bytes=np.asarray(cuts if cuts is not None else zeros, dtype=float),
        saved_bytes=prefix(saved if saved is not None else zeros),
        shared=shared,
        fwd_s=prefix(fwd if fwd is not None else zeros),
        workspace_bytes=None if workspace is None else np.asarray(workspace, dtype=float),
    )


def flat(gpus: int, bandwidth: str = "10GB/s") -> Cluster:
    """A one-level cluster of `gpus` devices."""
    return make_cluster(gpus, None, [bandwidth])


def two_nodes_of_four() -> Cluster:
    """2 nodes x 4 GPUs, 100 GB/s inside a node, 10 GB/s between nodes."""
    return make_cluster(8, 4, ["100GB/s", "10GB/s"])


def one_layer_per_stage(num_layers: int, replicas: int = 1) -> list[Stage]:
    """A straight plan: stage k holds layer k."""
    return [(k, k + 1, replicas, False) for k in range(num_layers)]


# ---- objectives ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", WHOLE_BACKWARD)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_flush_equal_stages_is_m_plus_s_minus_one_times_f_plus_b(schedule: str, m: int) -> None:
    f, b = 0.25, 0.5
    arrays = layers([f + b] * 4, fwd=[f] * 4)
    inputs = CostInputs(arrays, flat(4), schedule, m)
    assert objective_s(inputs, one_layer_per_stage(4)) == pytest.approx((m + 3) * (f + b), rel=REL)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_pipedream_equal_stages_is_one_stage_time(m: int) -> None:
    f, b = 0.25, 0.5
    arrays = layers([f + b] * 4, fwd=[f] * 4)
    inputs = CostInputs(arrays, flat(4), "pipedream", m)
    assert objective_s(inputs, one_layer_per_stage(4)) == pytest.approx(f + b, rel=REL)


@pytest.mark.parametrize("schedule", WHOLE_BACKWARD)
def test_flush_unequal_stages_sum_plus_busiest(schedule: str) -> None:
    # stages of 0.1, 0.4, 0.2 s: fill/drain 0.7 s, then the 0.4 s stage takes m - 1 more periods
    arrays = layers([0.1, 0.4, 0.2], fwd=[0.05, 0.1, 0.1])
    inputs = CostInputs(arrays, flat(3), schedule, 6)
    assert objective_s(inputs, one_layer_per_stage(3)) == pytest.approx(0.7 + 5 * 0.4, rel=REL)


def test_scale_multiplies_times_not_weights() -> None:
    # sigma = 0.5 halves compute; the all-reduce of the 1 GB weights over 1 GB/s does not scale
    arrays = layers([0.8], fwd=[0.2], params=[1e9])
    inputs = CostInputs(arrays, flat(2, "1GB/s"), "gpipe", 3, scale=0.5)
    t = 0.4
    allreduce = 2 * (2 - 1) / 2 * 1e9 / 1e9  # 1 s
    assert objective_s(inputs, [(0, 1, 2, False)]) == pytest.approx(t + 2 * t / 2 + allreduce, rel=REL)


@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_zb_h1_round_trip_leaves_the_w_out(m: int) -> None:
    # B = b - W per stage; W = ASSUMED_WEIGHT_SHARE x b when the arrays give no split: the trip 4 (f + B),
    # then the busiest stage's m - 1 more microbatches and its own W
    f, b = 0.25, 0.5
    arrays = layers([f + b] * 4, fwd=[f] * 4)
    inputs = CostInputs(arrays, flat(4), "zb-h1", m)
    w = ASSUMED_WEIGHT_SHARE * b
    assert objective_s(inputs, one_layer_per_stage(4)) == pytest.approx(4 * (f + b - w) + (m - 1) * (f + b) + w,
                                                                          rel=REL)
    assert stage_costs(inputs, one_layer_per_stage(4))[2].weight_s == pytest.approx(w, rel=REL)
    assert stage_costs(replace(inputs, schedule="1f1b"), one_layer_per_stage(4))[2].weight_s == 0.0


@pytest.mark.parametrize("schedule", sorted(SPLIT_BACKWARD_SCHEDULES))
def test_a_zero_bubble_first_stage_runs_its_backward_whole(schedule: str) -> None:
    # a backward split costs 1.5 times its whole (`for_schedule`), but the first stage has no input gradient to
    # compute: its B is empty and its W one backward, unsplit (as the engine runs it), W's share kept
    f, b, ratio = 0.25, 0.5, 1.5
    arrays = dataclasses.replace(layers([f + b] * 4, fwd=[f] * 4), split_backward_ratio=ratio).for_schedule(schedule)
    plan = one_layer_per_stage(4)
    inputs = CostInputs(arrays, flat(4), schedule, 8, chunks=2 if schedule == "zbv" else 1)
    costs = stage_costs(inputs, plan)
    w = ASSUMED_WEIGHT_SHARE * b
    assert [cost.compute_s for cost in costs] == pytest.approx([f + b] + [f + ratio * b] * 3, rel=REL)
    assert [cost.weight_s for cost in costs] == pytest.approx([w] + [ratio * w] * 3, rel=REL)
    if schedule == "zb-h1":  # the round trip still counts the first stage's B split: an upper bound
        assert objective_s(inputs, plan) == pytest.approx(4 * (f + ratio * (b - w)) + 7 * (f + ratio * b) + ratio * w,
                                                          rel=REL)
    timeline = simulate_stages(inputs, plan).events
    first = timeline[(timeline["stage"] == 0) & timeline["op"].isin(["backward", "weight"])]
    assert first.groupby("microbatch")["end_s"].max().sub(first.groupby("microbatch")["start_s"].min()).tolist() == \
        pytest.approx([b] * 8, rel=REL)  # B then W at once: one whole backward per microbatch
    unsplit = stage_costs(replace(inputs, arrays=arrays.for_schedule("1f1b")), plan)
    assert costs[0].compute_s == pytest.approx(unsplit[0].compute_s, rel=REL)


def test_zb_h1_holds_as_many_microbatches_as_the_first_stage_of_1f1b() -> None:
    # 4 straight stages, 8 microbatches, 1 byte saved each: 1f1b holds 4, 3, 2, 1; zb-h1 4 on every stage
    # (counted as if the plan used all the cluster's devices: 3 stages on a 4-device cluster hold 4 too)
    arrays = layers([1.0] * 4, fwd=[0.3] * 4, saved=[1.0] * 4)
    for schedule, held in (("1f1b", [4, 3, 2, 1]), ("zb-h1", [4, 4, 4, 4])):
        costs = stage_costs(CostInputs(arrays, flat(4), schedule, 8, optimizer_copies=0), one_layer_per_stage(4))
        assert [cost.memory_bytes for cost in costs] == pytest.approx(held, rel=REL)
    three = [(0, 2, 1, False), (2, 3, 1, False), (3, 4, 1, False)]
    costs = stage_costs(CostInputs(arrays, flat(4), "zb-h1", 8, optimizer_copies=0), three)
    assert [cost.memory_bytes for cost in costs] == pytest.approx([8, 4, 4], rel=REL)


@pytest.mark.parametrize("m", [8, 2])
def test_zb_h1_keeps_the_deferred_gradients_of_d_plus_1_microbatches(m: int) -> None:
    """Stage s of a 4-stage zb-h1 pipeline keeps the gradients W starts from for min(s + 1, m) microbatches
    (W of k runs after B of k + s), the first stage none (its W is its whole backward, run at once); the
    simulated timeline peaks at the same bytes; other schedules keep none."""
    arrays = dataclasses.replace(layers([1.0] * 4, fwd=[0.3] * 4, saved=[1.0] * 4),
                                 deferred_bytes=prefix([100.0] * 4))
    held = min(4, m)  # microbatches in flight on every stage
    expected = [held] + [held + 100.0 * min(s + 1, m) for s in range(1, 4)]
    inputs = CostInputs(arrays, flat(4), "zb-h1", m, optimizer_copies=0)
    plan = one_layer_per_stage(4)
    assert [cost.memory_bytes for cost in stage_costs(inputs, plan)] == pytest.approx(expected, rel=REL)
    assert list(simulate_stages(inputs, plan).peak_memory()) == pytest.approx(expected, rel=REL)
    whole = stage_costs(dataclasses.replace(inputs, schedule="1f1b"), plan)
    assert [cost.memory_bytes for cost in whole] == pytest.approx([min(4 - s, m) for s in range(4)], rel=REL)


@pytest.mark.parametrize("largest, peak", [(20.0, 94.0), (50.0, 114.0)])
def test_a_zero_bubble_b_holds_what_a_layer_holds_with_what_the_layers_after_it_keep_and_a_w_its_weight_gradient(
        largest: float, peak: float) -> None:
    """zb-h1 on 2 devices, 4 microbatches: layer 0 alone (workspace 7), then layers 1 and 2 (1 byte saved each per
    microbatch, kept for W 10 and 20, B holding 40 and 25 there, largest weights 2 and `largest`). The last stage's
    B holds b = max(40 + 20, 25) = 60 at its peak (layer 1's while layer 2's kept gradients wait), not 40 + 30
    (every layer's kept gradients under the largest) nor 40; its W holds its own 30 kept and a weight gradient.
    It runs F0 B0 F1 B1 W0 ...: during B1 microbatch 0 waits for its W (2 + 30) while 1 is in its B (2 + 60): 94;
    after B1 both wait (4 + 60); during W0 microbatch 1 waits (2 + 30) while 0 holds 2 + 30 + `largest`: 84, or
    114 with a 50-byte weight. The first stage's W is its whole backward: its 2 microbatches + 7. Recomputing, the
    last stage holds its 0-byte input per microbatch, and its W reads what B rebuilt (2 + 40): 2 x 30 + 42. The
    closed form and the simulator agree. Without B measured, b is the workspace with all the stage keeps: 70."""
    arrays = dataclasses.replace(layers([1.0] * 3, fwd=[0.3] * 3, saved=[1.0] * 3, workspace=[7.0, 40.0, 25.0]),
                                 deferred_bytes=prefix([5.0, 10.0, 20.0]),
                                 input_workspace_bytes=np.array([7.0, 40.0, 25.0]),
                                 largest_param_bytes=np.array([0.0, 2.0, largest]))
    assert list(arrays.kept_workspace_bytes(np.array([1, 2]), np.array([3, 3]))) == [60.0, 25.0]
    bound = dataclasses.replace(arrays, input_workspace_bytes=None)
    assert list(bound.kept_workspace_bytes(np.array([1, 2]), np.array([3, 3]))) == [40.0 + 30.0, 25.0 + 20.0]
    inputs = CostInputs(arrays, flat(2), "zb-h1", 4, optimizer_copies=0)
    plan = [(0, 1, 1, False), (1, 3, 1, False)]
    timeline = simulate_stages(inputs, plan)
    assert list(timeline.peak_memory()) == pytest.approx([2 + 7, peak], rel=REL)
    assert [cost.memory_bytes for cost in stage_costs(inputs, plan)] == pytest.approx([2 + 7, peak], rel=REL)
    events = timeline.events
    w0 = events[(events["op"] == WEIGHT) & (events["stage"] == 1) & (events["microbatch"] == 0)].iloc[0]
    memory = timeline.memory()
    last = memory[memory["rank"] == 1]
    at_w0 = last[last["time_s"] == w0["start_s"]]["bytes"]  # B1 ends, W0 begins
    assert list(at_w0) == pytest.approx([4 + 60, 4 + 60 + largest], rel=REL)
    recomputing = [(0, 1, 1, False), (1, 3, 1, True)]
    assert list(simulate_stages(inputs, recomputing).peak_memory())[1] == pytest.approx(60 + 42, rel=REL)
    assert stage_costs(inputs, recomputing)[1].memory_bytes == pytest.approx(60 + 42, rel=REL)
    whole = CostInputs(arrays, flat(2), "1f1b", 4, optimizer_copies=0)  # no split: a layer's workspace alone
    assert stage_costs(whole, plan)[1].memory_bytes == pytest.approx(2 + 40, rel=REL)


@pytest.mark.parametrize("schedule", WHOLE_BACKWARD)
def test_flush_recompute_adds_forward_to_stage_and_fill_drain(schedule: str) -> None:
    f, b, m = 0.25, 0.5, 4
    arrays = layers([f + b] * 4, fwd=[f] * 4)
    inputs = CostInputs(arrays, flat(4), schedule, m)
    stages = one_layer_per_stage(4)
    stages[1] = (1, 2, 1, True)
    # fill/drain 4 (f + b) + f; the recomputing stage (2f + b) is the busiest
    expected = 4 * (f + b) + f + (m - 1) * (2 * f + b)
    assert objective_s(inputs, stages) == pytest.approx(expected, rel=REL)
    assert stage_costs(inputs, stages)[1].compute_s == pytest.approx(2 * f + b, rel=REL)
    assert stage_costs(inputs, stages)[0].compute_s == pytest.approx(f + b, rel=REL)


def test_pipedream_recompute_adds_forward_to_stage() -> None:
    f, b = 0.25, 0.5
    arrays = layers([f + b] * 4, fwd=[f] * 4)
    inputs = CostInputs(arrays, flat(4), "pipedream", 4)
    stages = one_layer_per_stage(4)
    stages[2] = (2, 3, 1, True)
    assert objective_s(inputs, stages) == pytest.approx(2 * f + b, rel=REL)


def test_recompute_of_a_multi_layer_stage_adds_its_whole_forward() -> None:
    arrays = layers([0.5, 0.25, 1.0], fwd=[0.125, 0.0625, 0.25])
    inputs = CostInputs(arrays, flat(1), "1f1b", 3)
    # one stage, recompute: t = 1.75 + 0.4375; sum t = t; Q = 2 t
    t = 1.75 + 0.4375
    assert objective_s(inputs, [(0, 3, 1, True)]) == pytest.approx(3 * t, rel=REL)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_flush_allreduce_is_ring_over_stage_bandwidth(replicas: int) -> None:
    weights, bandwidth, m, t = 1e9, 1e10, 5, 0.3
    arrays = layers([t], fwd=[0.1], params=[weights])
    inputs = CostInputs(arrays, flat(4, "10GB/s"), "gpipe", m)
    allreduce = 2 * (replicas - 1) / replicas * weights / bandwidth
    cost = stage_costs(inputs, [(0, 1, replicas, False)])[0]
    assert cost.allreduce_s == pytest.approx(allreduce, rel=REL)
    assert objective_s(inputs, [(0, 1, replicas, False)]) == pytest.approx(
        t + (math.ceil(m / replicas) - 1) * t + allreduce, rel=REL  # the busiest replica's other microbatches
    )


def test_tied_weights_are_summed_by_a_ring_over_every_rank_of_the_stages_holding_them() -> None:
    # a 4e8-byte weight tied between layers 0 and 2, 10 GB/s, 20 us per message
    arrays = layers([0.1, 0.1, 0.1], params=[4e8, 0.0, 0.0], shared=((0, (2,), 4e8),))
    inputs = CostInputs(arrays, make_cluster(4, None, ["10GB/s"], latencies=["20us"]), "1f1b", 4)
    two = 2 * (2 - 1) * (4e8 / (2 * 1e10) + 20e-6)  # one rank per holder: g = 2
    assert tied_allreduce_s(inputs, [(0, 1, 1, False), (1, 3, 1, False)]) == pytest.approx([two, two], rel=REL)
    three = 2 * (3 - 1) * (4e8 / (3 * 1e10) + 20e-6)  # the first holder on 2 replicas: g = 3
    found = tied_allreduce_s(inputs, [(0, 1, 2, False), (1, 2, 1, False), (2, 3, 1, False)])
    assert found == pytest.approx([three, 0.0, three], rel=REL)  # the middle stage holds no copy
    assert tied_allreduce_s(inputs, [(0, 3, 1, False)]) == [0.0]  # one stage holds every user: nothing to sum
    costs = stage_costs(inputs, [(0, 1, 1, False), (1, 3, 1, False)])
    assert [cost.tied_s for cost in costs] == pytest.approx([two, two], rel=REL)
    # a cluster file with measured all-reduce terms (`planner cluster`): they price it, not the link's
    level = dataclasses.replace(inputs.cluster.levels[0], allreduce_bandwidth_Bps=4e9, allreduce_latency_s=1e-4)
    measured = dataclasses.replace(inputs, cluster=dataclasses.replace(inputs.cluster, levels=(level,)))
    slower = 2 * (2 - 1) * (4e8 / (2 * 4e9) + 1e-4)
    assert tied_allreduce_s(measured, [(0, 1, 1, False), (1, 3, 1, False)]) == pytest.approx([slower] * 2, rel=REL)
    replicated = stage_costs(measured, [(0, 1, 2, False), (1, 3, 1, False)])[0].allreduce_s  # the replicas' too
    assert replicated == pytest.approx(2 * (2 - 1) * (0.0 / (2 * 4e9) + 1e-4), rel=REL)  # W' = 0: all tied


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_pipedream_allreduce_every_microbatch(replicas: int) -> None:
    weights, bandwidth, t = 1e9, 1e10, 0.3
    arrays = layers([t], fwd=[0.1], params=[weights])
    inputs = CostInputs(arrays, flat(4, "10GB/s"), "pipedream", 7)
    allreduce = 2 * (replicas - 1) / replicas * weights / bandwidth
    assert objective_s(inputs, [(0, 1, replicas, False)]) == pytest.approx((t + allreduce) / replicas, rel=REL)


def test_a_weight_tied_across_stages_is_summed_over_all_its_holders_not_among_each_stages_replicas() -> None:
    # layer 0 owns a 2 GB tied weight that layer 2 also uses: a stage holding layer 2 (not 0) holds a copy
    arrays = layers([0.1, 0.1, 0.1], params=[3e9, 1e9, 1e9], shared=((0, (2,), 2e9),))
    inputs = CostInputs(arrays, flat(4, "10GB/s"), "gpipe", 1)
    costs = stage_costs(inputs, [(0, 1, 2, False), (1, 3, 2, False)])
    # the replicas all-reduce the rest (the engine sums the tied weight in one group of all 4 ranks)
    assert costs[0].allreduce_s == pytest.approx(2 * 0.5 * 1e9 / 1e10, rel=REL)
    assert costs[1].allreduce_s == pytest.approx(2 * 0.5 * 2e9 / 1e10, rel=REL)  # layers 1 and 2's own
    assert [cost.tied_s for cost in costs] == pytest.approx([2 * 3 * 2e9 / (4 * 1e10)] * 2, rel=REL)
    # one stage holding both users: the tied weight is an ordinary one of its replicas
    whole = stage_costs(inputs, [(0, 3, 2, False)])[0]
    assert whole.allreduce_s == pytest.approx(2 * 0.5 * 5e9 / 1e10, rel=REL) and whole.tied_s == 0.0


def test_a_tied_weight_is_summed_once_per_rank_holding_it_on_the_ranks_last_stage() -> None:
    """zbv on 2 ranks, stages on ranks 0 1 1 0: a 2 GB weight of layer 0 also used by layers 2 and 3 is held by
    ranks 0 and 1 (rank 0 twice, one Parameter): one all-reduce among 2 ranks, on each rank's last stage (3 and
    2); used by layers 0 and 3 only, it lives on rank 0 alone, and nothing is summed."""
    three = layers([0.1] * 4, params=[3e9, 1e9, 1e9, 1e9], shared=((0, (2, 3), 2e9),))
    inputs = CostInputs(three, flat(2, "10GB/s"), "zbv", 4, chunks=2)
    assert tied_allreduce_s(inputs, one_layer_per_stage(4)) == pytest.approx([0.0, 0.0, 0.2, 0.2], rel=REL)
    two = layers([0.1] * 4, params=[3e9, 1e9, 1e9, 1e9], shared=((0, (3,), 2e9),))
    assert tied_allreduce_s(dataclasses.replace(inputs, arrays=two), one_layer_per_stage(4)) == [0.0] * 4


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_transfers_bound_a_stage_when_slower_than_compute(schedule: str) -> None:
    # 2 GB cut over 1 GB/s at sigma 1: 2 s each way, compute 0.5 s per stage
    arrays = layers([0.5, 0.5], fwd=[0.125, 0.125], cuts=[2e9, 0.0])
    inputs = CostInputs(arrays, flat(2, "1GB/s"), schedule, 3)
    costs = stage_costs(inputs, one_layer_per_stage(2))
    assert costs[0].comm_in_s == 0.0 and costs[0].comm_out_s == pytest.approx(2.0, rel=REL)
    assert costs[1].comm_in_s == pytest.approx(2.0, rel=REL) and costs[1].comm_out_s == 0.0
    w = ASSUMED_WEIGHT_SHARE * 0.375 if schedule in SPLIT_BACKWARD_SCHEDULES else 0.0  # the trip leaves the W's out
    expected = 2.0 if schedule == "pipedream" else 1.0 - 2 * w + 2 * 2.0 + w
    assert objective_s(inputs, one_layer_per_stage(2)) == pytest.approx(expected, rel=REL)


def test_transfers_are_divided_among_replicas() -> None:
    arrays = layers([0.5, 0.5], fwd=[0.125, 0.125], cuts=[2e9, 0.0])
    inputs = CostInputs(arrays, flat(4, "1GB/s"), "pipedream", 3)
    # stage 1 has 2 replicas: max(0.5, 2 s in) / 2 = 1 s; stage 0 is bound by its 2 s transfer out
    assert objective_s(inputs, [(0, 1, 1, False), (1, 2, 2, False)]) == pytest.approx(2.0, rel=REL)
    assert objective_s(inputs, [(0, 1, 2, False), (1, 2, 2, False)]) == pytest.approx(1.0, rel=REL)


# ---- memory -------------------------------------------------------------------------------


def two_stage_memory(schedule: str, recompute: bool = False, scale: float = 1.0) -> list[float]:
    """Memory per device of [(0,1) x2, (1,2) x3] on 6 devices, m = 8, Adam (k = 2). The first stage keeps its
    microbatch of the batch (input 1e8, copied to the device) besides its 5e8 saved: 6e8 held; the second keeps its
    received 3e8 per microbatch besides its 7e8 saved (`received_terms`): 1e9 held. Receive buffers
    (`ahead_terms`, M = ceil(8 / r) microbatches a replica): the first stage's replicas (M = 4) hold
    min(2, M - 1) = 2 gradients of 3e8 posted ahead; the second's (M = 3) min(3, M - n) activations."""
    arrays = layers([0.1, 0.1], fwd=[0.05, 0.05], params=[1e9, 2e9], cuts=[3e8, 0.0], saved=[5e8, 7e8])
    inputs = CostInputs(arrays, flat(6), schedule, 8, scale=scale, input_bytes=1e8, optimizer_copies=2)
    stages = [(0, 1, 2, recompute), (1, 2, 3, recompute)]
    return [cost.memory_bytes for cost in stage_costs(inputs, stages)]


def test_gpipe_memory_keeps_every_microbatch_of_a_replica() -> None:
    # n = ceil(8 / 2) = 4 and ceil(8 / 3) = 3
    first, second = two_stage_memory("gpipe")
    assert first == pytest.approx(4 * 1e9 + 4 * (5e8 + 1e8) + 2 * 3e8, rel=REL)
    assert second == pytest.approx(4 * 2e9 + 3 * (7e8 + 3e8), rel=REL)  # all 3 taken in: none ahead


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv"])
def test_a_devices_library_bytes_are_held_once_per_device_on_top_of_its_stages(schedule: str) -> None:
    """L (CUDA libraries' workspaces) adds to every device's memory once, in the cost model and in the simulated
    timeline, also where a device holds two stages (chunked schedules), and changes no other term."""
    arrays = layers([1.0] * 4, fwd=[0.3] * 4, params=[1e6] * 4, saved=[2e6] * 4, workspace=[1e5] * 4)
    chunks = 2 if schedule in ("interleaved-1f1b", "zbv") else 1
    inputs = CostInputs(arrays, flat(4 // chunks), schedule, 4, chunks=chunks)
    stages = one_layer_per_stage(4)
    with_library = dataclasses.replace(inputs, library_bytes=6.4e7)
    without, held = stage_costs(inputs, stages), stage_costs(with_library, stages)
    assert [cost.memory_bytes for cost in held] == pytest.approx([cost.memory_bytes + 6.4e7 for cost in without],
                                                                 rel=REL)
    assert [dataclasses.replace(cost, memory_bytes=0.0) for cost in held] == \
        [dataclasses.replace(cost, memory_bytes=0.0) for cost in without]
    peaks, plain = simulate_stages(with_library, stages).peak_memory(), simulate_stages(inputs, stages).peak_memory()
    assert list(peaks) == pytest.approx(list(plain + 6.4e7), rel=REL)


def test_1f1b_memory_is_capped_by_devices_from_here() -> None:
    # n = min(ceil(8 / 2), ceil(5 / 2)) = 3 and min(ceil(8 / 3), ceil(3 / 3)) = 1; ahead 2 gradients, and
    # min(3, 3 - 1) = 2 activations
    first, second = two_stage_memory("1f1b")
    assert first == pytest.approx(4 * 1e9 + 3 * (5e8 + 1e8) + 2 * 3e8, rel=REL)
    # the second stage's 3 replicas all-reduce its 2e9 of gradients through a buffer of as many bytes, which is more
    assert second == pytest.approx(4 * 2e9 + max(1 * (7e8 + 3e8) + 2 * 3e8, 2e9), rel=REL)


def test_1f1b_memory_is_capped_by_microbatches() -> None:
    arrays = layers([0.1, 0.1], params=[1e9, 1e9], saved=[5e8, 5e8])
    inputs = CostInputs(arrays, flat(4), "1f1b", 2)
    # first stage: D = 4, n = min(ceil(2/1), ceil(4/1)) = 2
    costs = stage_costs(inputs, [(0, 1, 1, False), (1, 2, 3, False)])
    assert costs[0].memory_bytes == pytest.approx(4e9 + 2 * 5e8, rel=REL)
    assert costs[1].memory_bytes == pytest.approx(4e9 + max(1 * 5e8, 1e9), rel=REL)  # (3 replicas' all-reduce)


def test_a_backwards_workspace_adds_once_on_top_of_the_microbatches_in_flight() -> None:
    # layers' workspace 3e8, 9e8, 1e8: stage [0, 2) holds the larger, 9e8, scaled by sigma = 0.5
    arrays = layers([0.1, 0.1, 0.1], params=[1e9, 1e9, 1e9], saved=[5e8, 5e8, 5e8], workspace=[3e8, 9e8, 1e8])
    inputs = CostInputs(arrays, flat(2), "1f1b", 4, scale=0.5, optimizer_copies=2)
    first, second = stage_costs(inputs, [(0, 2, 1, False), (2, 3, 1, False)])
    # first: n = min(4, 2) = 2 microbatches of 0.5 x 1e9 saved; second: n = 1
    assert first.memory_bytes == pytest.approx(4 * 2e9 + 2 * 0.5 * 1e9 + 0.5 * 9e8, rel=REL)
    assert second.memory_bytes == pytest.approx(4 * 1e9 + 1 * 0.5 * 5e8 + 0.5 * 1e8, rel=REL)
    assert (first.rebuilt_bytes, second.rebuilt_bytes) == pytest.approx((0.5 * 9e8, 0.5 * 1e8), rel=REL)


def test_pipedream_memory_stashes_weight_versions() -> None:
    # n = ceil(5 / 2) = 3 (two stashed versions) and ceil(3 / 3) = 1 (none); ahead as under 1f1b
    first, second = two_stage_memory("pipedream")
    assert first == pytest.approx(4 * 1e9 + 3 * (5e8 + 1e8) + 2 * 1e9 + 2 * 3e8, rel=REL)
    assert second == pytest.approx(4 * 2e9 + 1 * (7e8 + 3e8) + 2 * 3e8, rel=REL)


def test_activations_scale_weights_do_not() -> None:
    first, second = two_stage_memory("gpipe", scale=0.5)
    assert first == pytest.approx(4 * 1e9 + 4 * (2.5e8 + 0.5e8) + 2 * 1.5e8, rel=REL)
    assert second == pytest.approx(4 * 2e9 + max(3 * (3.5e8 + 1.5e8), 2e9), rel=REL)  # (the all-reduce's 2e9)


def test_a_running_b_holds_the_later_layers_whole_kept_gradients_and_a_waiting_microbatch_what_b_did_not_free(
        ) -> None:
    """zb-h1 on 2 devices, 4 microbatches: the last stage (layers 1-2, 1 byte saved each) keeps 10 and 30 of
    gradients for W, and B frees 20 of layer 2's saved bytes once it has run (a loss's log-softmax): a microbatch
    waiting for its W holds 10 + 10 beyond its activations, but a B at layer 1 (holding 40 there) still holds all
    30 of layer 2's: b = 40 + 30 = 70, not 40 + 10. Peak: 2 x 2 held + 20 waiting + max(70, 20) = 94."""
    arrays = dataclasses.replace(layers([1.0] * 3, fwd=[0.3] * 3, saved=[1.0] * 3, workspace=[7.0, 40.0, 25.0]),
                                 deferred_bytes=prefix([5.0, 10.0, 10.0]), kept_bytes=prefix([5.0, 10.0, 30.0]),
                                 input_workspace_bytes=np.array([7.0, 40.0, 25.0]))
    assert list(arrays.kept_workspace_bytes(np.array([1]), np.array([3]))) == [70.0]
    inputs = CostInputs(arrays, flat(2), "zb-h1", 4, optimizer_copies=0)
    plan = [(0, 1, 1, False), (1, 3, 1, False)]
    assert stage_costs(inputs, plan)[1].memory_bytes == pytest.approx(4 + 20 + 70, rel=REL)
    assert list(simulate_stages(inputs, plan).peak_memory())[1] == pytest.approx(4 + 20 + 70, rel=REL)


def test_a_stage_keeps_its_received_inputs_once_and_what_its_layers_save_beyond_them() -> None:
    """Three layers, 1f1b on 3 devices, 4 microbatches, no weights. Layer 0 saves 6, 2 of them the batch (input
    2); layer 1 saves 7, 4 of them its input (cut 4 after layer 0); layer 2 saves 5 of its own, its input (3)
    being saved by layer 1 already (input_saved [2, 4, 0]). The runtime runs a stage on what it received, so a
    stage from layer 1 holds 7 - 4 + its received 4 per microbatch in flight (n = 2); from layer 2 5 + 3 (n = 1);
    layers 1-2, the last stage, 7 + 5 - 4 + 4 (n = 1); the first stage its 6, 2 of them the batch (n = 3).
    Recomputing, a stage holds what enters it per microbatch in flight and rebuilds what its layers save beyond
    that: the first 3 x 2 + 4, the second 2 x 4 + 3. Each also holds receive buffers posted ahead (`ahead_terms`):
    2 gradients of its cut out, and min(3, 4 - n) activations of its cut in: stage 0 2 x 4, stage 1 2 x 4 + 2 x 3,
    stage 2 3 x 3, and layers 1-2 3 x 4."""
    arrays = dataclasses.replace(layers([0.1] * 3, cuts=[4.0, 3.0, 0.0], saved=[6.0, 7.0, 5.0]),
                                 input_saved_bytes=np.array([2.0, 4.0, 0.0]))
    inputs = CostInputs(arrays, flat(3), "1f1b", 4, input_bytes=2.0, optimizer_copies=0)
    three = stage_costs(inputs, one_layer_per_stage(3))
    assert [cost.memory_bytes for cost in three] == pytest.approx(
        [3 * 6 + 2 * 4, 2 * (7 - 4 + 4) + 2 * 4 + 2 * 3, 1 * (5 + 3) + 3 * 3], rel=REL)
    two = stage_costs(inputs, [(0, 1, 1, False), (1, 3, 1, False)])
    assert two[1].memory_bytes == pytest.approx(1 * (7 + 5 - 4 + 4) + 3 * 4, rel=REL)
    assert list(simulate_stages(inputs, one_layer_per_stage(3)).peak_memory()) == pytest.approx(
        [cost.memory_bytes for cost in three], rel=REL)
    recomputing = [(0, 1, 1, True), (1, 2, 1, True), (2, 3, 1, False)]
    assert [cost.memory_bytes for cost in stage_costs(inputs, recomputing)][:2] == pytest.approx(
        [3 * 2 + (6 - 2) + 2 * 4, 2 * 4 + (7 - 4) + 2 * 4 + 2 * 3], rel=REL)

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_the_receive_buffers_the_closed_form_counts_are_the_simulated_ones_on_equal_stages(
        schedule: str, stages: int, m: int) -> None:
    """Equal stages (F 0.25 s, B 0.5 s, 1 MiB messages taking 0.25 s: every time a multiple of a quarter, so a
    gradient arriving as a backward ends does so exactly, and the simulator frees before it allocates), a
    backward's workspace 2 MiB: the closed form's receive buffers (`ahead_terms`) give the simulated peak of every
    stage under gpipe and 1f1b; under zb-h1 it is within one message of it on every stage (from 4 microbatches the
    first stage's whole backward outlasts the next stage's B, and one more gradient arrives meanwhile)."""
    cut = float(2**20)
    arrays = layers([0.75] * stages, fwd=[0.25] * stages, saved=[1.0] * stages, cuts=[cut] * stages,
                    workspace=[2 * cut] * stages)
    inputs = CostInputs(arrays, flat(stages, "4MiB/s"), schedule, m, optimizer_copies=0)
    plan = one_layer_per_stage(stages)
    closed = [cost.memory_bytes for cost in stage_costs(inputs, plan)]
    simulated = list(simulate_stages(inputs, plan).peak_memory())
    if schedule == "zb-h1":
        assert all(abs(c - s) <= cut * (1 + 1e-6) for c, s in zip(closed, simulated))
    else:
        assert closed == pytest.approx(simulated, rel=REL)
    if m >= 4 and schedule == "1f1b":  # the last stage holds its microbatch's input, the next one and two posted
        base = dataclasses.replace(inputs, arrays=dataclasses.replace(arrays, cut_bytes=np.zeros(stages)))
        assert closed[-1] - stage_costs(base, plan)[-1].memory_bytes == pytest.approx((1 + 3) * cut, rel=REL)


def test_recompute_keeps_stage_inputs_plus_one_rebuilt_microbatch() -> None:
    # gpipe n = 4, 3; the first stage keeps the model input (1e8), the second its 3e8 cut
    first, second = two_stage_memory("gpipe", recompute=True)
    assert first == pytest.approx(4 * 1e9 + 4 * 1e8 + 5e8 + 2 * 3e8, rel=REL)  # (2 gradients ahead)
    assert second == pytest.approx(4 * 2e9 + max(3 * 3e8 + 7e8, 2e9), rel=REL)  # (the all-reduce's 2e9)
    first, second = two_stage_memory("gpipe", recompute=True, scale=0.5)
    assert first == pytest.approx(4 * 1e9 + max(4 * 0.5e8 + 2.5e8 + 2 * 1.5e8, 1e9), rel=REL)  # (its all-reduce's)
    assert second == pytest.approx(4 * 2e9 + max(3 * 1.5e8 + 3.5e8, 2e9), rel=REL)


def test_a_replicated_stage_holds_its_all_reduce_buffer_once_its_activations_are_gone() -> None:
    """A stage of 1 GB of weights and 1e8 of activations a microbatch, gpipe, 2 microbatches, SGD (k = 1), no step
    scratch: on one device 3e9 + 2e8; on 2 replicas the all-reduce copies the 1 GB of gradients into one buffer,
    held besides them after the backwards, when nothing else is (`reduce_terms`): 3e9 + 1e9, in the closed form and
    in the simulated timeline alike (which holds it with the optimizer step's scratch, during the step: it needs a
    step of some time)."""
    arrays = layers([0.1], params=[1e9], saved=[1e8])
    inputs = CostInputs(arrays, flat(2), "gpipe", 2, optimizer_copies=1, step_s_per_byte=1e-12)
    alone, replicated = stage_costs(inputs, [(0, 1, 1, False)])[0], stage_costs(inputs, [(0, 1, 2, False)])[0]
    assert alone.memory_bytes == pytest.approx(3e9 + 2 * 1e8, rel=REL)
    assert replicated.memory_bytes == pytest.approx(3e9 + 1e9, rel=REL) and replicated.scratch_bytes == 1e9
    assert list(simulate_stages(inputs, [(0, 1, 2, False)]).peak_memory()) == pytest.approx([4e9], rel=REL)
    assert list(reduce_terms(np.array([1, 2, 4]), np.array([5.0, 5.0, 6.0]))) == [0.0, 5.0, 6.0]


def test_a_tied_weight_all_reduced_across_stages_holds_its_buffer_at_the_step() -> None:
    """An embedding of 1e9 bytes shared by layers 0 and 2 (as GPT-2's input embedding and output head), 1e8 of
    activations a microbatch, SGD without state (k = 0): a stage holding one of its users but not the other
    all-reduces its gradient with the other's before the step through a buffer of its bytes, held besides the
    gradients (`reduce_terms`); a stage holding both users, or neither, all-reduces nothing. The largest tie counts:
    each goes through its own buffer, one after the other."""
    arrays = layers([0.1] * 3, params=[1e9, 1e6, 0.0], saved=[1e8] * 3, shared=((0, (2,), 1e9),))
    inputs = CostInputs(arrays, flat(2), "gpipe", 2, optimizer_copies=0, step_s_per_byte=1e-12)
    first, last = stage_costs(inputs, [(0, 1, 1, False), (1, 3, 1, False)])
    assert first.memory_bytes == pytest.approx(2 * 1e9 + 1e9, rel=REL)  # weights and gradients, then the buffer
    assert last.memory_bytes == pytest.approx(2 * (1e6 + 1e9) + 1e9, rel=REL)  # its copy of the tie, and its buffer
    assert list(simulate_stages(inputs, [(0, 1, 1, False), (1, 3, 1, False)]).peak_memory()) == \
        pytest.approx([3e9, 2 * (1e6 + 1e9) + 1e9], rel=REL)
    (whole,) = stage_costs(inputs, [(0, 3, 1, False)])
    assert whole.memory_bytes == pytest.approx(2 * (1e9 + 1e6) + 2 * 3e8, rel=REL)  # the tie inside: no buffer
    assert list(reduce_terms(np.array([1, 2]), np.array([5.0, 5.0]), np.array([7.0, 3.0]))) == [7.0, 5.0]


def test_sgd_keeps_one_optimizer_copy() -> None:
    arrays = layers([0.1], params=[1e9], saved=[1e8])
    inputs = CostInputs(arrays, flat(1), "gpipe", 2, optimizer_copies=1)
    assert stage_costs(inputs, [(0, 1, 1, False)])[0].memory_bytes == pytest.approx(3e9 + 2e8, rel=REL)


def test_plan_fits_at_exactly_the_peak_memory() -> None:
    arrays = layers([0.1, 0.1], params=[1e9, 2e9], saved=[5e8, 7e8])
    stages = one_layer_per_stage(2)
    peak = 4 * 2e9 + 1 * 7e8  # 1f1b m = 4: first n = min(4, 2) = 2 -> 5e9; second n = 1 -> 8.7e9
    assert plan_fits(CostInputs(arrays, flat(2), "1f1b", 4, memory_bytes=peak), stages)
    assert not plan_fits(CostInputs(arrays, flat(2), "1f1b", 4, memory_bytes=peak * (1 - 1e-9)), stages)
    assert plan_fits(CostInputs(arrays, flat(2), "1f1b", 4, memory_bytes=None), stages)


# ---- placement ----------------------------------------------------------------------------


def test_placement_rule_on_two_nodes() -> None:
    cluster = two_nodes_of_four()
    assert not placement_ok(cluster, 2, 4)  # ranks 2-5: part of node 0 and part of node 1
    assert not placement_ok(cluster, 3, 2)  # ranks 3-4
    assert not placement_ok(cluster, 2, 6)
    assert placement_ok(cluster, 0, 8)  # both whole nodes
    assert placement_ok(cluster, 4, 4)  # node 1 whole
    assert placement_ok(cluster, 1, 3)  # inside node 0
    assert placement_ok(cluster, 5, 2)  # inside node 1
    assert placement_ok(cluster, 7, 1)


def test_placement_of_two_ints_is_the_element_wise_rules() -> None:
    """The scalar path (plain ints, no arrays) gives what the arrays give, on clusters of 2, 2 and 3 nodes."""
    for cluster in (two_nodes_of_four(), make_cluster(16, gpus_per_node=8), make_cluster(12, gpus_per_node=4)):
        firsts, counts = np.meshgrid(np.arange(cluster.num_devices), np.arange(1, cluster.num_devices + 1))
        expected = placement_ok(cluster, firsts.ravel(), counts.ravel())
        assert [bool(placement_ok(cluster, int(first), int(count)))
                for first, count in zip(firsts.ravel(), counts.ravel())] == expected.tolist()


def test_placement_on_a_flat_cluster_is_always_ok() -> None:
    cluster = flat(6)
    assert all(placement_ok(cluster, first, r) for first in range(6) for r in range(1, 7 - first))


def test_flat_plan_using_fewer_devices_starts_at_rank_zero() -> None:
    arrays = layers([0.1, 0.1, 0.1])
    inputs = CostInputs(arrays, flat(8), "gpipe", 2)
    assert first_ranks(inputs, [(0, 1, 1, False), (1, 2, 2, False), (2, 3, 1, False)]) == [0, 1, 3]
    assert first_ranks(inputs, [(0, 3, 1, False)]) == [0]


def test_two_level_plan_is_right_aligned_then_shifted_by_whole_nodes() -> None:
    arrays = layers([0.1] * 5)
    inputs = CostInputs(arrays, two_nodes_of_four(), "gpipe", 2)
    # two devices: ranks 6, 7 shifted by one node to 2, 3
    assert first_ranks(inputs, one_layer_per_stage(2)) == [2, 3]
    # five devices: no whole node to shift by, ranks 3..7
    assert first_ranks(inputs, one_layer_per_stage(5)) == [3, 4, 5, 6, 7]
    # 2 + 4 devices: node 1 whole, the first stage at the end of node 0
    assert first_ranks(inputs, [(0, 1, 2, False), (1, 5, 4, False)]) == [2, 4]


def test_plan_straddling_nodes_does_not_fit() -> None:
    arrays = layers([0.1, 0.1])
    inputs = CostInputs(arrays, two_nodes_of_four(), "gpipe", 2)
    assert not plan_fits(inputs, [(0, 1, 4, False), (1, 2, 2, False)])  # 4 replicas on ranks 2-5
    assert plan_fits(inputs, [(0, 1, 2, False), (1, 2, 4, False)])
    assert plan_fits(inputs, [(0, 1, 4, False), (1, 2, 4, False)])


def test_plan_needing_more_devices_than_the_cluster_does_not_fit() -> None:
    arrays = layers([0.1, 0.1])
    inputs = CostInputs(arrays, flat(3), "1f1b", 2)
    assert first_ranks(inputs, [(0, 1, 2, False), (1, 2, 2, False)])[0] < 0
    assert not plan_fits(inputs, [(0, 1, 2, False), (1, 2, 2, False)])
    assert plan_fits(inputs, [(0, 1, 1, False), (1, 2, 2, False)])
    nodes = CostInputs(arrays, two_nodes_of_four(), "1f1b", 2)
    assert first_ranks(nodes, [(0, 1, 1, False), (1, 2, 8, False)])[0] < 0
    assert not plan_fits(nodes, [(0, 1, 1, False), (1, 2, 8, False)])


def test_boundary_across_nodes_uses_the_slower_bandwidth() -> None:
    # five single-device stages on ranks 3..7: the boundary after stage 0 (rank 3 -> 4) crosses nodes
    cut = 1e9
    arrays = layers([0.01] * 5, cuts=[cut] * 4 + [0.0])
    inputs = CostInputs(arrays, two_nodes_of_four(), "pipedream", 2)
    costs = stage_costs(inputs, one_layer_per_stage(5))
    slow, fast = cut / 10e9, cut / 100e9
    assert costs[0].comm_out_s == pytest.approx(slow, rel=REL)
    assert costs[1].comm_in_s == pytest.approx(slow, rel=REL)
    assert costs[1].comm_out_s == pytest.approx(fast, rel=REL)
    assert costs[4].comm_in_s == pytest.approx(fast, rel=REL)
    assert objective_s(inputs, one_layer_per_stage(5)) == pytest.approx(slow, rel=REL)
    # two stages on ranks 2, 3 (one node): fast both ways
    two = CostInputs(layers([0.01] * 2, cuts=[cut, 0.0]), two_nodes_of_four(), "pipedream", 2)
    assert stage_costs(two, one_layer_per_stage(2))[0].comm_out_s == pytest.approx(fast, rel=REL)


def test_allreduce_across_nodes_uses_the_slower_bandwidth() -> None:
    arrays = layers([0.1], params=[1e9])
    inputs = CostInputs(arrays, two_nodes_of_four(), "gpipe", 1)
    eight = stage_costs(inputs, [(0, 1, 8, False)])[0]
    four = stage_costs(inputs, [(0, 1, 4, False)])[0]
    assert eight.allreduce_s == pytest.approx(2 * 7 / 8 * 1e9 / 10e9, rel=REL)
    assert four.allreduce_s == pytest.approx(2 * 3 / 4 * 1e9 / 100e9, rel=REL)


def test_stage_after_a_whole_node_stage_talks_across_nodes() -> None:
    # [(0,1) x4, (1,2) x4]: ranks 0-3 then 4-7, the boundary 3 -> 4 is between nodes
    cut = 2e9
    arrays = layers([0.01, 0.01], cuts=[cut, 0.0])
    inputs = CostInputs(arrays, two_nodes_of_four(), "gpipe", 1)
    costs = stage_costs(inputs, [(0, 1, 4, False), (1, 2, 4, False)])
    assert costs[0].comm_out_s == pytest.approx(cut / 10e9, rel=REL)
    assert costs[1].comm_in_s == pytest.approx(cut / 10e9, rel=REL)


# ---- latency ------------------------------------------------------------------------------


def test_each_transfer_pays_its_link_latency_once() -> None:
    # 1e8 bytes at 1 GB/s = 0.1 s, plus 2 ms per message; the first stage has no transfer in, the last none out
    arrays = layers([0.5, 0.5], fwd=[0.125, 0.125], cuts=[1e8, 0.0])
    inputs = CostInputs(arrays, make_cluster(2, None, ["1GB/s"], latencies=["2ms"]), "1f1b", 3)
    costs = stage_costs(inputs, one_layer_per_stage(2))
    assert costs[0].comm_in_s == 0.0 and costs[1].comm_out_s == 0.0
    assert costs[0].comm_out_s == pytest.approx(0.002 + 0.1, rel=REL)
    assert costs[1].comm_in_s == pytest.approx(0.002 + 0.1, rel=REL)


def test_ring_allreduce_pays_two_latencies_per_replica_step() -> None:
    # 2 (r - 1) messages of W / r: 2 * 3 * (1e9 / (4 * 1e10) + 1e-3) on 4 replicas
    arrays = layers([0.3], fwd=[0.1], params=[1e9])
    inputs = CostInputs(arrays, make_cluster(4, None, ["10GB/s"], latencies=["1ms"]), "gpipe", 5)
    cost = stage_costs(inputs, [(0, 1, 4, False)])[0]
    assert cost.allreduce_s == pytest.approx(2 * 3 * (1e9 / 4e10 + 1e-3), rel=REL)
    assert stage_costs(inputs, [(0, 1, 1, False)])[0].allreduce_s == 0.0


def test_latency_of_the_level_between_the_two_ranks() -> None:
    # ranks 3 -> 4 cross nodes (1 ms); ranks 4 -> 5 stay inside one (10 us)
    cluster = make_cluster(8, 4, ["100GB/s", "10GB/s"], latencies=["10us", "1ms"])
    inputs = CostInputs(layers([0.01] * 5, cuts=[1e9] * 4 + [0.0]), cluster, "pipedream", 2)
    costs = stage_costs(inputs, one_layer_per_stage(5))
    assert costs[0].comm_out_s == pytest.approx(1e-3 + 1e9 / 10e9, rel=REL)
    assert costs[1].comm_out_s == pytest.approx(1e-5 + 1e9 / 100e9, rel=REL)


# ---- optimizer step -------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_optimizer_step_is_the_stages_weights_times_the_profiled_rate(schedule: str) -> None:
    # 1e9 weight bytes at 2e-11 s per byte: 20 ms per step; one stage, one replica, compute 0.3 s
    arrays = layers([0.3], fwd=[0.1], params=[1e9])
    inputs = CostInputs(arrays, flat(1), schedule, 4, step_s_per_byte=2e-11)
    cost = stage_costs(inputs, [(0, 1, 1, False)])[0]
    assert cost.step_s == pytest.approx(0.02, rel=REL)
    # flush: the step ends the iteration, once; pipedream: after every microbatch
    expected = 4 * 0.3 + 0.02 if schedule in FLUSH_SCHEDULES else 0.3 + 0.02
    assert objective_s(inputs, [(0, 1, 1, False)]) == pytest.approx(expected, rel=REL)


def test_each_stage_steps_its_own_weights_and_a_copy_of_a_shared_one() -> None:
    arrays = layers([0.1, 0.1, 0.1], params=[3e9, 1e9, 1e9], shared=((0, (2,), 2e9),))
    inputs = CostInputs(arrays, flat(2), "1f1b", 2, step_s_per_byte=1e-11)
    first, second = stage_costs(inputs, [(0, 1, 1, False), (1, 3, 1, False)])
    assert first.step_s == pytest.approx(3e9 * 1e-11, rel=REL)
    assert second.step_s == pytest.approx((2e9 + 2e9) * 1e-11, rel=REL)  # its layers and the tied copy


def test_the_optimizer_step_also_pays_per_parameter_tensor_a_tied_copy_included() -> None:
    # layers of 3, 1 and 2 tensors (the last also uses layer 0's tied weight): 20 us per tensor on top of per byte
    arrays = dataclasses.replace(layers([0.1, 0.1, 0.1], params=[3e9, 1e9, 1e9], shared=((0, (2,), 2e9),)),
                                 param_tensors=prefix([3, 1, 2]))
    inputs = CostInputs(arrays, flat(2), "1f1b", 2, step_s_per_byte=1e-11, step_s_per_tensor=2e-5)
    first, second = stage_costs(inputs, [(0, 1, 1, False), (1, 3, 1, False)])
    assert first.step_s == pytest.approx(3e9 * 1e-11 + 3 * 2e-5, rel=REL)
    assert second.step_s == pytest.approx(4e9 * 1e-11 + (1 + 2 + 1) * 2e-5, rel=REL)  # + the tied copy


def test_the_profiles_step_splits_into_per_tensor_and_per_byte_rates() -> None:
    profile = dataclasses.replace(load_profile(REPO / "profiles" / "mlp.json"), optimizer_step_ms={"adam": 10.0},
                                  optimizer_step_per_tensor_ms={"adam": 0.5})
    tensors, total = sum(profile.param_tensors), profile.total_param_bytes
    per_byte, _, _, per_tensor, per_call = per_weight_byte(profile, "adam")
    assert per_tensor == pytest.approx(0.5e-3, rel=REL) and per_call == 0.0  # a profile that did not time calls
    assert per_byte == pytest.approx((10.0 - 0.5 * tensors) / 1000.0 / total, rel=REL)
    older = dataclasses.replace(profile, param_tensors=())  # before tensors were counted: all per byte
    assert per_weight_byte(older, "adam")[::3] == pytest.approx((10.0 / 1000.0 / total, 0.0), rel=REL)
    timed = dataclasses.replace(profile, optimizer_step_per_call_ms={"adam": 0.4})  # once per call, off the rest
    per_byte, _, _, per_tensor, per_call = per_weight_byte(timed, "adam")
    assert (per_tensor, per_call) == pytest.approx((0.5e-3, 0.4e-3), rel=REL)
    assert per_byte == pytest.approx((10.0 - 0.4 - 0.5 * tensors) / 1000.0 / total, rel=REL)


def test_each_stage_with_a_tensor_to_step_pays_the_steps_per_call_cost() -> None:
    """A plan of one stage steps in the profile's whole step; two stages pay the call twice: the per-call cost
    (0.4 ms) on top of per tensor and per byte, and none for a stage with no tensor that needs a gradient."""
    arrays = dataclasses.replace(layers([0.1, 0.1, 0.1], params=[3e9, 1e9, 0.0]), param_tensors=prefix([3, 1, 0]))
    inputs = CostInputs(arrays, flat(3), "1f1b", 2, step_s_per_byte=1e-11, step_s_per_tensor=2e-5,
                        step_s_per_call=4e-4)
    (whole,) = stage_costs(inputs, [(0, 3, 1, False)])
    assert whole.step_s == pytest.approx(4e9 * 1e-11 + 4 * 2e-5 + 4e-4, rel=REL)
    first, second, third = stage_costs(inputs, [(0, 1, 1, False), (1, 2, 1, False), (2, 3, 1, False)])
    assert first.step_s == pytest.approx(3e9 * 1e-11 + 3 * 2e-5 + 4e-4, rel=REL)
    assert second.step_s == pytest.approx(1e9 * 1e-11 + 2e-5 + 4e-4, rel=REL)
    assert third.step_s == 0.0
    # one rank holding v = 2 chunks steps them in one optimizer call: each chunk pays half of it
    chunked = dataclasses.replace(inputs, cluster=flat(1), schedule="interleaved-1f1b", chunks=2)
    first, second = stage_costs(chunked, [(0, 1, 1, False), (1, 3, 1, False)])
    assert first.step_s == pytest.approx(3e9 * 1e-11 + 3 * 2e-5 + 2e-4, rel=REL)
    assert second.step_s == pytest.approx(1e9 * 1e-11 + 2e-5 + 2e-4, rel=REL)


def test_the_optimizer_steps_scratch_counts_only_when_it_exceeds_the_activations() -> None:
    # W = 1e9 (Adam: base 4e9); activations 5e8 per microbatch, gpipe n = 2 on one device
    arrays = layers([0.1], params=[1e9], saved=[5e8])
    small = CostInputs(arrays, flat(1), "gpipe", 2, scratch_per_byte=0.5)
    large = CostInputs(arrays, flat(1), "gpipe", 2, scratch_per_byte=1.5)
    assert stage_costs(small, [(0, 1, 1, False)])[0].memory_bytes == pytest.approx(4e9 + 2 * 5e8, rel=REL)
    cost = stage_costs(large, [(0, 1, 1, False)])[0]
    assert cost.scratch_bytes == pytest.approx(1.5e9, rel=REL)
    assert cost.memory_bytes == pytest.approx(4e9 + 1.5e9, rel=REL)  # the step's scratch, not 2 microbatches


def test_a_step_that_runs_one_tensor_at_a_time_holds_scratch_for_the_largest_tensor() -> None:
    """A CPU step (one tensor at a time) holds s' x the stage's largest parameter: two stages of 3e9 and 1e9 bytes
    of weights whose largest tensors are 1e9 and 5e8, s' = 2, hold 2e9 and 1e9 of scratch whatever their totals,
    above their 1e8 of activations."""
    arrays = dataclasses.replace(layers([0.1, 0.1], params=[3e9, 1e9], saved=[1e8, 1e8]),
                                 largest_param_bytes=np.array([1e9, 5e8]))
    inputs = CostInputs(arrays, flat(2), "gpipe", 1, scratch_per_largest=2.0, optimizer_copies=2,
                        step_s_per_byte=1e-12)  # (a step that takes time: the simulated timeline holds its scratch)
    first, second = stage_costs(inputs, one_layer_per_stage(2))
    assert (first.scratch_bytes, second.scratch_bytes) == pytest.approx((2e9, 1e9), rel=REL)
    assert (first.memory_bytes, second.memory_bytes) == pytest.approx((4 * 3e9 + 2e9, 4 * 1e9 + 1e9), rel=REL)
    assert simulate_stages(inputs, one_layer_per_stage(2)).peak_memory().tolist() == pytest.approx(
        [first.memory_bytes, second.memory_bytes], rel=REL)


def test_a_cpu_profile_prices_the_steps_scratch_by_its_largest_tensor_a_gpu_one_by_its_bytes() -> None:
    """The measured scratch over the whole model (4 units), against its largest tensor (2 units) on CPU: s' = 2 and
    nothing per byte; on CUDA (foreach steps) or without the largest tensors, per parameter byte as before."""
    profile = load_profile(REPO / "profiles" / "mlp.json")
    profile = dataclasses.replace(profile, optimizer_scratch_bytes={"adam": 8e6}, device="cpu",
                                  largest_param_bytes=tuple([4e6] + [1e6] * (profile.num_layers - 1)))
    assert scratch_per_largest(profile, "adam") == 2.0 and per_weight_byte(profile, "adam")[1] == 0.0
    for other in (dataclasses.replace(profile, device="cuda:0"), dataclasses.replace(profile, largest_param_bytes=())):
        assert scratch_per_largest(other, "adam") == 0.0
        assert per_weight_byte(other, "adam")[1] == pytest.approx(8e6 / profile.trainable_param_bytes)
    terms = optimizer_terms(profile, "adam")  # CostInputs' fields by name, as partition and plan_simulation give them
    inputs = CostInputs(LayerArrays.from_profile(profile), flat(1), "1f1b", 1, **terms)
    assert (inputs.step_s_per_byte, inputs.scratch_per_byte, inputs.accumulate_s_per_byte, inputs.step_s_per_tensor,
            inputs.step_s_per_call) == per_weight_byte(profile, "adam") and inputs.scratch_per_largest == 2.0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_microbatches_after_a_replicas_first_accumulate_gradients(schedule: str) -> None:
    # W = 1e9 at 1e-11 s per byte: 10 ms per accumulation; compute 0.3 s; 4 microbatches on 2 replicas
    arrays = layers([0.3], fwd=[0.1], params=[1e9])
    inputs = CostInputs(arrays, flat(2), schedule, 4, accumulate_s_per_byte=1e-11)
    cost = stage_costs(inputs, [(0, 1, 2, False)])[0]
    if schedule == "pipedream":  # a step per microbatch: nothing accumulates
        assert cost.accumulate_s == 0.0 and cost.bound_s == pytest.approx((0.3 + 0.1) / 2, rel=REL)  # (t + ar) / r
    else:  # each replica: 2 microbatches, the second accumulates; then the all-reduce of 1e9 bytes at 10 GB/s
        assert cost.accumulate_s == pytest.approx(0.01, rel=REL)
        allreduce = 2 * (2 - 1) * 1e9 / (2 * 1e10)
        assert objective_s(inputs, [(0, 1, 2, False)]) == pytest.approx(0.3 + (0.3 + 0.01) + allreduce, rel=REL)


def test_frozen_weights_are_held_without_gradients_or_optimizer_state() -> None:
    """base = W (2 + k) + F: a stage's weights that need no gradient (F, fine-tuning's frozen backbone) count
    once; a frozen tied weight's copy counts in the other stage too, and only trainable ones are all-reduced."""
    arrays = dataclasses.replace(
        layers([1.0] * 3, params=[1e6, 2e6, 0.0]),
        frozen_bytes=prefix([4e6, 0.0, 5e5]), frozen_shared=((2, (0,), 5e5),))  # layer 2's 5e5 tied with layer 0
    inputs = CostInputs(arrays, flat(2), "gpipe", 1, optimizer_copies=2)
    first, second = stage_costs(inputs, [(0, 2, 1, False), (2, 3, 1, False)])
    assert first.base_bytes == pytest.approx(3e6 * 4 + 4e6 + 5e5, rel=REL)  # the tie's copy: weights only
    assert second.base_bytes == pytest.approx(5e5, rel=REL)
    assert second.step_s == 0.0 and tied_allreduce_s(inputs, [(0, 2, 1, False), (2, 3, 1, False)]) == [0.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(arrays=layer_arrays(), cluster=clusters(), data=st.data())
def test_a_memo_of_stage_costs_shared_by_the_plans_of_a_search_changes_no_cost(
        arrays: LayerArrays, cluster: Cluster, data: st.DataObject) -> None:
    # the plans of a search share stages (same layers, replicas, recompute and place): each is computed once and
    # kept, and every plan's costs (tied all-reduces included, which depend on the whole plan) are as computed alone
    schedule = data.draw(st.sampled_from([name for name in SCHEDULES if name not in CHUNKED_SCHEDULES]))
    inputs = CostInputs(arrays, cluster, schedule, data.draw(st.sampled_from([1, 2, 4])),
                        memory_bytes=data.draw(st.sampled_from([None, 5e8])))
    memo: dict = {}
    for _ in range(3):
        cuts = data.draw(st.sets(st.integers(1, arrays.num_layers), max_size=3)) - {arrays.num_layers}
        bounds = [0, *sorted(cuts), arrays.num_layers]
        replicas = data.draw(st.integers(1, max(1, cluster.num_devices // len(bounds))))
        plan = [Stage(start, stop, replicas, data.draw(st.booleans())) for start, stop in zip(bounds, bounds[1:])]
        # the same plan with its last stage split: the stages before it move one place left, on other ranks,
        # with more devices after them (no cost of theirs may come from the memo of the first)
        last = plan[-1]
        split = plan[:-1] + ([last._replace(stop=last.start + 1), last._replace(start=last.start + 1)]
                             if last.stop - last.start >= 2 else [last])
        for trial in (plan, split):
            assert stage_costs(inputs, trial, memo) == stage_costs(inputs, trial)
            assert plan_fits(inputs, trial, memo) == plan_fits(inputs, trial)
    assert memo


def test_a_memo_keeps_a_stage_apart_from_the_same_layers_elsewhere_in_the_pipeline() -> None:
    # 1f1b, 4 microbatches: layer 0 first of two stages holds 2 microbatches' activations, first of three 3
    inputs = CostInputs(layers([0.01] * 4, saved=[1e8] * 4), flat(4), "1f1b", 4)
    memo: dict = {}
    two = [Stage(0, 1, 1, False), Stage(1, 4, 1, False)]
    three = [Stage(0, 1, 1, False), Stage(1, 2, 1, False), Stage(2, 4, 1, False)]
    first_of_two, first_of_three = stage_costs(inputs, two, memo)[0], stage_costs(inputs, three, memo)[0]
    assert first_of_three.memory_bytes - first_of_two.memory_bytes == pytest.approx(1e8)  # one microbatch more
    assert first_of_three == stage_costs(inputs, three)[0] and len(memo) == 5
