"""runtime.trace: the clock offset that lines up the ranks' perf_counter clocks in a run report; the step clock."""

from __future__ import annotations

import time
from typing import Iterator

import pytest
import torch

from tests.conftest import gpu_only

from runtime import trace
from runtime.trace import StepClock, clock_offset_s


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


def test_on_a_cpu_a_step_clocks_marks_are_the_hosts_perf_counter() -> None:
    clock = StepClock(torch.device("cpu"))
    before = time.perf_counter()
    marks = [clock.mark(), clock.mark()]
    assert clock.seconds(marks) == marks and before <= marks[0] <= marks[1] <= time.perf_counter()


@gpu_only
def test_on_a_gpu_a_step_clock_times_the_kernels_not_their_launch() -> None:
    """A product of two 4096 x 4096 matrices takes the device milliseconds while its launch returns at once: the
    event marks span the kernels, on the host's clock after the clock was made and before `seconds` returned."""
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=device)
    (a @ a).sum().item()  # cuBLAS ready
    clock = StepClock(device)
    began = time.perf_counter()
    start = clock.mark()
    for _ in range(20):
        a = a @ a / 64.0
    end = clock.mark()
    launched = time.perf_counter()
    start_s, end_s = clock.seconds([start, end])
    assert clock.origin_s <= start_s <= end_s <= time.perf_counter()
    assert end_s - start_s > 2 * (launched - began)  # the kernels outlast their launches
    assert start_s - began < 0.001  # the device was idle: the first mark fired as the host recorded it
