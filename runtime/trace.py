"""What one rank of the engine did and when: an `OpTime` per schedule action, for run reports.

Times are `time.perf_counter()` seconds on the rank's own clock (CLOCK_MONOTONIC on Linux: one
clock for every process of a machine). On a GPU the compute thread's actions are timed by CUDA
events on its stream and placed on that clock (`StepClock`): an action spans its kernels, not their
launches, and a receive or an all-reduce spans the device's wait (from when the kernels before it
finished). `clock_offset_s()` turns them into wall-clock seconds (`time.time()`), to line up ranks
of several machines.

- `forward`, `backward`: the compute thread running the stage (with the recomputed forward of a
  checkpointed stage in `backward`);
- `send_activation`, `send_gradient`: the transfer, timed in the sender thread from its first
  `torch.distributed.send` to the return of its last (the compute thread only queues the value;
  on a GPU, from when the value's kernels are done to when the sends have finished: `runtime.p2p`);
- `recv_activation`, `recv_gradient`: the compute thread waiting for the message (zero long when
  it had already arrived);
- `allreduce`: the replicas' gradient all-reduce, as the compute thread waits for it; and, with
  microbatch -1 before the step, the all-reduce of weights tied across stages;
- `step`: the optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["OpTime", "StepClock", "clock_offset_s"]


@dataclass(frozen=True)
class OpTime:
    """One action of a rank's program: `op` (a `planner.schedules.schedule` op name) during [start_s, end_s].

    `step`: the index of the `train_step` call on this engine (from 0); `iteration` and
    `microbatch` as in the schedule's `Action` (microbatch -1 for `allreduce` and `step`);
    `peer`: the other rank of a send or receive, else None; `stage`: the stage the action belongs to
    (a rank runs several under interleaved-1f1b; -1 in traces made before it was recorded).
    """

    step: int
    op: str
    iteration: int
    microbatch: int
    peer: int | None
    start_s: float
    end_s: float
    stage: int = -1


class StepClock:
    """Marks that time one step's actions, read as `perf_counter` seconds once the step is over.

    On a CPU a mark is `time.perf_counter()`. On a GPU it is a CUDA event recorded on the current
    stream, where the compute thread runs its work: it fires when the kernels launched before it have
    run, and no synchronization between actions stops the host from launching ahead of the device.
    The clock waits for that stream when it is made and records its origin event then, at `origin_s`
    by the host's clock (the stream idle, the event fires at once); `seconds` waits for the stream
    again and places each event at origin_s + its time since the origin
    (`torch.cuda.Event.elapsed_time`, ms). It never waits for the whole device: receives posted on
    NCCL's streams may wait for a peer that waits for this rank's next action.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        if self.device is not None:
            self.stream = torch.cuda.current_stream(self.device)
            self.stream.synchronize()
            self.origin_s = time.perf_counter()
            self.origin = self.mark()

    def mark(self) -> Any:
        """Now, on the host (float seconds) or on the device's current stream (a CUDA event)."""
        if self.device is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """The marks as `perf_counter` seconds (on a GPU, after waiting for the stream to finish)."""
        if self.device is None:
            return list(marks)
        self.stream.synchronize()
        return [self.origin_s + self.origin.elapsed_time(mark) / 1000.0 for mark in marks]


def clock_offset_s(readings: int = 32) -> float:
    """Seconds to add to this process's `time.perf_counter()` to get `time.time()`.

    `time.time()` is read between two `perf_counter()` reads, `readings` times; the reading with the
    shortest bracket wins and the offset is taken at its middle. One pair of reads is off by however
    long the process was preempted between them: milliseconds on a busy machine, which shifted a
    rank's ops by that much in the run report."""
    best_bracket_s, best_offset_s = float("inf"), 0.0
    for _ in range(readings):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        if after - before < best_bracket_s:
            best_bracket_s, best_offset_s = after - before, wall - (before + after) / 2
    return best_offset_s
