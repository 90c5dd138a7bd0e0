"""fit_link and fit_allreduce: latency and bandwidth read back from message and all-reduce times."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import PlannerError
from planner.costs.schedule_cost import allreduce_s
from planner.profiling.links import fit_allreduce, fit_link

SIZES = [4, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24]


@settings(max_examples=50, deadline=None)
@given(latency=st.sampled_from([0.0, 1e-6, 5e-5, 2e-3]), bandwidth=st.sampled_from([1e8, 3e9, 4e11]))
def test_an_exact_line_is_read_back(latency: float, bandwidth: float) -> None:
    times = [latency + size / bandwidth for size in SIZES]
    found_latency, found_bandwidth = fit_link(SIZES, times)
    assert found_latency == pytest.approx(latency, rel=1e-6, abs=1e-12)
    assert found_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_noise_of_a_few_percent_moves_the_fit_by_about_as_much() -> None:
    rng = np.random.default_rng(0)
    times = [(5e-5 + size / 3e9) * (1 + 0.03 * rng.standard_normal()) for size in SIZES]
    latency, bandwidth = fit_link(SIZES, times)
    assert latency == pytest.approx(5e-5, rel=0.1) and bandwidth == pytest.approx(3e9, rel=0.1)


def test_a_negative_intercept_becomes_zero_latency() -> None:
    # small messages faster than the line through the large ones: no latency, bandwidth from all
    latency, bandwidth = fit_link([1e6, 2e6, 4e6], [0.9e-3, 2.0e-3, 4.0e-3])
    assert latency == 0.0 and 0.9e9 < bandwidth < 1.1e9


@pytest.mark.parametrize(("sizes", "times", "fragment"), [
    ([1e6], [1e-3], "two or more"),
    ([1e6, 1e6], [1e-3, 2e-3], "two or more"),
    ([1e3, 1e6], [1e-3, 0.0], "positive"),
    ([1e3, 1e6], [2e-3, 1e-3], "do not grow"),
])
def test_times_that_cannot_give_a_link_are_refused(sizes: list[float], times: list[float], fragment: str) -> None:
    with pytest.raises(PlannerError, match=fragment):
        fit_link(sizes, times)


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_the_ring_formula_is_read_back_from_all_reduce_times(ranks: int) -> None:
    sizes = [4.0, 16384.0, 1048576.0, 16777216.0]
    times = [float(allreduce_s(size, ranks, 1.5e9, 2e-4)) for size in sizes]
    latency, bandwidth = fit_allreduce(sizes, times, ranks)
    assert latency == pytest.approx(2e-4, rel=1e-6) and bandwidth == pytest.approx(1.5e9, rel=1e-6)


def test_an_all_reduce_needs_two_ranks() -> None:
    with pytest.raises(PlannerError, match="over 1 rank"):
        fit_allreduce([4.0, 8.0], [1e-4, 2e-4], 1)
