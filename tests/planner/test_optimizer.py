"""The optimizer against brute force on small random inputs, and on the real PipeDream profiles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costmodel import LayerArrays, pipedream_bottleneck_s
from planner.optimizer import brute_force_pipedream, optimize_pipedream

PIPEDREAM_DIR = Path(__file__).resolve().parents[3] / "shared" / "pipedream-profiles"


@st.composite
def layer_arrays(draw: st.DrawFn) -> LayerArrays:
    """2-6 layers with times 1-100 ms, parameters 0-400 MB and cuts 0-400 MB (often 0)."""
    n = draw(st.integers(2, 6))
    compute = draw(st.lists(st.floats(0.001, 0.1), min_size=n, max_size=n))
    params = draw(st.lists(st.sampled_from([0.0, 1e6, 5e7, 2e8, 4e8]), min_size=n, max_size=n))
    cuts = draw(st.lists(st.sampled_from([0.0, 1e5, 1e7, 1e8, 4e8]), min_size=n, max_size=n))
    return LayerArrays(
        compute_s=np.concatenate([[0.0], np.cumsum(compute)]),
        param_bytes=np.concatenate([[0.0], np.cumsum(params)]),
        cut_bytes=np.array(cuts[:-1] + [0.0]),
    )


@settings(max_examples=600, deadline=None)
@given(arrays=layer_arrays(), devices=st.integers(1, 5), bandwidth=st.sampled_from([1e9, 1e10, 1e11]),
       straight=st.booleans())
def test_pipedream_objective_matches_brute_force(
    arrays: LayerArrays, devices: int, bandwidth: float, straight: bool
) -> None:
    solution = optimize_pipedream(arrays, devices, bandwidth, straight)
    assert solution.objective_s == pytest.approx(brute_force_pipedream(arrays, devices, bandwidth, straight), rel=1e-9)
    assert solution.devices <= devices
    assert [start for start, _, _ in solution.stages][0] == 0
    assert all(stop == next_start for (_, stop, _), (next_start, _, _) in zip(solution.stages, solution.stages[1:]))
    assert solution.stages[-1][1] == arrays.num_layers
    assert not straight or all(replicas == 1 for _, _, replicas in solution.stages)
    assert pipedream_bottleneck_s(arrays, list(solution.stages), bandwidth) == solution.objective_s


def test_more_devices_than_useful_are_left_unused() -> None:
    # one heavy layer with huge parameters: replicating it costs more in all-reduce than it saves
    arrays = LayerArrays(np.array([0.0, 0.001]), np.array([0.0, 4e9]), np.array([0.0]))
    solution = optimize_pipedream(arrays, devices=8, bandwidth_Bps=1e9)
    assert solution.stages == ((0, 1, 1),) and solution.devices == 1
