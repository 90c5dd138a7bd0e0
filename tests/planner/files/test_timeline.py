"""Timeline summaries: the idle share of device time that every command states."""

from __future__ import annotations

import pytest

from planner.files.timeline import StageTimes
from planner.schedules.schedule import build_schedule
from planner.simulation.simulator import simulate_schedule


def test_idle_fraction_is_the_ranks_mean_idle_share() -> None:
    """gpipe, 4 equal stages, 8 microbatches: every rank idles 3 / 11 of the time; with one rank replicated twice
    the ranks (devices) are weighted alike, however many stages they hold."""
    stages = [StageTimes(0.001, 0.002, 0.0, 0.0) for _ in range(4)]
    timeline = simulate_schedule(build_schedule("gpipe", [1] * 4, 8), stages)
    assert timeline.idle_fraction() == pytest.approx(3 / 11)
    replicated = simulate_schedule(build_schedule("1f1b", [1, 2, 1], 4), stages[:3])
    assert replicated.idle_fraction() == pytest.approx(float(replicated.bubble_fraction().mean()))
    assert len(replicated.bubble_fraction()) == 4


def test_idle_fraction_of_a_run_that_takes_no_time_is_zero() -> None:
    timeline = simulate_schedule(build_schedule("gpipe", [1], 1), [StageTimes(0.0, 0.0, 0.0, 0.0)])
    assert timeline.idle_fraction() == 0.0
