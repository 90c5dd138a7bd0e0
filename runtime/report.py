"""Run reports: what the engine measured on every rank, against what the plan predicted (a JSON file).

Every rank keeps `engine.trace` (`runtime.trace.OpTime` per action) and `engine.step_spans`;
`gather_traces` collects them on rank 0 as `RankTrace`s, `build_run_report` (pure) reduces them
to a `planner.files.run_report.RunReport` and `write_run_report` writes it; `planner compare`
and `planner calibrate` read it back.

Common clock: each rank's `perf_counter` times plus its `clock_offset_s` are wall-clock seconds;
the report subtracts rank 0's offset as well (times stay small, so no precision is lost).
A step's time is the job's: latest end minus earliest start of that `train_step` over all
ranks. The first `warmup_steps` steps are left out of every figure, and so are steps without op
timings on some rank (the engine keeps the last `trace_steps`) and ops of a step that did not
finish (no span).

How each figure of the report (`planner.files.run_report` has the schema) is measured:

- `measured.step_times_ms`: each measured step's time, from its first rank's start (or the
  previous step's last end if that is later) to its last rank's end; what the loop does between
  steps is not counted. `train_step_ms` is their median. `iteration_ms` is the quantity the
  plan's `iteration_ms` states: flush schedules, the median step time; pipedream, the median over
  steps of the steady-state time per microbatch, read off the first stage's backwards as
  `files.timeline.Timeline.iteration_s` does. `samples_per_s`: flush, batch_size / iteration;
  pipedream, microbatch_size / iteration. `representative_step`: the step whose time is the
  median (the one in `events`).
- `measured.stages`: each averaged over the stage's replicas and the measured steps. `comm_ms`
  is the larger of the transfers into and out of the stage, each boundary's median over both
  directions (activations one way, gradients the other), each transfer timed in the sender thread
  from its first send to the return of its last. The median, not the mean: on a busy CPU a
  sender thread may resume tens of ms after its message arrived (the receiver's op that needed it
  had long started), which says nothing of the link; `send_ms` is the total per step, timed the
  same way; `allreduce_ms`/`allreduce_each_ms` are each all-reduce's time from the last of its ranks
  entering it (the slowest replica; for the tied weights' all-reduce before the step, the last stage
  holding them): the shortest any of its ranks recorded (`_from_last_arrival`); the wait before counts
  as idle, as in the simulator (pipedream: from the rank's own entry); the prediction per step is the
  plan's `allreduce_ms` per replica all-reduce plus `tied_allreduce_ms` (`_allreduces_per_step`);
  `step_ms` is the optimizer step alone; pipedream's `idle_ms` includes each train_step's fill and drain.
- `measured.stages[i].peak_memory_bytes`: the most any of the stage's ranks needed during its
  `Engine.memory_step` (the second `train_step` with an optimizer, whose state the first created;
  the first without; measuring slows it, so the run's warm-up reaches to it), as
  `planner.profiling.memory.peak_memory_of`
  measures it: the CUDA allocator's peak, or on CPU the live tensor storages its operations create
  and use (received messages from their first use) on top of the stage's weights; allocator
  caching and fragmentation are not in it.
- interleaved-1f1b (a rank runs several stages; `RankTrace.stages`, each op's `OpTime.stage`): forward,
  backward, transfers, sends and receive waits are each stage's own; what the rank does once for all its
  stages is the rank's on each of its stages: the all-reduces (tied weights', summed once per rank) and
  the optimizer step (one optimizer over its stages), each against the plan's sum over the rank's stages
  (`_rank_stages`), busy and idle time (the simulator's idle share is per device too) and peak memory (the
  plan's `memory_bytes` of such a stage is its device's peak, all its stages together). Under every other
  schedule a rank runs one stage, and these are the stage's own.
- `events`: a step starts where the previous one ended on every rank, so when a rank began it
  while another still finished the previous step, its first ops start below 0.
"""

from __future__ import annotations

import os
import socket
import statistics
from collections import defaultdict
import dataclasses
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
import torch.distributed as dist

from planner.files.fileformat import write_versioned_json
from planner.files.plan import Plan, StagePlan
from planner.profiling.conditions import current_conditions
from planner.files.run_report import (
    RUN_REPORT_FORMAT, RUN_REPORT_VERSION, RankPlacement, RunReport, RunReportError, StageMeasurement,
    StagePrediction,
)
from planner.schedules.schedule import (
    ALLREDUCE, BACKWARD, FORWARD, OPS, RECEIVES, SEND_ACTIVATION, SEND_GRADIENT, SENDS, STEP, WEIGHT,
)
from planner.files.timeline import COLUMNS, Timeline
from runtime.trace import OpTime, clock_offset_s

if TYPE_CHECKING:
    import pandas as pd  # imported where used, by rank 0 alone, at the end: not in the start of every rank

__all__ = [
    "RankTrace", "build_run_report", "gather_traces", "rank_trace", "run_meta",
    "save_run_report", "write_run_report",
]



@dataclass(frozen=True)
class RankTrace:
    """What one rank measured: its ops and `train_step` spans (perf_counter seconds on its own
    clock; add `clock_offset_s` for wall-clock seconds), where it ran, and how the engine was set up.
    `stage` is its first stage; `stages` all of them (several under interleaved-1f1b, each op's own in
    `OpTime.stage`)."""

    rank: int
    stage: int
    replica: int
    hostname: str
    clock_offset_s: float
    ops: tuple[OpTime, ...]
    step_spans: tuple[tuple[float, float], ...]
    microbatches: int
    schedule: str
    peak_memory_bytes: int | None = None  # during the engine's memory_step (None: not measured)
    memory_method: str = ""
    stages: tuple[int, ...] = ()  # every stage it ran, lowest first (interleaved-1f1b: several); () = (stage,)

    @property
    def all_stages(self) -> tuple[int, ...]:
        """Every stage the rank ran: `stages`, or `(stage,)` in traces that give only that."""
        return self.stages or (self.stage,)


# ---------------------------------------------------------------- on every rank (collective)


def rank_trace(engine: Any) -> RankTrace:
    """This rank's RankTrace from an engine's `trace`, `step_spans`, `rank`, `stage`, `stages` (if it has
    them), `replica`, `microbatches` and `schedule.name`."""
    return RankTrace(
        rank=int(engine.rank), stage=int(engine.stage), replica=int(engine.replica), hostname=socket.gethostname(),
        stages=tuple(int(stage) for stage in getattr(engine, "stages", (engine.stage,))),
        clock_offset_s=clock_offset_s(), ops=tuple(engine.trace),
        step_spans=tuple((float(start), float(end)) for start, end in engine.step_spans),
        microbatches=int(engine.microbatches), schedule=str(engine.schedule.name),
        **({} if getattr(engine, "peak_memory", None) is None else
           {"peak_memory_bytes": int(engine.peak_memory[0]), "memory_method": str(engine.peak_memory[1])}),
    )


def gather_traces(engine: Any) -> list[RankTrace] | None:
    """Every rank's RankTrace on rank 0, sorted by rank; None on the other ranks. A collective of
    the default process group: every rank must call it."""
    mine = rank_trace(engine)
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    return sorted(gathered, key=lambda trace: trace.rank)


def run_meta(engine: Any, traces: Sequence[RankTrace] = ()) -> dict[str, Any]:
    """What the run ran on: backend, device, torch version, torch threads (of this rank), world
    size, the hosts of `traces`, and this rank's `conditions` (`planner.profiling.conditions`; its processes:
    the ranks on this rank's machine, torchrun's LOCAL_WORLD_SIZE, on a CPU; None on a GPU, as a profile records
    them: each rank has a device of its own)."""
    device = getattr(engine, "device", None)
    on_cpu = device is None or torch.device(device).type == "cpu"
    return {
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": "" if device is None else str(device), "torch_version": torch.__version__,
        "threads": torch.get_num_threads(), "conditions": current_conditions(
            torch.get_num_threads(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if on_cpu else None),
        "world_size": dist.get_world_size() if dist.is_initialized() else len(traces),
        "hosts": sorted({trace.hostname for trace in traces}),
    }


def save_run_report(engine: Any, plan: Plan, path: str | Path, *, batch_size: int,
                    losses: Sequence[tuple[int, float]] = (), warmup_steps: int = 1, plan_path: str = "",
                    meta: dict[str, Any] | None = None) -> Path | None:
    """Gather every rank's trace and losses (each rank passes its own; the last stage has them),
    build the report and write it on rank 0 (returns its path; None on the other ranks).
    A collective: every rank must call it. `meta` is added to `run_meta`'s."""
    traces = gather_traces(engine)
    every_loss: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object([(int(step), float(loss)) for step, loss in losses], every_loss, dst=0)
    if traces is None or every_loss is None:
        return None
    found = next((found for found in every_loss if found), [])
    body = build_run_report(plan, traces, batch_size=batch_size, losses=found, warmup_steps=warmup_steps,
                            plan_path=plan_path, meta={**run_meta(engine, traces), **(meta or {})})
    return write_run_report(path, body)


# ---------------------------------------------------------------- the report (pure)


def build_run_report(plan: Plan, traces: Sequence[RankTrace], *, batch_size: int,
                     losses: Sequence[tuple[int, float]], warmup_steps: int = 1, plan_path: str = "",
                     meta: dict[str, Any] | None = None) -> RunReport:
    """The report (module docstring) of a run of `plan` whose ranks measured `traces`, with
    `batch_size` samples per train_step; RunReportError if the traces do not fit the plan."""
    traces = sorted(traces, key=lambda trace: trace.rank)
    microbatches = _check_traces(plan, traces, batch_size, warmup_steps)
    shift = {trace.rank: trace.clock_offset_s - traces[0].clock_offset_s for trace in traces}
    count = len(traces[0].step_spans)
    starts = [min(trace.step_spans[k][0] + shift[trace.rank] for trace in traces) for k in range(count)]
    ends = [max(trace.step_spans[k][1] + shift[trace.rank] for trace in traces) for k in range(count)]
    traced = set.intersection(*({op.step for op in trace.ops if op.step < count} for trace in traces))
    measured_steps = [k for k in range(warmup_steps, count) if k in traced]
    if not measured_steps:
        raise RunReportError(f"none of the {count - warmup_steps} steps after the warm-up has op timings on every "
                             "rank (the engine keeps those of its last trace_steps steps): gather right after training")
    # a step runs from its first start to its last end, but not from before the previous step's last
    # end: the last stage enters step k while the first still finishes step k - 1, and counting that
    # overlap twice made steps read up to 8% long
    origins = [max(starts[k], ends[k - 1]) if k > 0 else starts[k] for k in range(count)]
    step_s = {k: ends[k] - origins[k] for k in measured_steps}
    ops = _ops_by_rank_and_step(traces)
    if plan.schedule != "pipedream":
        ops = _from_last_arrival(plan, ops, {trace.rank: trace.stage for trace in traces})

    def step_events(k: int) -> pd.DataFrame:
        return _events(traces, ops, k, origins[k], shift)

    pipedream = plan.schedule == "pipedream"
    microbatch_size = batch_size / microbatches
    if pipedream:
        per_step = [Timeline(step_events(k), plan.schedule, microbatches, 1, ()).iteration_s() for k in measured_steps]
        iteration_s = statistics.median(per_step)
        samples = microbatch_size / iteration_s if iteration_s > 0 else None
    else:
        iteration_s = statistics.median(step_s.values())
        samples = batch_size / iteration_s if iteration_s > 0 else None
    by_length = sorted(measured_steps, key=lambda k: (step_s[k], k))
    representative = by_length[(len(by_length) - 1) // 2]
    stage_ranks = [[trace.rank for trace in traces if index in trace.all_stages] for index in range(len(plan.stages))]
    boundaries = _boundary_transfer_ms(ops, stage_ranks, measured_steps)
    mean_step_s = statistics.fmean(step_s.values())
    peaks = {trace.rank: trace.peak_memory_bytes for trace in traces}
    stages = [dataclasses.replace(_stage_measurement(ops, ranks, measured_steps, step_s, mean_step_s, boundaries, index),
                                  peak_memory_bytes=float(max((peaks[rank] or 0) for rank in ranks)))
              for index, ranks in enumerate(stage_ranks)]
    methods = sorted({trace.memory_method for trace in traces if trace.peak_memory_bytes is not None})
    predicted = plan.predicted
    return RunReport(
        source="", plan_path=plan_path, profile_name=plan.profile.name, profile_digest=plan.profile.digest,
        cost_model=plan.cost_model, schedule=plan.schedule, plan_microbatches=plan.microbatches,
        plan_microbatch_size=plan.microbatch_size,
        plan_stages=tuple(stage.layout() for stage in plan.stages),
        steps=len(measured_steps), warmup_steps=warmup_steps, batch_size=batch_size, microbatches=microbatches,
        microbatch_size=microbatch_size, step_times_ms=tuple(step_s[k] * 1000.0 for k in measured_steps),
        train_step_ms=statistics.median(step_s.values()) * 1000.0, iteration_ms=iteration_s * 1000.0,
        samples_per_s=samples, representative_step=representative,
        ranks=tuple(RankPlacement(t.rank, t.stage, t.replica, t.hostname) for t in traces),
        measured=tuple(stages), predicted_iteration_ms=predicted.iteration_ms,
        predicted_samples_per_s=predicted.samples_per_s,
        predicted=tuple(StagePrediction(plan.mean_compute_ms(i), s.comm_ms,
                                        sum(_allreduces_per_step(plan, t, microbatches) * t.allreduce_ms
                                            + t.tied_allreduce_ms for t in rank_stages),
                                        sum(t.step_ms for t in rank_stages), float(s.memory_bytes))
                        for i, (s, rank_stages) in enumerate(zip(plan.stages, _rank_stages(plan)))),
        losses=tuple((int(step), float(loss)) for step, loss in losses), events=step_events(representative),
        notes=tuple(_notes(plan, microbatches, microbatch_size, len(measured_steps), count - warmup_steps)),
        meta=dict(meta or {}), memory_method=", ".join(methods),
    )


def write_run_report(path: str | Path, report: RunReport) -> Path:
    """Write `report` as versioned JSON (atomically); returns the path."""
    return write_versioned_json(path, RUN_REPORT_FORMAT, RUN_REPORT_VERSION, report.to_dict())


def _check_traces(plan: Plan, traces: Sequence[RankTrace], batch_size: int, warmup_steps: int) -> int:
    """RunReportError unless the traces are one per rank of the plan, on the plan's stages (all of them
    for a rank of several), with one schedule and step count and more steps than `warmup_steps`;
    returns the microbatches per step."""
    expected: dict[int, tuple[int, ...]] = defaultdict(tuple)
    for index, stage in enumerate(plan.stages):
        for rank in stage.ranks:
            expected[rank] += (index,)
    found = [trace.rank for trace in traces]
    if sorted(found) != sorted(expected):
        raise RunReportError(f"the traces are of ranks {found}, but the plan has ranks {sorted(expected)}: "
                             "gather every rank's trace of a run of this plan")
    for trace in traces:
        if trace.all_stages != expected[trace.rank]:
            raise RunReportError(f"rank {trace.rank} ran {_stages_text(trace.all_stages)}, but the plan puts it on "
                                 f"{_stages_text(expected[trace.rank])}: give the plan the run used")
        if trace.schedule != plan.schedule:
            raise RunReportError(f"rank {trace.rank} ran the {trace.schedule} schedule, the plan is {plan.schedule}: "
                                 "give the plan the run used")
    counts = {trace.rank: len(trace.step_spans) for trace in traces}
    if len(set(counts.values())) != 1:
        raise RunReportError(f"the ranks ran different numbers of train steps {counts}: gather after the same steps")
    microbatches = {trace.rank: trace.microbatches for trace in traces}
    if len(set(microbatches.values())) != 1:
        raise RunReportError(f"the ranks ran different microbatch counts {microbatches}")
    if batch_size < 1:
        raise RunReportError(f"batch_size must be at least 1 sample, got {batch_size}")
    if warmup_steps < 0:
        raise RunReportError(f"warmup_steps must be 0 or more, got {warmup_steps}")
    count = counts[traces[0].rank]
    if count <= warmup_steps:
        raise RunReportError(f"the run has {count} train steps and {warmup_steps} are warm-up: none is left to "
                             "measure; run more steps or pass a smaller warmup_steps")
    for trace in traces:
        for op in trace.ops:
            if op.op not in OPS:
                raise RunReportError(f"rank {trace.rank}: unknown op {op.op!r} in its trace; expected one of "
                                     f"{', '.join(OPS)}")
            if op.step < 0:
                raise RunReportError(f"rank {trace.rank}: an op of step {op.step}; steps count from 0")
            if op.stage >= 0 and op.stage not in trace.all_stages:
                raise RunReportError(f"rank {trace.rank}: an op of stage {op.stage}, but it ran "
                                     f"{_stages_text(trace.all_stages)}")
    return microbatches[traces[0].rank]


def _stages_text(stages: tuple[int, ...]) -> str:
    """'stage 2', or 'stages 0, 2' for a rank of several."""
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"


def _ops_by_rank_and_step(traces: Sequence[RankTrace]) -> dict[tuple[int, int], list[OpTime]]:
    """Each rank's ops, grouped by (rank, step)."""
    grouped: dict[tuple[int, int], list[OpTime]] = defaultdict(list)
    for trace in traces:
        for op in trace.ops:
            grouped[(trace.rank, op.step)].append(op)
    return grouped


def _from_last_arrival(plan: Plan, ops: dict[tuple[int, int], list[OpTime]], rank_stage: dict[int, int]
                       ) -> dict[tuple[int, int], list[OpTime]]:
    """`ops` with each all-reduce starting when the last of its ranks entered it, as the simulator plays
    it: a rank that enters first waits inside the collective for the others, and that wait is idle time,
    not the transfer the plan predicts. The last rank in waits for nobody, so the all-reduce's own time is
    the shortest any of its ranks recorded (on each rank's own clock: no clock skew between hosts enters);
    every rank's then starts that long before its end. Flush schedules run per step one all-reduce per
    replicated stage (of the stage, over its ranks) and, after them, the tied weights' (matched over every
    rank that runs one in the step: one group, as the simulator has it; the engine runs one per tied
    parameter, each over the ranks holding it). An op of stage -1 (older traces) is its rank's `rank_stage`."""
    def kind(rank: int, op: OpTime, seen: set[int]) -> tuple[Any, ...]:
        index = op.stage if op.stage >= 0 else rank_stage[rank]
        stage = plan.stages[index] if 0 <= index < len(plan.stages) else None
        if stage is not None and stage.replicas > 1 and index not in seen and rank in stage.ranks:
            seen.add(index)
            return ("stage", index)
        return ("tied",)

    kinds: dict[tuple[int, int, int], tuple[Any, ...]] = {}  # (rank, step, position) -> its all-reduce
    shortest: dict[tuple[int, tuple[Any, ...]], float] = defaultdict(lambda: float("inf"))  # (step, kind) -> s
    for (rank, step), rank_ops in ops.items():
        seen: set[int] = set()
        for position, op in sorted(enumerate(rank_ops), key=lambda item: item[1].start_s):
            if op.op == ALLREDUCE:
                kinds[(rank, step, position)] = found = kind(rank, op, seen)
                shortest[(step, found)] = min(shortest[(step, found)], op.end_s - op.start_s)
    return {(rank, step): [dataclasses.replace(op, start_s=op.end_s - shortest[(step, kinds[(rank, step, position)])])
                           if op.op == ALLREDUCE else op for position, op in enumerate(rank_ops)]
            for (rank, step), rank_ops in ops.items()}


def _events(traces: Sequence[RankTrace], ops: dict[tuple[int, int], list[OpTime]], step: int, start_s: float,
            shift: dict[int, float]) -> pd.DataFrame:
    """The ops of `step` but receives, in COLUMNS order, seconds from `start_s` on the common clock."""
    rows = []
    for trace in traces:
        offset = shift[trace.rank] - start_s
        for op in ops.get((trace.rank, step), []):
            if op.op in RECEIVES:
                continue
            rows.append((trace.rank, op.stage if op.stage >= 0 else trace.stage, trace.replica, op.microbatch,
                         op.iteration, op.op, -1 if op.peer is None else op.peer, op.start_s + offset,
                         op.end_s + offset))
    import pandas as pd

    events = pd.DataFrame(rows, columns=list(COLUMNS)).sort_values(["start_s", "rank"], kind="stable")
    return events.reset_index(drop=True)


def _rank_stages(plan: Plan) -> list[list[StagePlan]]:
    """Per stage, every stage its ranks run: itself, but under interleaved-1f1b, where a rank steps one
    optimizer over all its stages (and sums their tied gradients) once: what its figures are compared with."""
    return [[other for other in plan.stages if other.ranks == stage.ranks] for stage in plan.stages]


def _allreduces_per_step(plan: Plan, stage: StagePlan, microbatches: int) -> float:
    """How many replica all-reduces each of a stage's ranks runs per train_step: none unreplicated, one
    in a flush schedule, one per microbatch it takes in pipedream (m / r on average)."""
    if stage.replicas <= 1:
        return 0.0
    return microbatches / stage.replicas if plan.schedule == "pipedream" else 1.0


def _durations_ms(ops: dict[tuple[int, int], list[OpTime]], ranks: Iterable[int], steps: Iterable[int],
                  kinds: tuple[str, ...], stage: int | None = None) -> list[float]:
    """Each op of `kinds` on `ranks` in `steps` (of `stage` only, unless None): end - start, ms. An op of
    stage -1 (traces from before ops recorded their stage) is its rank's only stage's."""
    return [(op.end_s - op.start_s) * 1000.0 for rank in ranks for step in steps
            for op in ops.get((rank, step), []) if op.op in kinds and (stage is None or op.stage in (stage, -1))]


def _boundary_transfer_ms(ops: dict[tuple[int, int], list[OpTime]], stage_ranks: list[list[int]],
                          steps: list[int]) -> list[float]:
    """Per boundary b (between stage b and b + 1): the median transfer across it, ms: activations
    sent by stage b and gradients sent by stage b + 1 (0 when none was timed)."""
    medians = []
    for boundary, (below, above) in enumerate(pairwise(stage_ranks)):
        both = (_durations_ms(ops, below, steps, (SEND_ACTIVATION,), boundary)
                + _durations_ms(ops, above, steps, (SEND_GRADIENT,), boundary + 1))
        medians.append(statistics.median(both) if both else 0.0)
    return medians


def _stage_measurement(ops: dict[tuple[int, int], list[OpTime]], ranks: list[int], steps: list[int],
                       step_s: dict[int, float], mean_step_s: float, boundaries: list[float],
                       index: int) -> StageMeasurement:
    """One stage's figures (module docstring): per-microbatch means over every op of the stage on its
    ranks, per-step totals averaged over (rank, step) pairs. What a rank does once for all its stages
    (all-reduces, the optimizer step; busy and idle time) is its ranks' whole, all stages together: the
    same as the stage's own but under interleaved-1f1b."""
    forwards = _durations_ms(ops, ranks, steps, (FORWARD,), index)
    backwards = _durations_ms(ops, ranks, steps, (BACKWARD,), index)
    weights = _durations_ms(ops, ranks, steps, (WEIGHT,), index)  # zero-bubble schedules: a microbatch's W, after its B
    reductions = _durations_ms(ops, ranks, steps, (ALLREDUCE,))
    pairs = [(rank, step) for rank in ranks for step in steps]

    def per_step(kinds: tuple[str, ...], stage: int | None = None) -> float:
        """Mean over (rank, step) of the total ms of `kinds` (of `stage`, unless None: every stage of the rank)."""
        return statistics.fmean(sum(_durations_ms(ops, [rank], [step], kinds, stage)) for rank, step in pairs)

    busy = [sum(_durations_ms(ops, [rank], [step], (FORWARD, BACKWARD, WEIGHT, ALLREDUCE, STEP)))
            for rank, step in pairs]
    idle = statistics.fmean(step_s[step] * 1000.0 - spent for (_, step), spent in zip(pairs, busy))
    forward_ms = statistics.fmean(forwards) if forwards else 0.0
    backward_ms = (statistics.fmean(backwards) if backwards else 0.0) + (statistics.fmean(weights) if weights else 0.0)
    transfer_in = boundaries[index - 1] if index > 0 else 0.0
    transfer_out = boundaries[index] if index < len(boundaries) else 0.0
    return StageMeasurement(
        forward_ms=forward_ms, backward_ms=backward_ms, compute_ms=forward_ms + backward_ms,
        comm_ms=max(transfer_in, transfer_out), send_ms=per_step(SENDS, index), recv_wait_ms=per_step(RECEIVES, index),
        allreduce_ms=per_step((ALLREDUCE,)), allreduce_each_ms=statistics.fmean(reductions) if reductions else 0.0,
        step_ms=per_step((STEP,)), busy_ms=statistics.fmean(busy), idle_ms=idle,
        idle_fraction=idle / (mean_step_s * 1000.0) if mean_step_s > 0 else 0.0,
    )


def _notes(plan: Plan, microbatches: int, microbatch_size: float, measured: int, after_warmup: int) -> list[str]:
    notes = []
    if measured < after_warmup:
        notes.append(f"op timings were kept for {measured} of the {after_warmup} steps after the warm-up (the "
                     "engine's trace_steps): every figure is over those")
    if plan.microbatches is not None and microbatches != plan.microbatches:
        notes.append(f"the run split each mini-batch into {microbatches} microbatches, the plan into "
                     f"{plan.microbatches}: iteration times compare different amounts of work")
    if plan.microbatch_size is not None and abs(microbatch_size - plan.microbatch_size) > 1e-9:
        notes.append(f"the run's microbatches have {microbatch_size:g} samples, the plan's {plan.microbatch_size}: "
                     "per-microbatch times compare different sizes")
    if plan.cost_model == "pipedream":
        notes.append("the pipedream cost model's comm_ms is both directions' transfers shared among the "
                     "replicas; the measured comm_ms is one transfer")
    if plan.schedule == "pipedream":
        notes.append("pipedream: iteration_ms is the steady-state time per microbatch (the first stage's "
                     "backwards in the middle of each step, as the simulator reads it); train_step_ms also "
                     "fills and drains the pipeline")
    return notes

