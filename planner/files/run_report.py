"""Run reports: a training run's measurements against its plan's predictions, the file type and its readers.

A run report (format "pipeline-planner/run-report", version 1) is built by `runtime.report` at the
end of a training run as a `RunReport` and written with `RunReport.to_dict`; this module reads it
back (no torch): `load_run_report`, `comparison_table` (and `run_report_table` for the terminal),
and `measured_timeline` (the representative step as a `files.timeline.Timeline`, for the plots);
`files.calibration` scales a profile by what a report measured.

Why one module of ~400 lines: the type, its file and the comparison with a plan read the same
fields; a field added to the report (e.g. peak memory) touches all three here, once.

Schema (what `RunReport.to_dict` writes; `runtime.report` says how each figure is measured):

- `plan`: `path` (as given, "" if not), `profile` {name, digest}, `cost_model`, `schedule`,
  `microbatches` (the plan's; None for pipedream), `microbatch_size`, `stages`: per stage
  `layers` [start, stop), `first_layer`, `last_layer`, `replicas`, `ranks`, `recompute`.
- `meta`: as the caller gives it (backend, device, torch version, threads, hosts).
- `measured`: `steps`, `warmup_steps`, `batch_size` (samples per train_step), `microbatches`,
  `microbatch_size` (samples), `step_times_ms`, `train_step_ms`, `iteration_ms`, `samples_per_s`,
  `representative_step`, `memory_method` (how peak memory was measured, "" if not), `ranks`:
  [{rank, stage, replica, hostname}], and `stages`: per stage the fields of `StageMeasurement`
  (ms; `peak_memory_bytes` in bytes).
- `predicted`: the plan's `iteration_ms`, `samples_per_s`, and per stage `compute_ms`, `comm_ms`,
  `allreduce_ms`, `step_ms` and `peak_memory_bytes` (the stage's memory per device).
- `ratios`: measured / predicted for `iteration_ms`, `samples_per_s` and `stages` [{compute_ms, peak_memory_bytes}]
  (None where the prediction is 0); derived from the two sections above, never read back.
- `losses`: [[step, loss], ...].
- `events`: the ops of the representative step, rows in `files.timeline.COLUMNS` order (rank,
  stage, replica, microbatch, iteration, op, peer, start_s, end_s; peer -1 for none), seconds
  from the step's start on the common clock; waits to receive are left out.
- `notes`: sentences for the reader.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rich import box
from rich.table import Table

from planner.errors import FileFormatError, PlannerError
from planner.files.fileformat import read_versioned_json
from planner.files.plan import Plan, StageLayout, layout_fields
from planner.schedules.schedule import BACKWARD, FORWARD, OPS, RECEIVES, SEND_ACTIVATION, SENDS
from planner.files.timeline import BUFFER_COLUMNS, COLUMNS, StageTimes, Timeline, posted_buffers
from planner.units import format_ms, significant

if TYPE_CHECKING:
    import pandas as pd  # imported where used: training ranks load this module to write a report's parts

__all__ = [
    "EVENT_OPS", "IDLE_ROW", "RUN_REPORT_FORMAT", "RUN_REPORT_VERSION", "RankPlacement", "ReportPlanMismatchError",
    "RunReport", "RunReportError", "StageMeasurement", "StagePrediction", "check_report_plan", "comparison_table",
    "load_run_report", "measured_timeline", "ratio", "run_report_from_dict", "run_report_table",
]

RUN_REPORT_FORMAT = "pipeline-planner/run-report"
RUN_REPORT_VERSION = 1
IDLE_ROW = "idle, mean of the devices (share)"  # `comparison_table`'s row of the plan's idle share
EVENT_OPS = tuple(op for op in OPS if op not in RECEIVES)  # a report's events leave out the waits to receive


class RunReportError(PlannerError):
    """A run report cannot be built from these traces, or used as asked."""


class ReportPlanMismatchError(RunReportError):
    """A run report given with a plan other than the one the run used."""

    def __init__(self, report_path: str, plan_path: str, problem: str) -> None:
        self.report_path, self.plan_path, self.problem = report_path, plan_path, problem
        super().__init__(f"{report_path}: measured a run of another plan than {plan_path} ({problem}); "
                         "give the plan the run used")


@dataclass(frozen=True)
class StageMeasurement:
    """What one stage measured, averaged over its replicas and the measured steps (ms).

    Per microbatch: `forward_ms`, `backward_ms` (with a recomputed forward), `compute_ms` (their
    sum), `comm_ms` (the larger of the median transfers into and out of the stage). Per step:
    `send_ms` (its sends, overlapping compute), `recv_wait_ms` (waiting for messages),
    `allreduce_ms` (with tied weights' all-reduce), `step_ms` (the optimizer step), `busy_ms` (compute + all-reduce +
    optimizer), `idle_ms` (step time - busy). `allreduce_each_ms`: per all-reduce;
    `idle_fraction`: idle_ms / mean step time (a share)."""

    forward_ms: float
    backward_ms: float
    compute_ms: float
    comm_ms: float
    send_ms: float
    recv_wait_ms: float
    allreduce_ms: float
    allreduce_each_ms: float
    step_ms: float
    busy_ms: float
    idle_ms: float
    idle_fraction: float
    peak_memory_bytes: float = 0.0  # the most any replica needed in its memory step (0: not measured)


@dataclass(frozen=True)
class StagePrediction:
    """What the plan predicted for one stage (ms): per microbatch compute and transfer; per step the
    all-reduces (the replicas' and the tied weights' before the step; in reports before 2026-11-25,
    one replica all-reduce) and the optimizer step (0 in reports from before it was predicted)."""

    compute_ms: float
    comm_ms: float
    allreduce_ms: float
    step_ms: float = 0.0
    peak_memory_bytes: float = 0.0  # the plan's memory per device of the stage


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank ran: its stage, its replica within the stage, its host."""

    rank: int
    stage: int
    replica: int
    hostname: str


@dataclass(frozen=True, eq=False)
class RunReport:
    """A run report (module docstring): `source` is where it was read from (not written).
    `plan_*` and `plan_stages` describe the plan the run used; `measured` and `predicted` have
    one entry per stage; `events` has the columns of `files.timeline.COLUMNS` (the
    representative step, seconds from its start)."""

    source: str
    plan_path: str
    profile_name: str
    profile_digest: str
    cost_model: str
    schedule: str
    plan_microbatches: int | None
    plan_microbatch_size: int | None
    plan_stages: tuple[StageLayout, ...]
    steps: int
    warmup_steps: int
    batch_size: int
    microbatches: int
    microbatch_size: float
    step_times_ms: tuple[float, ...]
    train_step_ms: float
    iteration_ms: float
    samples_per_s: float | None
    representative_step: int
    ranks: tuple[RankPlacement, ...]
    measured: tuple[StageMeasurement, ...]
    predicted_iteration_ms: float
    predicted_samples_per_s: float
    predicted: tuple[StagePrediction, ...]
    losses: tuple[tuple[int, float], ...]
    events: pd.DataFrame
    notes: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    memory_method: str = ""  # how peak memory was measured (`profiling.memory`); "" when it was not

    @property
    def stage_layers(self) -> tuple[tuple[int, int], ...]:
        """Each plan stage's layers [start, stop)."""
        return tuple((stage.start, stage.stop) for stage in self.plan_stages)

    @property
    def stage_ranks(self) -> tuple[tuple[int, ...], ...]:
        """Each plan stage's ranks."""
        return tuple(stage.ranks for stage in self.plan_stages)

    @property
    def representative_step_ms(self) -> float:
        """The time of the representative step (the one in `events`): the median of `step_times_ms`, of an even
        count the shorter middle one (a step of the run; `train_step_ms`, their median, is the mean of the two)."""
        ordered = sorted(self.step_times_ms)
        return ordered[(len(ordered) - 1) // 2]

    @property
    def representative_step_number(self) -> int:
        """The representative step as the training log counts it: from 1, or from a resumed run's first step."""
        return int(self.meta.get("first_step", 1)) + self.representative_step

    def to_dict(self) -> dict[str, Any]:
        """The file body (module docstring's schema); `run_report_from_dict` reads it back."""
        return {
            "plan": {
                "path": self.plan_path, "profile": {"name": self.profile_name, "digest": self.profile_digest},
                "cost_model": self.cost_model, "schedule": self.schedule, "microbatches": self.plan_microbatches,
                "microbatch_size": self.plan_microbatch_size,
                "stages": [stage.layout_dict() for stage in self.plan_stages],
            },
            "meta": dict(self.meta),
            "measured": {
                "steps": self.steps, "warmup_steps": self.warmup_steps, "batch_size": self.batch_size,
                "microbatches": self.microbatches, "microbatch_size": self.microbatch_size,
                "step_times_ms": list(self.step_times_ms), "train_step_ms": self.train_step_ms,
                "iteration_ms": self.iteration_ms, "samples_per_s": self.samples_per_s,
                "representative_step": self.representative_step, "memory_method": self.memory_method,
                "ranks": [dataclasses.asdict(placement) for placement in self.ranks],
                "stages": [dataclasses.asdict(stage) for stage in self.measured],
            },
            "predicted": {
                "iteration_ms": self.predicted_iteration_ms, "samples_per_s": self.predicted_samples_per_s,
                "stages": [dataclasses.asdict(stage) for stage in self.predicted],
            },
            "ratios": {
                "iteration_ms": ratio(self.iteration_ms, self.predicted_iteration_ms),
                "samples_per_s": ratio(self.samples_per_s, self.predicted_samples_per_s),
                "stages": [{"compute_ms": ratio(found.compute_ms, expected.compute_ms),
                            "peak_memory_bytes": ratio(found.peak_memory_bytes or None, expected.peak_memory_bytes)}
                           for found, expected in zip(self.measured, self.predicted)],
            },
            "losses": [[step, loss] for step, loss in self.losses],
            "events": [[int(r.rank), int(r.stage), int(r.replica), int(r.microbatch), int(r.iteration), str(r.op),
                        int(r.peer), float(r.start_s), float(r.end_s)] for r in self.events.itertuples(index=False)],
            "notes": list(self.notes),
        }


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """measured / predicted, None when either is missing or the prediction is 0."""
    if measured is None or predicted is None or predicted == 0:
        return None
    return measured / predicted


def run_report_from_dict(body: dict[str, Any], source: str = "<dict>") -> RunReport:
    """A RunReport from a report body (`RunReport.to_dict`); FileFormatError naming `source` when
    a field is missing or malformed. `ratios` is not read: it is derived."""
    try:
        plan, measured, predicted = body["plan"], body["measured"], body["predicted"]
        report = RunReport(
            source=source, plan_path=str(plan["path"]), profile_name=str(plan["profile"]["name"]),
            profile_digest=str(plan["profile"]["digest"]), cost_model=str(plan["cost_model"]),
            schedule=str(plan["schedule"]), plan_microbatches=_optional_int(plan["microbatches"]),
            plan_microbatch_size=_optional_int(plan["microbatch_size"]),
            plan_stages=tuple(StageLayout(**layout_fields(s)) for s in plan["stages"]),
            steps=int(measured["steps"]), warmup_steps=int(measured["warmup_steps"]),
            batch_size=int(measured["batch_size"]),
            microbatches=int(measured["microbatches"]), microbatch_size=float(measured["microbatch_size"]),
            step_times_ms=tuple(float(t) for t in measured["step_times_ms"]),
            train_step_ms=float(measured["train_step_ms"]), iteration_ms=float(measured["iteration_ms"]),
            samples_per_s=_optional_float(measured["samples_per_s"]),
            representative_step=int(measured["representative_step"]),
            ranks=tuple(RankPlacement(int(r["rank"]), int(r["stage"]), int(r["replica"]), str(r["hostname"]))
                        for r in measured["ranks"]),
            measured=tuple(_floats(StageMeasurement, s) for s in measured["stages"]),
            predicted_iteration_ms=float(predicted["iteration_ms"]),
            predicted_samples_per_s=float(predicted["samples_per_s"]),
            predicted=tuple(_floats(StagePrediction, s) for s in predicted["stages"]),
            losses=tuple((int(step), float(loss)) for step, loss in body["losses"]),
            events=_events_frame(body["events"]),
            notes=tuple(str(note) for note in body.get("notes", [])), meta=dict(body.get("meta") or {}),
            memory_method=str(measured.get("memory_method", "")),
        )
    except KeyError as exc:
        raise FileFormatError(source, f"run report is missing the field {exc.args[0]!r}",
                              "write it with runtime.report.write_run_report") from None
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise FileFormatError(source, f"run report has a malformed field: {exc}") from None
    stages = len(report.plan_stages)
    if stages == 0 or len(report.measured) != stages or len(report.predicted) != stages:
        raise FileFormatError(source, f"run report has {stages} plan stages, {len(report.measured)} measured and "
                                      f"{len(report.predicted)} predicted; they must be equal and at least 1")
    if report.steps < 1 or report.microbatches < 1 or report.batch_size < 1:
        raise FileFormatError(source, f"run report has steps {report.steps}, microbatches {report.microbatches}, "
                                      f"batch_size {report.batch_size}; each must be at least 1")
    return report


def _floats(kind: Any, values: dict[str, Any]) -> Any:
    """`kind` (a dataclass of floats) from the same-named entries of `values`."""
    return kind(**{f.name: float(values[f.name] if f.name in values or f.default is dataclasses.MISSING else f.default)
                   for f in dataclasses.fields(kind)})


def load_run_report(path: str | Path) -> RunReport:
    """Read a run report file; FileFormatError for other formats, newer versions and bad fields."""
    return run_report_from_dict(read_versioned_json(path, RUN_REPORT_FORMAT, RUN_REPORT_VERSION), str(path))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _events_frame(rows: Any) -> pd.DataFrame:
    """The `events` rows as a DataFrame of COLUMNS; ValueError for rows of another length or op."""
    if not isinstance(rows, list):
        raise ValueError(f"events must be a list of rows, got {type(rows).__name__}")
    parsed = []
    for row in rows:
        if not isinstance(row, list) or len(row) != len(COLUMNS):
            raise ValueError(f"an event row must have the {len(COLUMNS)} values {', '.join(COLUMNS)}, got {row!r}")
        rank, stage, replica, microbatch, iteration, op, peer, start_s, end_s = row
        if op not in EVENT_OPS:
            raise ValueError(f"unknown op {op!r} in events")
        parsed.append((int(rank), int(stage), int(replica), int(microbatch), int(iteration), str(op), int(peer),
                       float(start_s), float(end_s)))
    import pandas as pd

    return pd.DataFrame(parsed, columns=list(COLUMNS))


# ---------------------------------------------------------------- the report against the plan


def check_report_plan(report: RunReport, plan: Plan, plan_path: str = "<plan>") -> None:
    """ReportPlanMismatchError unless `report` measured a run of `plan`: the same profile, schedule,
    stage layers and ranks."""
    layers = tuple((stage.start, stage.stop) for stage in plan.stages)
    ranks = tuple(tuple(stage.ranks) for stage in plan.stages)
    if report.profile_digest != plan.profile.digest:
        problem = f"profile digest {report.profile_digest[:12]}, the plan's {plan.profile.digest[:12]}"
    elif report.schedule != plan.schedule:
        problem = f"schedule {report.schedule}, the plan's {plan.schedule}"
    elif report.stage_layers != layers:
        problem = f"stage layers {_spans(report.stage_layers)}, the plan's {_spans(layers)}"
    elif report.stage_ranks != ranks:
        problem = f"stage ranks {[list(r) for r in report.stage_ranks]}, the plan's {[list(r) for r in ranks]}"
    else:
        return
    raise ReportPlanMismatchError(report.source, plan_path, problem)


def _spans(layers: Sequence[tuple[int, int]]) -> str:
    return " ".join(f"[{start}, {stop})" for start, stop in layers)


def measured_timeline(report: RunReport, stage_times: Sequence[StageTimes], library_bytes: float = 0.0) -> Timeline:
    """The representative measured step as a Timeline (iterations=1), for the plots; `stage_times`
    and `library_bytes` (e.g. the plan's simulation's) give the memory terms that `Timeline.memory` plays out."""
    if len(stage_times) != len(report.stage_layers):
        raise RunReportError(f"{report.source}: {len(report.stage_layers)} stages, but {len(stage_times)} stage "
                             "times were given; pass the simulation of the plan the run used")
    import pandas as pd  # (as at the top)

    events = report.events.copy()
    buffers = pd.DataFrame(_receive_buffers(events, stage_times), columns=list(BUFFER_COLUMNS))
    return Timeline(events, report.schedule, report.microbatches, 1, tuple(stage_times), library_bytes, buffers)


def _receive_buffers(events: pd.DataFrame, stage_times: Sequence[StageTimes]) -> list[tuple]:
    """The receive buffers of a measured step (`timeline.posted_buffers`): each message another rank sent, in the
    order its sender thread sent them (one thread per peer), from its arrival (the send's end) to the start of
    the op that takes it (the receiving stage's forward, or the sending stage's backward before it); the step's
    messages are expected from its start, 0."""
    starts = {(row.rank, row.stage, row.microbatch, row.iteration, row.op): row.start_s
              for row in events[events["op"].isin((FORWARD, BACKWARD))].itertuples(index=False)}
    sends = events[events["op"].isin(SENDS) & (events["peer"] != events["rank"])].sort_values("start_s", kind="stable")
    channels: dict[tuple[int, int], list[tuple[int, int, int, float, float, float]]] = {}
    for row in sends.itertuples(index=False):
        activation = row.op == SEND_ACTIVATION
        stage, op = (row.stage + 1, FORWARD) if activation else (row.stage - 1, BACKWARD)
        taken = starts.get((row.peer, stage, row.microbatch, row.iteration, op))
        if taken is not None:
            size = stage_times[row.stage if activation else stage].activation_bytes
            channels.setdefault((row.rank, row.peer), []).append(
                (row.peer, stage, row.iteration, row.end_s, taken, size))
    return [found for channel in channels.values() for found in posted_buffers(channel, {})]


def comparison_table(report: RunReport, simulated: Timeline | None = None) -> pd.DataFrame:
    """Predicted against measured: rows `iteration (ms)` (pipedream: `time per microbatch (ms)`),
    `samples/s`, `idle, mean of the devices (share)` (the idle share of device time that `planner partition`,
    `show` and `simulate` state: `Timeline.idle_fraction`; measured, the stages' shares weighted by their ranks), then
    per stage `stage i compute (ms/microbatch)`, `stage i comm (ms/microbatch)`,
    `stage i all-reduce (ms/step)` (the replicas' and the tied weights' all-reduces of a step, waits
    included), `stage i step (ms)` (the optimizer step), `stage i peak memory (MB)` (the plan's memory per device against
    the most a replica needed in the step it was measured; NaN when not measured) and `stage i idle (share)`;
    columns `predicted`,
    `measured`, `ratio` (measured / predicted; NaN where the prediction is 0 or missing). The
    predicted idle shares are the simulated ranks' (`Timeline.bubble_fraction`) when
    `simulated` is given, else NaN."""
    import pandas as pd

    timing = "time per microbatch (ms)" if report.schedule == "pipedream" else "iteration (ms)"
    rows: list[tuple[str, float, float]] = [
        (timing, report.predicted_iteration_ms, report.iteration_ms),
        ("samples/s", report.predicted_samples_per_s, _nan(report.samples_per_s)),
        (IDLE_ROW, math.nan if simulated is None else simulated.idle_fraction(), _measured_idle(report)),
    ]
    idle = _simulated_idle(simulated)
    for index, (found, expected) in enumerate(zip(report.measured, report.predicted)):
        rows += [
            (f"stage {index} compute (ms/microbatch)", expected.compute_ms, found.compute_ms),
            (f"stage {index} comm (ms/microbatch)", expected.comm_ms, found.comm_ms),
            (f"stage {index} all-reduce (ms/step)", expected.allreduce_ms, found.allreduce_ms),
            (f"stage {index} step (ms)", expected.step_ms, found.step_ms),
            (f"stage {index} peak memory (MB)", expected.peak_memory_bytes / 1e6,
             found.peak_memory_bytes / 1e6 if found.peak_memory_bytes else math.nan),
            (f"stage {index} idle (share)", idle.get(index, math.nan), found.idle_fraction),
        ]
    table = pd.DataFrame([(p, m) for _, p, m in rows], index=[name for name, _, _ in rows],
                         columns=["predicted", "measured"], dtype=float)
    table["ratio"] = [m / p if p and not math.isnan(p) and not math.isnan(m) else math.nan
                      for p, m in zip(table["predicted"], table["measured"])]
    return table


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _measured_idle(report: RunReport) -> float:
    """The measured idle share of device time: the stages' shares weighted by their ranks (a rank of several
    stages, whose share is the rank's, counts once for each, as every rank does)."""
    weights = [len(stage.ranks) for stage in report.plan_stages]
    if not sum(weights):
        return math.nan
    return sum(weight * found.idle_fraction for weight, found in zip(weights, report.measured)) / sum(weights)


def _simulated_idle(simulated: Timeline | None) -> dict[int, float]:
    """Per stage: the mean idle share of its ranks in the simulation (a rank running several stages, as under
    interleaved-1f1b, counts for each of them)."""
    if simulated is None or not len(simulated.events):
        return {}
    bubbles = simulated.bubble_fraction()
    holders = simulated.events[["rank", "stage"]].drop_duplicates()
    shares = holders.assign(share=holders["rank"].map(bubbles)).groupby("stage")["share"].mean()
    return {int(stage): float(share) for stage, share in shares.items()}


def run_report_table(report: RunReport, simulated: Timeline | None = None) -> Table:
    """`comparison_table` for the terminal: values formatted per unit, ratio as 'x1.23', and a
    caption with the run (steps, batch, microbatches, where it ran) and the report's notes."""
    frame = comparison_table(report, simulated)
    microbatches = f"{report.microbatches} microbatch{'es' if report.microbatches != 1 else ''}"
    table = Table(title=f"{report.profile_name}: measured against predicted ({report.schedule}, {microbatches} of "
                        f"{report.microbatch_size:g} samples, {report.steps} measured step"
                        f"{'s' if report.steps != 1 else ''})",
                  caption=_caption(report), caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("", no_wrap=True)
    for header in ("predicted", "measured", "measured/predicted"):
        table.add_column(header, justify="right", no_wrap=True)
    for name, row in frame.iterrows():
        cell = _share if name.endswith("(share)") else (_rate if name == "samples/s" else _ms)
        ratio = "" if math.isnan(row["ratio"]) else f"x{row['ratio']:.3g}"
        table.add_row(str(name), cell(row["predicted"]), cell(row["measured"]), ratio)
    return table


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else format_ms(value)


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else significant(value, 4)


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def _caption(report: RunReport) -> str:
    lines = [(f"median train step {format_ms(report.train_step_ms)} ms (batch of {report.batch_size}); steps "
              f"{format_ms(min(report.step_times_ms))}-{format_ms(max(report.step_times_ms))} ms; "
              "ratio > 1: slower than predicted (times), faster (samples/s)")]
    meta = report.meta
    labels = {"backend": "backend", "device": "device", "torch_version": "torch", "threads": "threads"}
    where = [f"{label} {meta[key]}" for key, label in labels.items() if meta.get(key)]
    if meta.get("hosts"):
        where.append("hosts " + ", ".join(str(host) for host in meta["hosts"]))
    if where:
        lines.append("ran with " + "; ".join(where))
    return "\n".join(lines + [f"note: {note}" for note in report.notes])
