"""The optimizer against brute force on small random inputs (objective, devices, memory)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.planner.layer_strategies import layer_arrays
from planner.costs.layer_arrays import OPTIMIZER_STATE_COPIES, LayerArrays
from planner.costs.pipedream_cost import pipedream_bottleneck_s, pipedream_stage_memory_bytes, pipedream_stage_value_s
from planner.errors import InfeasiblePlanError
from planner.planning.pipedream_optimizer import optimize_pipedream

Stages = list[tuple[int, int, int]]


def every_plan(num_layers: int, devices: int, straight: bool) -> list[Stages]:
    """Every partition into contiguous stages with every replica assignment using <= devices."""
    plans: list[Stages] = []

    def extend(start: int, left: int, stages: Stages) -> None:
        if start == num_layers:
            plans.append(list(stages))
            return
        for stop in range(start + 1, num_layers + 1):
            for replicas in [1] if straight else range(1, left + 1):
                if replicas <= left:
                    extend(stop, left - replicas, stages + [(start, stop, replicas)])

    extend(0, devices, [])
    return plans


def fits(arrays: LayerArrays, stages: Stages, memory_bytes: float | None, optimizer: str) -> bool:
    """Every stage's memory per device within the limit (downstream devices counted from the plan)."""
    if memory_bytes is None:
        return True
    for index, (start, stop, replicas) in enumerate(stages):
        downstream = sum(r for _, _, r in stages[index + 1:])
        needed = pipedream_stage_memory_bytes(
            arrays.stage_weight_bytes(start, stop), arrays.stage_saved_bytes(start, stop), replicas, downstream,
            OPTIMIZER_STATE_COPIES[optimizer],
        )
        if needed > memory_bytes:
            return False
    return True


def brute_force(arrays: LayerArrays, devices: int, bandwidth: float, straight: bool,
                memory_bytes: float | None, optimizer: str) -> tuple[float, int] | None:
    """(best objective, fewest devices among the optimal plans), or None if nothing fits."""
    scored = []
    for stages in every_plan(arrays.num_layers, devices, straight):
        if fits(arrays, stages, memory_bytes, optimizer):
            value = max(
                pipedream_stage_value_s(
                    float(arrays.compute_s[b] - arrays.compute_s[a]),
                    float(arrays.param_bytes[b] - arrays.param_bytes[a]),
                    arrays.cut_before(a), arrays.cut_after(b), r, bandwidth,
                )
                for a, b, r in stages
            )
            scored.append((value, sum(r for _, _, r in stages)))
    if not scored:
        return None
    optimum = min(value for value, _ in scored)
    # plans within a relative 1e-9 of the optimum tie (floating-point sums); the fewest devices wins
    return optimum, min(used for value, used in scored if value <= optimum * (1 + 1e-9))


@settings(max_examples=400, deadline=None)
@given(arrays=layer_arrays(), devices=st.integers(1, 5), bandwidth=st.sampled_from([1e9, 1e10, 1e11]),
       straight=st.booleans(), memory=st.sampled_from([None, 1e9, 2e9, 4e9]), optimizer=st.sampled_from(["adam", "sgd"]))
def test_pipedream_optimum_matches_brute_force(
    arrays: LayerArrays, devices: int, bandwidth: float, straight: bool, memory: float | None, optimizer: str
) -> None:
    expected = brute_force(arrays, devices, bandwidth, straight, memory, optimizer)
    if expected is None:
        with pytest.raises(InfeasiblePlanError):
            optimize_pipedream(arrays, devices, bandwidth, straight, memory, optimizer)
        return
    solution = optimize_pipedream(arrays, devices, bandwidth, straight, memory, optimizer)
    stages = list(solution.stages)
    assert solution.objective_s == pytest.approx(expected[0], rel=2e-9, abs=1e-15)
    assert solution.devices == expected[1]  # the fewest devices among optimal plans
    assert fits(arrays, stages, memory, optimizer)
    assert stages[0][0] == 0 and stages[-1][1] == arrays.num_layers
    assert all(stop == next_start for (_, stop, _), (next_start, _, _) in zip(stages, stages[1:]))
    assert not straight or all(replicas == 1 for _, _, replicas in stages)
    assert pipedream_bottleneck_s(arrays, stages, bandwidth) == solution.objective_s


def test_more_devices_than_useful_are_left_unused() -> None:
    # one layer with huge parameters: replicating it costs more in all-reduce than it saves
    arrays = LayerArrays(np.array([0.0, 0.001]), np.array([0.0, 4e9]), np.array([0.0]))
    solution = optimize_pipedream(arrays, devices=8, bandwidth_Bps=1e9)
    assert solution.stages == ((0, 1, 1),) and solution.devices == 1


def test_infeasible_memory_names_the_smallest_that_works() -> None:
    # two layers of 1 GB weights each, no activations, Adam: one stage holding both needs
    # 2 GB x (1 + 2) + 1 x 2 GB = 8 GB; two stages need 1 x 3 + 2 x 1 = 5 GB (first) and 4 GB (last)
    arrays = LayerArrays(np.array([0.0, 0.01, 0.02]), np.array([0.0, 1e9, 2e9]), np.array([0.0, 0.0]))
    with pytest.raises(InfeasiblePlanError) as caught:
        optimize_pipedream(arrays, devices=2, bandwidth_Bps=1e10, memory_bytes=4.5e9)
    assert caught.value.smallest_memory_bytes == pytest.approx(5e9, rel=1e-5)
    assert "5 GB" in str(caught.value)
    solution = optimize_pipedream(arrays, devices=2, bandwidth_Bps=1e10, memory_bytes=5e9)
    assert solution.stages == ((0, 1, 1), (1, 2, 1))
