"""What one rank of the engine did and when: an `OpTime` per schedule action, for run reports.

Times are `time.perf_counter()` seconds on the rank's own clock (CLOCK_MONOTONIC on Linux: one
clock for every process of a machine). `clock_offset_s()` turns them into wall-clock seconds
(`time.time()`), to line up ranks of several machines.

- `forward`, `backward`: the compute thread running the stage (with the recomputed forward of a
  checkpointed stage in `backward`);
- `send_activation`, `send_gradient`: the transfer, timed in the sender thread from its first
  `torch.distributed.send` to the return of its last (the compute thread only queues the value);
- `recv_activation`, `recv_gradient`: the compute thread waiting for the message (zero long when
  it had already arrived);
- `allreduce`: the replicas' gradient all-reduce, as the compute thread waits for it; and, with
  microbatch -1 before the step, the all-reduce of weights tied across stages;
- `step`: the optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["OpTime", "clock_offset_s"]


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
