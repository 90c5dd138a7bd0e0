"""runtime.trace: the clock offset that lines up the ranks' perf_counter clocks in a run report."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from runtime import trace
from runtime.trace import clock_offset_s


def test_a_reading_preempted_between_the_two_clocks_is_not_the_one_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    # perf_counter, time, perf_counter per reading: the first was preempted for 5 ms after time() was read
    perf: Iterator[float] = iter([10.000, 10.005, 20.000, 20.000002, 30.000, 30.004])
    wall: Iterator[float] = iter([1010.000, 1020.000001, 1030.002])
    monkeypatch.setattr(trace.time, "perf_counter", lambda: next(perf))
    monkeypatch.setattr(trace.time, "time", lambda: next(wall))
    assert clock_offset_s(readings=3) == pytest.approx(1020.000001 - 20.000001, abs=1e-9)


def test_the_offset_turns_perf_counter_into_wall_clock_seconds() -> None:
    offset = clock_offset_s()
    assert abs(time.perf_counter() + offset - time.time()) < 0.01
    assert abs(clock_offset_s() - offset) < 0.001
