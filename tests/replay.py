"""A run that went exactly as a simulated timeline, as the traces the runtime would gather: a fixture whose
answers the simulation knows (for the run-report tests)."""

from __future__ import annotations

from planner.files.timeline import Timeline
from runtime.report import RankTrace
from runtime.trace import OpTime


def replay_timeline(timeline: Timeline, steps: int = 3, *, step_gap_s: float = 0.001,
                    clock_offsets_s: dict[int, float] | None = None, hostname: str = "simulated") -> list[RankTrace]:
    """The RankTraces of a run that went exactly as `timeline`, once per train_step: a dry run of
    the report, and a fixture whose answers the simulation knows.

    Step k runs over [k (makespan + step_gap_s), + makespan] on the common clock, every rank's
    span the whole of it; rank r's clock reads common time - clock_offsets_s[r] (default 0).
    """
    offsets = clock_offsets_s or {}
    period = timeline.makespan_s + step_gap_s
    traces = []
    for rank, rows in timeline.events.groupby("rank", sort=True):
        offset = offsets.get(int(rank), 0.0)
        ops = tuple(
            OpTime(step=k, op=str(row.op), iteration=int(row.iteration), microbatch=int(row.microbatch),
                   peer=None if int(row.peer) < 0 else int(row.peer),
                   start_s=k * period + float(row.start_s) - offset, end_s=k * period + float(row.end_s) - offset)
            for k in range(steps) for row in rows.itertuples(index=False)
        )
        spans = tuple((k * period - offset, k * period + timeline.makespan_s - offset) for k in range(steps))
        traces.append(RankTrace(rank=int(rank), stage=int(rows["stage"].iloc[0]), replica=int(rows["replica"].iloc[0]),
                                hostname=hostname, clock_offset_s=offset, ops=ops, step_spans=spans,
                                microbatches=timeline.microbatches, schedule=timeline.schedule))
    return traces
