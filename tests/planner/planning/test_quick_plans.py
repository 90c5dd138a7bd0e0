"""Plans made without a search: equal-share cuts, plans within the limit, and a bound no lower than the least."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs.layer_arrays import LayerArrays
from planner.costs.schedule_cost import CostInputs, plan_fits, stage_costs
from planner.files.cluster import make_cluster
from planner.planning.quick_plans import equal_share_cuts, quick_bound, quick_plans
from tests.planner.layer_strategies import layer_arrays
from tests.planner.planning.test_optimizer import CONTIGUOUS, clusters, peaks_and_largest_terms


def test_equal_share_cuts_fall_where_the_running_compute_reaches_each_share() -> None:
    compute_s = np.cumsum([0.0, 1.0, 1.0, 1.0, 1.0, 4.0])  # five layers, the last as heavy as the four before
    assert equal_share_cuts(compute_s, 1) == [0, 5]
    assert equal_share_cuts(compute_s, 2) == [0, 4, 5]  # 4 of 8 after four layers
    assert equal_share_cuts(compute_s, 4) is None  # the last layer holds half: two cuts on one layer
    assert equal_share_cuts(np.cumsum([0.0, 1.0, 1.0]), 3) is None  # more stages than layers


def test_a_stage_that_does_not_fit_recomputes_and_a_plan_that_cannot_fit_is_left_out() -> None:
    """Two layers of 1 s and 200 MB of saved activations each on 2 devices, 4 microbatches under gpipe: a stage of
    one layer holds 4 x 200 MB; at 500 MB only recomputing stages fit (one small input per microbatch, and one
    microbatch's activations rebuilt at a time)."""
    arrays = LayerArrays(compute_s=np.array([0.0, 1.0, 2.0]), param_bytes=np.zeros(3), cut_bytes=np.array([1e3, 0.0]),
                         saved_bytes=np.array([0.0, 2e8, 4e8]), fwd_s=np.array([0.0, 0.3, 0.6]))
    inputs = CostInputs(arrays, make_cluster(2, None, [1e10]), "gpipe", 4, memory_bytes=5e8)
    plans = quick_plans(inputs, straight=True, recompute=True)
    assert plans and all(plan_fits(inputs, plan) for plan in plans)
    assert all(stage[3] for plan in plans for stage in plan)
    assert quick_plans(inputs, straight=True, recompute=False) == []  # without recompute nothing fits
    assert quick_bound(inputs, True, False) == math.inf
    own = [[(0, 1, 1, True), (1, 2, 1, True)]]
    assert own[0] in [[tuple(stage) for stage in plan] for plan in quick_plans(inputs, True, True, own)]


def test_cuts_at_equal_saved_bytes_fit_where_equal_compute_cuts_do_not() -> None:
    """Four layers of 1 s on 2 devices in a line; the first saves 300 MB, the others 100 MB each. Equal compute
    cuts after two layers (400 MB on the first device), equal saved bytes after the first (300 MB on each): at
    350 MB only that plan fits, and the bound is its largest term (the second stage's three layers)."""
    arrays = LayerArrays(compute_s=np.arange(5.0), param_bytes=np.zeros(5), cut_bytes=np.array([1e3, 1e3, 1e3, 0.0]),
                         saved_bytes=np.cumsum([0.0, 3e8, 1e8, 1e8, 1e8]), fwd_s=np.arange(5.0) / 3)
    inputs = CostInputs(arrays, make_cluster(2, None, [1e10]), "gpipe", 1, memory_bytes=3.5e8)
    assert equal_share_cuts(arrays.compute_s, 2) == [0, 2, 4]
    assert not plan_fits(inputs, [(0, 2, 1, False), (2, 4, 1, False)])
    plans = [[tuple(stage) for stage in plan] for plan in quick_plans(inputs, straight=True, recompute=False)]
    assert plans and all(plan == [(0, 1, 1, False), (1, 4, 1, False)] for plan in plans)
    assert quick_bound(inputs, True, False) == max(cost.bound_s for cost in stage_costs(inputs, list(plans[0])))


@settings(max_examples=150, deadline=None)
@given(arrays=layer_arrays(), cluster=clusters(), schedule=st.sampled_from(CONTIGUOUS), microbatches=st.integers(1, 6),
       straight=st.booleans(), recompute=st.booleans(), data=st.data())
def test_quick_plans_fit_and_bound_the_least_largest_term_from_above(
    arrays: LayerArrays, cluster, schedule: str, microbatches: int, straight: bool, recompute: bool,
    data: st.DataObject,
) -> None:
    """Against brute force: every quick plan is a plan of the search (straight where asked, recomputing only where
    allowed) within the limit, so the bound is at least the least max Q(s) of any plan within it; inf only where no
    quick plan fits."""
    inputs = CostInputs(arrays, cluster, schedule, microbatches, 1.0, 1e6, 2, step_s_per_byte=1e-11,
                        scratch_per_byte=1.0, accumulate_s_per_byte=1e-11)
    scored = peaks_and_largest_terms(inputs, straight, recompute)
    limit = data.draw(st.sampled_from(sorted({peak for peak, _ in scored})))
    limited = replace(inputs, memory_bytes=limit)
    largest = [bound for peak, bound in scored if peak <= limit]
    plans = quick_plans(limited, straight, recompute)
    for plan in plans:
        assert plan_fits(limited, plan) and plan[0][0] == 0 and plan[-1][1] == arrays.num_layers
        assert not straight or all(stage[2] == 1 for stage in plan)
        assert recompute or not any(stage[3] for stage in plan)
    bound = quick_bound(limited, straight, recompute)
    assert bound >= min(largest) * (1 - 1e-12)
    assert (bound == math.inf) == (plans == [])
    assert quick_bound(limited, straight, recompute, slack=0.5) == pytest.approx(bound * 1.5)
