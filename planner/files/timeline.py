"""Timeline: the ops of a pipeline over time, simulated or measured (one row per op), and its summaries.

`events` columns `COLUMNS`: rank, stage, replica, microbatch, iteration, op (a `schedules.schedule`
op name), peer (the other rank of a transfer, else -1), start_s and end_s (seconds). The simulator
(`simulation.simulator`) and run reports (`files.run_report`) make them; tables and plots read them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from planner.files.fileformat import write_atomically
from planner.schedules.schedule import (
    ALLREDUCE, BACKWARD, FORWARD, SEND_ACTIVATION, SEND_GRADIENT, SPLIT_BACKWARD_SCHEDULES, STEP, WEIGHT,
)

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

COLUMNS = ("rank", "stage", "replica", "microbatch", "iteration", "op", "peer", "start_s", "end_s")
BUFFER_COLUMNS = ("rank", "stage", "start_s", "end_s", "bytes")  # a received message's buffer before it is taken
RECEIVES_AHEAD = 2  # `runtime.p2p.RECEIVES_AHEAD`: receives a receiver thread keeps posted per channel


def posted_buffers(channel: Sequence[tuple[int, int, int, float, float, float]],
                   step_starts: dict[tuple[int, int], float], ahead: int = RECEIVES_AHEAD,
                   ) -> list[tuple[int, int, float, float, float]]:
    """When the messages of one channel (one sender to one receiver, in the order sent) have buffers on their
    receiver, as `runtime.p2p.Links` allocates them: rows (rank, stage, start_s, end_s, bytes) (`BUFFER_COLUMNS`)
    from `channel`'s (rank, stage, iteration, arrival_s, taken_s, bytes), the receiving rank and stage.

    The receiver thread learns of a step's messages when its rank starts the step (`step_starts[(rank, iteration)]`,
    0 where absent), keeps up to `ahead` receives posted (their structures are known from the first step on) and
    waits for them in order: a message's buffer is allocated when its receive is posted, at the latest once the
    message `ahead` before it has arrived, and lives until the op that needs it takes it (`taken_s`)."""
    found: list[tuple[int, int, float, float, float]] = []
    iteration: int | None = None
    t, waiting = 0.0, []  # waiting: the arrivals of the receives posted and not yet waited for, in order
    for rank, stage, step, arrival_s, taken_s, size in channel:
        if step != iteration:  # a new step: its messages are expected from its start on
            iteration = step
            t = max(t, step_starts.get((rank, step), 0.0))
        while len(waiting) >= ahead:  # the thread waits for the oldest posted one to arrive
            t = max(t, waiting.pop(0))
        found.append((rank, stage, t, max(t, taken_s), size))
        waiting.append(arrival_s)
    return found


@dataclass(frozen=True)
class StageTimes:
    """Durations (seconds, per microbatch) and memory (bytes per device) of one stage."""

    forward_s: float
    backward_s: float  # with the recomputed forward when the stage recomputes
    allreduce_s: float
    activation_bytes: float  # sent to the next stage per microbatch (the same size of gradient comes back)
    base_bytes: float = 0.0
    held_bytes: float = 0.0
    rebuilt_bytes: float = 0.0
    step_s: float = 0.0  # one optimizer step (after each all-reduce; pipedream: after every microbatch)
    scratch_bytes: float = 0.0  # held during each optimizer step
    accumulate_s: float = 0.0  # added to each backward after a rank's first of an iteration (flush schedules)
    tied_s: float = 0.0  # all-reduce of tied weights with the other stages holding them, before each step
    weight_s: float = 0.0  # zero-bubble schedules: W, the weight-gradient part (backward_s is then B alone)
    deferred_bytes: float = 0.0  # zero-bubble schedules: kept per microbatch from the end of its B to the end of its W
    weight_rebuilt_bytes: float = 0.0  # zero-bubble schedules: held during a W on top of the above (`stage_times`)


@dataclass(frozen=True)
class Timeline:
    """The simulated ops: `events` has one row per op (columns COLUMNS; sends are the transfers,
    on the sender's rank, `peer` the receiver), plus what the summaries need (`library_bytes`: what
    every device holds beyond its stages' tensors, `Profile.library_bytes`)."""

    events: pd.DataFrame
    schedule: str
    microbatches: int
    iterations: int
    stage_times: tuple[StageTimes, ...]
    library_bytes: float = 0.0
    buffers: pd.DataFrame | None = None  # BUFFER_COLUMNS: receive buffers (`simulator.receive_buffers`); None: none

    @property
    def makespan_s(self) -> float:
        """End of the last op, seconds."""
        return float(self.events["end_s"].max()) if len(self.events) else 0.0

    def iteration_s(self) -> float:
        """Flush schedules: seconds per iteration (makespan / iterations). pipedream: the
        steady-state seconds per microbatch, measured on the first stage's backwards between the
        rounds that end a quarter and three quarters of the way through (a round: as many
        microbatches as the least common multiple of the stages' replicas, after which every
        replica has had its share)."""
        if self.schedule != "pipedream":
            return self.makespan_s / self.iterations
        first = self.events[(self.events["op"] == BACKWARD) & (self.events["stage"] == 0)]
        done = np.maximum.accumulate(first.sort_values("microbatch")["end_s"].to_numpy())
        unit = math.lcm(*(int(part["replica"].max()) + 1 for _, part in self.events.groupby("stage")))
        rounds = len(done) // unit
        low, high = rounds // 4 * unit, (3 * rounds) // 4 * unit
        if low <= 0 or high <= low:
            return self.makespan_s / max(len(done), 1)
        return float((done[high - 1] - done[low - 1]) / (high - low))

    def bubble_fraction(self) -> pd.Series:
        """Per rank: the share of the makespan it spends not computing nor stepping the optimizer
        (nor, in flush schedules, all-reducing; pipedream's all-reduces overlap compute)."""
        working = (FORWARD, BACKWARD, STEP) if self.schedule == "pipedream" else (FORWARD, BACKWARD, WEIGHT, ALLREDUCE, STEP)
        busy = self.events[self.events["op"].isin(working)]
        per_rank = (busy["end_s"] - busy["start_s"]).groupby(busy["rank"]).sum()
        ranks = sorted(self.events["rank"].unique())
        span = self.makespan_s
        if span <= 0:
            import pandas as pd  # imported where used: a training rank loads this module and never uses pandas

            return pd.Series(0.0, index=ranks, name="bubble_fraction")
        return (1.0 - per_rank.reindex(ranks, fill_value=0.0) / span).clip(lower=0.0).rename("bubble_fraction")

    def idle_fraction(self) -> float:
        """The share of device time idle over the run, what every command calls "idle": the ranks' mean
        `bubble_fraction` (each rank one device), 0 for no ops."""
        return max(float(self.bubble_fraction().mean()), 0.0) if len(self.events) else 0.0

    def memory(self) -> pd.DataFrame:
        """Memory per device over time: columns rank, stage (the device's first stage), time_s, bytes (a
        step function: the value holds from time_s until the rank's next row): the device's library bytes
        and the base bytes of every stage it holds (several under a chunked schedule), held bytes from each
        forward to the end of its backward (zero-bubble schedules: of its W, autograd keeps the graph until
        then, and deferred bytes from the end of its B to the end of its W: the gradients W starts from),
        rebuilt bytes during a backward (zero-bubble schedules: during a B, and the weight-rebuilt bytes during
        a W), scratch bytes during each optimizer step, and each receive buffer (`buffers`) from its allocation until
        the op that needs it takes it."""
        import pandas as pd  # (as in `bubble_fraction`)

        compute = self.events[self.events["op"].isin((FORWARD, BACKWARD, WEIGHT, STEP))]
        releasing = WEIGHT if self.schedule in SPLIT_BACKWARD_SCHEDULES else BACKWARD
        term = {name: np.array([getattr(times, name) for times in self.stage_times], dtype=float)
                for name in ("base_bytes", "held_bytes", "rebuilt_bytes", "deferred_bytes", "scratch_bytes",
                             "weight_rebuilt_bytes")}
        rank, stage = compute["rank"].to_numpy(), compute["stage"].to_numpy().astype(int)
        op, start, end = compute["op"].to_numpy(), compute["start_s"].to_numpy(float), compute["end_s"].to_numpy(float)
        forward, step, computing = op == FORWARD, op == STEP, np.isin(op, (BACKWARD, WEIGHT))
        freed = np.where(op == releasing, term["held_bytes"][stage], 0.0)
        if releasing == WEIGHT:  # the deferred gradients live from the end of B to the end of W
            freed += np.where(op == WEIGHT, 1.0, -1.0) * term["deferred_bytes"][stage]
        rebuilt = np.where(op == WEIGHT, term["weight_rebuilt_bytes"][stage], term["rebuilt_bytes"][stage])
        scratch = np.where(step & (term["scratch_bytes"][stage] > 0) & (end > start), term["scratch_bytes"][stage], 0.0)
        at_start = np.where(forward, term["held_bytes"][stage], 0.0) + np.where(computing, rebuilt, 0.0) + scratch
        at_end = np.where(computing, -rebuilt - freed, 0.0) - scratch
        changed_start = forward | computing | (scratch != 0)
        changed_end = computing | (scratch != 0)
        ranks = np.concatenate([rank[changed_start], rank[changed_end]])
        times = np.concatenate([start[changed_start], end[changed_end]])
        deltas = np.concatenate([at_start[changed_start], at_end[changed_end]])
        if self.buffers is not None and len(self.buffers):
            held = self.buffers[self.buffers["end_s"] > self.buffers["start_s"]]
            size = held["bytes"].to_numpy(float)
            ranks = np.concatenate([ranks, held["rank"].to_numpy(), held["rank"].to_numpy()])
            times = np.concatenate([times, held["start_s"].to_numpy(float), held["end_s"].to_numpy(float)])
            deltas = np.concatenate([deltas, size, -size])
        frames = []
        for device in np.unique(rank):
            own = np.unique(stage[rank == device])
            mine = ranks == device
            order = np.lexsort((deltas[mine], times[mine]))  # by time; frees before allocations at one instant
            level = self.library_bytes + float(term["base_bytes"][own].sum())
            frames.append(pd.DataFrame({
                "rank": int(device), "stage": int(own.min()),
                "time_s": np.concatenate([[0.0], times[mine][order]]),
                "bytes": np.cumsum(np.concatenate([[level], deltas[mine][order]])),  # in order, as a running sum
            }))
        if not frames:
            return pd.DataFrame(columns=["rank", "stage", "time_s", "bytes"])
        return pd.concat(frames, ignore_index=True)

    def peak_memory(self) -> pd.Series:
        """Per stage: the most bytes any device holding it holds at once (all its stages together)."""
        per_rank = self.memory().groupby("rank")["bytes"].max()
        holders = self.events[["rank", "stage"]].drop_duplicates()
        peaks = holders.assign(bytes=holders["rank"].map(per_rank)).groupby("stage")["bytes"].max()
        return peaks.rename("peak_bytes").rename_axis("stage")

    def plot(self, communication: bool = False, limit_bytes: float | None = None) -> "Figure":
        """Jupyter: the Gantt chart over the memory per device (`plots.timeline_figure`)."""
        from planner.display.plots import timeline_figure  # plots imports this module

        return timeline_figure(self, communication, limit_bytes)

    def to_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (Perfetto, chrome://tracing): one complete event per op;
        process = rank, thread 0 = compute, 1 = activation sends, 2 = gradient sends, 3 = all-reduces."""
        thread = {SEND_ACTIVATION: 1, SEND_GRADIENT: 2, ALLREDUCE: 3}
        events: list[dict[str, Any]] = []
        for row in self.events.itertuples(index=False):
            label = row.op if row.microbatch < 0 else f"{row.op} {row.microbatch}"
            events.append({
                "name": label, "cat": row.op, "ph": "X", "pid": int(row.rank), "tid": thread.get(row.op, 0),
                "ts": row.start_s * 1e6, "dur": (row.end_s - row.start_s) * 1e6,
                "args": {"stage": int(row.stage), "replica": int(row.replica), "microbatch": int(row.microbatch),
                         "iteration": int(row.iteration), "peer": int(row.peer)},
            })
        names = [{"name": "process_name", "ph": "M", "pid": int(rank), "args": {"name": f"rank {int(rank)}"}}
                 for rank in sorted(self.events["rank"].unique())]
        return {"traceEvents": names + events, "displayTimeUnit": "ms"}

    def write_trace(self, path: str | Path) -> Path:
        """Write `to_trace()` as a JSON file (atomically); returns the path."""
        text = json.dumps(self.to_trace())
        return write_atomically(path, lambda handle: handle.write(text.encode("utf-8")), "e.g. trace.json")
