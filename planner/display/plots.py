"""Matplotlib figures of plans, simulated and measured timelines and scaling tables (Figure objects; no pyplot).

Why one module of ~450 lines: every figure shares the style (colours per op and stage, units, sizes) and
the axis helpers, so that the pictures read alike.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import to_hex
from matplotlib.figure import Figure, FigureBase
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, NullLocator

from planner.errors import PlannerError
from planner.files.fileformat import write_atomically
from planner.files.plan import Plan
from planner.files.profile import Profile
from planner.files.run_report import RunReport, measured_timeline
from planner.schedules.schedule import ALLREDUCE, BACKWARD, FORWARD, SEND_ACTIVATION, SEND_GRADIENT, STEP, WEIGHT
from planner.files.timeline import Timeline
from planner.units import format_bytes, format_ms, plural, significant

WIDTH_IN = 12.0  # every figure of a plan or timeline is this wide, so they stack into `plan_figure`
PARTITION_HEIGHT_IN = 7.5
MEMORY_HEIGHT_IN = 4.2
MAX_TICK_LABELS = 40  # at most this many layer or rank labels on an axis: every k-th beyond
MAX_NAME_CHARS = 18  # layer names longer than this are cut in the middle with an ellipsis
LABEL_FONT_PT = 7.0  # microbatch numbers on Gantt boxes
LIMIT_COLOR = "tab:red"
OP_COLORS = {
    FORWARD: "#4c72b0", BACKWARD: "#dd8452", WEIGHT: "#ccb974", ALLREDUCE: "#8172b3", STEP: "#222222",
    SEND_ACTIVATION: "#55a868", SEND_GRADIENT: "#c44e52",
}
OP_LABELS = {
    FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradients (W)", ALLREDUCE: "all-reduce",
    STEP: "optimizer step",
    SEND_ACTIVATION: "send activation", SEND_GRADIENT: "send gradient",
}
# Gantt row of one rank, in row units (rank r spans [r, r + 1), top to bottom): compute ops, then
# with communication=True one thin lane per send direction (they use separate channels, so overlap)
_COMPUTE_LANE = (0.08, 0.84)
_COMPUTE_LANE_WITH_SENDS = (0.06, 0.56)
_SEND_LANES = {SEND_ACTIVATION: (0.60, 0.74), SEND_GRADIENT: (0.78, 0.92)}
INLINE_DPI = 80  # resolution of figures shown in Jupyter


# ---------------------------------------------------------------- public figures


class InlineFigure(Figure):
    """A Figure that Jupyter shows as a PNG by itself (no pyplot, no `%matplotlib inline` needed)."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=INLINE_DPI)
        return buffer.getvalue()


def partition_figure(plan: Plan, profile: Profile) -> Figure:
    """The plan's split of the layers: top, each layer's forward + backward time (ms per profiled
    mini-batch) as bars coloured by stage, with the activation bytes crossing each stage boundary;
    bottom, memory per device of each stage (MB or GB, decimal as `--memory` takes) spanning its
    layers, against the device limit (dashed red) when the cluster has one."""
    fig = InlineFigure(figsize=(WIDTH_IN, PARTITION_HEIGHT_IN), layout="constrained")
    _draw_partition(fig, plan, profile)
    return fig


def gantt_figure(timeline: Timeline, communication: bool = False) -> Figure:
    """When each rank computes: one row per rank (rank 0 on top), forward, backward, all-reduce
    boxes and optimizer steps (black ticks) against time in ms; idle time (bubbles) is blank.
    Boxes wide enough carry their microbatch number. With `communication`, each rank's sends
    (activation, gradient) are thin boxes in two lanes under its compute row."""
    fig = InlineFigure(figsize=(WIDTH_IN, _gantt_height(timeline, communication)), layout="constrained")
    _draw_gantt(fig, timeline, communication)
    return fig


def memory_figure(timeline: Timeline, limit_bytes: float | None = None) -> Figure:
    """Memory per device over time (MB or GB against ms) from `timeline.memory()`: one step line per
    stage, drawn for the stage's rank with the highest peak (replicas of a stage hold the same
    amounts, shifted in time); the device limit as a dashed red line when given."""
    fig = InlineFigure(figsize=(WIDTH_IN, MEMORY_HEIGHT_IN), layout="constrained")
    _draw_memory(fig, timeline, limit_bytes)
    return fig


def scaling_figure(table: pd.DataFrame) -> Figure:
    """Predicted throughput (samples/s) against GPU count (log2 axis) from `scaling.scaling_table`:
    the optimized pipeline, pure data parallelism (gaps where it does not fit) and ideal linear
    scaling of one device (dashed). The title names the model when `table.attrs` has `model_name`."""
    fig = InlineFigure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    gpus = table["gpus"].to_numpy(dtype=float)
    pipeline = table["pipeline_samples_per_s"].to_numpy(dtype=float)
    # widest first, the dashed ideal on top, so that lines which coincide all stay visible
    series = (
        ("pipeline_samples_per_s", "planned pipeline", dict(color="tab:blue", marker="o", linewidth=3.5,
                                                            markersize=8)),
        ("data_parallel_samples_per_s", "data parallel", dict(color="tab:orange", marker="s", linewidth=2,
                                                              markersize=5)),
        ("ideal_samples_per_s", "ideal (linear from 1 GPU)", dict(color="0.2", linestyle="--", linewidth=1.2)),
    )
    for column, label, style in series:
        values = table[column].to_numpy(dtype=float)
        if np.isnan(values).any():
            label += " (absent: no plan fits)" if column == "pipeline_samples_per_s" else " (absent: does not fit)"
        ax.plot(gpus, values, label=label, **style)
    if "devices_used" in table:
        used = table["devices_used"].to_numpy(dtype=float)
        for x, y, count in zip(gpus, pipeline, used):
            if not np.isnan(y) and count < x:
                ax.annotate(f"{count:g} used", (x, y), xytext=(0, -14), textcoords="offset points", ha="center",
                            fontsize=8, color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_ylim(bottom=0)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")
    name = table.attrs.get("model_name")
    ax.set_title(f"{name}: predicted throughput" if name else "predicted throughput")
    return fig


def plan_figure(plan: Plan, profile: Profile, timeline: Timeline) -> Figure:
    """The partition, Gantt (without sends) and memory figures of one plan stacked in one image."""
    heights = [PARTITION_HEIGHT_IN, _gantt_height(timeline, False), MEMORY_HEIGHT_IN]
    fig = InlineFigure(figsize=(WIDTH_IN, sum(heights)), layout="constrained")
    top, middle, bottom = fig.subfigures(3, 1, height_ratios=heights)
    _draw_partition(top, plan, profile)
    _draw_gantt(middle, timeline, False)
    _draw_memory(bottom, timeline, plan.cluster.memory_bytes)
    return fig


def schedules_figure(timelines: Sequence[Timeline]) -> Figure:
    """Gantt charts of several timelines (e.g. one plan per schedule) stacked on one time axis, the
    longest setting its span, so that their lengths and bubbles compare at a glance."""
    if not timelines:
        raise PlannerError("schedules_figure needs at least one timeline")
    heights = [_gantt_height(timeline, False) for timeline in timelines]
    fig = InlineFigure(figsize=(WIDTH_IN, sum(heights)), layout="constrained")
    span_ms = max(timeline.makespan_s for timeline in timelines) * 1000.0
    panels = fig.subfigures(len(timelines), 1, height_ratios=heights) if len(timelines) > 1 else [fig]
    for panel, timeline in zip(panels, timelines):
        _draw_gantt(panel, timeline, False, span_ms)
    return fig


def timeline_figure(timeline: Timeline, communication: bool = False, limit_bytes: float | None = None) -> Figure:
    """The Gantt chart (sends too with `communication`) over the memory per device, in one image."""
    heights = [_gantt_height(timeline, communication), MEMORY_HEIGHT_IN]
    fig = InlineFigure(figsize=(WIDTH_IN, sum(heights)), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=heights)
    _draw_gantt(top, timeline, communication)
    _draw_memory(bottom, timeline, limit_bytes)
    return fig


def comparison_figure(simulated: Timeline, report: RunReport, communication: bool = False) -> Figure:
    """The simulated schedule (the plan's `simulate`) above the run's representative step
    (`run_report.measured_timeline`), as Gantt charts on one time axis (ms from the step's start), titled
    "predicted (simulated)" and "measured": the run's iteration as its table states it, and which step is drawn
    (`_measured_title`); sends in lanes of their own with `communication`."""
    measured = measured_timeline(report, simulated.stage_times, simulated.library_bytes)
    heights = [_gantt_height(simulated, communication), _gantt_height(measured, communication)]
    fig = InlineFigure(figsize=(WIDTH_IN, sum(heights)), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=heights)
    span_ms = max(simulated.makespan_s, measured.makespan_s) * 1000.0 or 1.0
    for panel, timeline in ((top, simulated), (bottom, measured)):
        _draw_gantt(panel, timeline, communication, span_ms)
    top.suptitle(f"predicted (simulated): {_timeline_title(simulated)}")
    bottom.suptitle(f"measured: {_measured_title(report, measured)}")
    return fig


IMAGE_FORMATS = ("png", "svg", "pdf")


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` to `path` (its suffix picks png, svg or pdf) atomically; PlannerError for other suffixes."""
    image_format = Path(path).suffix.lstrip(".").lower()
    if image_format not in IMAGE_FORMATS:
        raise PlannerError(f"{path}: cannot write a {Path(path).suffix or 'suffix-less'} image; "
                           f"end the name in {', '.join('.' + name for name in IMAGE_FORMATS)}")
    return write_atomically(path, lambda handle: fig.savefig(handle, format=image_format, dpi=110))


# ---------------------------------------------------------------- drawing into a (sub)figure


def _gantt_height(timeline: Timeline, communication: bool) -> float:
    ranks = timeline.events["rank"].nunique()
    return float(min(max(2.2 + ranks * (0.5 if communication else 0.35), 3.2), 16.0))


def _draw_partition(fig: FigureBase, plan: Plan, profile: Profile) -> None:
    time_ax, memory_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    colors = _stage_colors(len(plan.stages))
    _draw_layer_times(time_ax, plan, profile, colors)
    _draw_stage_memory(memory_ax, plan, colors)
    for stage in plan.stages[:-1]:
        for ax in (time_ax, memory_ax):
            ax.axvline(stage.stop - 0.5, color="0.25", linestyle=":", linewidth=1.2, gid="stage-boundary")
    _layer_ticks(memory_ax, [layer.name for layer in profile.layers])
    memory_ax.set_xlim(-0.6, profile.num_layers - 0.4)
    memory_ax.set_xlabel("layer (execution order)")
    fig.suptitle(_plan_title(plan, profile))


def _draw_layer_times(ax: Axes, plan: Plan, profile: Profile, colors: Sequence[str]) -> None:
    """Bars of fwd + bwd ms per layer in the stage colours; cut bytes labelled at the stage boundaries."""
    for index, stage in enumerate(plan.stages):
        layers = profile.layers[stage.start:stage.stop]
        ax.bar(range(stage.start, stage.stop), [layer.fwd_ms + layer.bwd_ms for layer in layers], width=0.8,
               color=colors[index], label=_stage_label(index, stage.replicas, stage.recompute))
    top = max((layer.fwd_ms + layer.bwd_ms for layer in profile.layers), default=0.0) or 1.0
    ax.set_ylim(0, top * 1.35)  # headroom for the boundary labels
    for stage in plan.stages[:-1]:
        ax.annotate(format_bytes(profile.layers[stage.stop - 1].cut_bytes), (stage.stop - 0.5, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(0, -4), textcoords="offset points",
                    rotation=90, ha="center", va="top", fontsize=8,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="0.6", alpha=0.9))
    batch = f"profiled batch of {profile.batch_size} samples" if profile.batch_size else "profiled mini-batch"
    ax.set_ylabel(f"forward + backward\n(ms per {batch})")
    ax.set_title(f"compute per layer; labels on stage boundaries: activation bytes crossing them per {batch}",
                 fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    if len(plan.stages) > 1:
        handles.append(Line2D([], [], color="0.25", linestyle=":", linewidth=1.2))
        labels.append("stage boundary")
    _outside_legend(ax, handles, labels)


def _draw_stage_memory(ax: Axes, plan: Plan, colors: Sequence[str]) -> None:
    """One bar per stage spanning its layers: memory per device (hatched when it recomputes), and the limit."""
    limit = plan.cluster.memory_bytes
    scale, unit = _memory_unit(max([stage.memory_bytes for stage in plan.stages] + [limit or 0]))
    for index, stage in enumerate(plan.stages):
        ax.bar((stage.start + stage.stop - 1) / 2, stage.memory_bytes / scale, width=stage.stop - stage.start - 0.1,
               color=colors[index], hatch="//" if stage.recompute else None, edgecolor="white", linewidth=0)
    _draw_limit(ax, limit, scale, unit)
    handles, labels = ax.get_legend_handles_labels()
    if any(stage.recompute for stage in plan.stages):
        handles.append(Patch(facecolor="0.6", hatch="//", edgecolor="white"))
        labels.append("recomputes activations")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.set_ylabel(f"memory per device\n({unit})")
    ax.set_title("memory per device of each stage (bar spans its layers)", fontsize=10)
    if handles:
        _outside_legend(ax, handles, labels)


def _draw_gantt(fig: FigureBase, timeline: Timeline, communication: bool, span_ms: float | None = None) -> None:
    """The Gantt chart of `timeline` in `fig`, over [0, span_ms] (default: its makespan)."""
    ax = fig.subplots()
    events = timeline.events
    ranks = sorted(int(rank) for rank in events["rank"].unique())
    row = {rank: position for position, rank in enumerate(ranks)}
    makespan_ms = span_ms or timeline.makespan_s * 1000.0 or 1.0
    compute_lane = _COMPUTE_LANE_WITH_SENDS if communication else _COMPUTE_LANE
    lanes = {FORWARD: compute_lane, BACKWARD: compute_lane, WEIGHT: compute_lane, ALLREDUCE: compute_lane}
    if communication:
        lanes.update(_SEND_LANES)
    # microbatch numbers where every number would fit: one rule for all boxes, so none has a label its twin lacks
    label_chars = len(str(int(events["microbatch"].max()))) if len(events) else 1
    points_per_ms = _axes_width_in(fig) * 72.0 / makespan_ms
    stages_of = _rank_stages(events)
    chunk = {(rank, stage): index for rank, stages in stages_of.items() for index, stage in enumerate(stages)}
    drawn = [op for op, lane in lanes.items()
             if _draw_boxes(ax, events[events["op"] == op], op, lane, row, points_per_ms, label_chars, chunk)]
    steps = events[events["op"] == STEP]
    if len(steps):
        rows = steps["rank"].map(row).to_numpy(dtype=float)
        ax.vlines(steps["start_s"].to_numpy() * 1000.0, rows + compute_lane[0], rows + compute_lane[1],
                  color=OP_COLORS[STEP], linewidth=1.0, gid=STEP)
        drawn.append(STEP)
    ax.set_xlim(0, makespan_ms * 1.01)
    ax.set_ylim(len(ranks), 0)  # rank 0 on top
    shown = ranks[::_tick_step(len(ranks))]
    ax.set_yticks([row[rank] + (compute_lane[0] + compute_lane[1]) / 2 for rank in shown])
    ax.set_yticklabels([_rank_label(rank, stages_of[rank]) for rank in shown])
    ax.set_xlabel("time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    handles = [Line2D([], [], color=OP_COLORS[op], linewidth=1.5) if op == STEP else Patch(facecolor=OP_COLORS[op])
               for op in drawn]
    labels = [OP_LABELS[op] for op in drawn]
    chunks = max((len(stages) for stages in stages_of.values()), default=1)
    if chunks > 1:  # a rank runs several chunks: later ones lighter
        handles += [Patch(facecolor=_lighter(OP_COLORS[FORWARD], index, chunks)) for index in range(chunks)]
        labels += [f"chunk {index} (forward)" for index in range(chunks)]
    _outside_legend(ax, handles, labels)
    fig.suptitle(_timeline_title(timeline))


def _rank_stages(events: pd.DataFrame) -> dict[int, list[int]]:
    """The stages each rank runs in `events`, lowest first (several under a chunked schedule)."""
    return {int(rank): sorted(int(stage) for stage in stages.unique())
            for rank, stages in events.groupby("rank")["stage"]}


def _rank_label(rank: int, stages: Sequence[int]) -> str:
    """'rank 0 (stage 0)', or 'rank 0 (stages 0, 4)' for a rank running several chunks."""
    if len(stages) == 1:
        return f"rank {rank} (stage {stages[0]})"
    return f"rank {rank} (stages {', '.join(str(stage) for stage in stages)})"


def _lighter(color: str, chunk: int, chunks: int) -> str:
    """`color` blended towards white for later chunks: chunk 0 as is, the last 55% white."""
    if chunks <= 1 or chunk == 0:
        return color
    share = 0.55 * chunk / (chunks - 1)
    rgb = np.array(tuple(int(color.lstrip("#")[k:k + 2], 16) for k in (0, 2, 4)), dtype=float) / 255.0
    return to_hex(rgb + (1.0 - rgb) * share)


def _draw_boxes(ax: Axes, events: pd.DataFrame, op: str, lane: tuple[float, float], row: dict[int, int],
                points_per_ms: float, label_chars: int, chunk: dict[tuple[int, int], int]) -> bool:
    """A box per event in its rank's `lane` (ms on x), lighter for a rank's later chunks (`chunk`: (rank,
    stage) -> its index among the rank's stages); forward and backward boxes wide enough for `label_chars`
    digits show their microbatch. Returns whether any box has a duration (worth a legend entry)."""
    chunks = Counter(rank for rank, _ in chunk)
    height = lane[1] - lane[0]
    numbered = op in (FORWARD, BACKWARD, WEIGHT)
    for event in events.itertuples(index=False):
        start_ms, width_ms = event.start_s * 1000.0, (event.end_s - event.start_s) * 1000.0
        bottom = row[int(event.rank)] + lane[0]
        # white edges part neighbouring compute boxes, unless a box is so narrow they would hide it; sends
        # get an edge of their own colour, so that a transfer of microseconds still shows as a line
        if op in _SEND_LANES:
            edge, linewidth = OP_COLORS[op], 0.6
        else:
            edge, linewidth = ("white", 0.4) if width_ms * points_per_ms >= 3.0 else ("none", 0.0)
        rank = int(event.rank)
        face = _lighter(OP_COLORS[op], chunk.get((rank, int(event.stage)), 0), chunks[rank])
        ax.add_patch(Rectangle((start_ms, bottom), width_ms, height, facecolor=face, edgecolor=edge,
                               linewidth=linewidth, gid=op))
        if numbered and width_ms * points_per_ms >= _label_width_pt(label_chars):
            ax.text(start_ms + width_ms / 2, bottom + height / 2, str(event.microbatch), ha="center", va="center",
                    fontsize=LABEL_FONT_PT, color="white", clip_on=True)
    return bool(len(events)) and bool((events["end_s"] > events["start_s"]).any())


def _draw_memory(fig: FigureBase, timeline: Timeline, limit_bytes: float | None) -> None:
    ax = fig.subplots()
    memory = timeline.memory()
    makespan_ms = timeline.makespan_s * 1000.0
    scale, unit = _memory_unit(max(float(memory["bytes"].max()) if len(memory) else 0.0, limit_bytes or 0.0))
    stages = sorted(int(stage) for stage in memory["stage"].unique())
    colors = _stage_colors(max(stages, default=-1) + 1)
    stages_of = _rank_stages(timeline.events)
    for stage in stages:
        rank, times_s, values = _peak_rank_memory(memory, stage)
        # the last level holds until the end of the timeline
        times_ms = np.append(times_s * 1000.0, max(makespan_ms, float(times_s[-1]) * 1000.0))
        label = (f"stage {stage} (rank {rank})" if len(stages_of[rank]) == 1
                 else _rank_label(rank, stages_of[rank]))
        ax.step(times_ms, np.append(values, values[-1]) / scale, where="post", color=colors[stage], linewidth=1.6,
                label=label)
    _draw_limit(ax, limit_bytes, scale, unit)
    ax.set_xlim(0, (makespan_ms or 1.0) * 1.01)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel(f"memory per device ({unit})")
    ax.grid(True, alpha=0.3)
    _outside_legend(ax, *ax.get_legend_handles_labels())
    fig.suptitle(f"memory per device over time ({timeline.schedule} schedule; "
                 "per stage, its rank with the highest peak)")


def _draw_limit(ax: Axes, limit_bytes: float | None, scale: float, unit: str) -> None:
    """The device memory as a labelled dashed red line (nothing when None)."""
    if limit_bytes is not None:
        ax.axhline(limit_bytes / scale, color=LIMIT_COLOR, linestyle="--", linewidth=1.5,
                   label=f"device memory {limit_bytes / scale:.3g} {unit}", gid="memory-limit")


# ---------------------------------------------------------------- shared helpers


def _stage_colors(count: int) -> list[str]:
    """One distinct colour per stage (hex): tab10, tab20 beyond 10 stages, a sampled map beyond 20."""
    if count <= 10:
        cmap, positions = colormaps["tab10"], [index / 10 + 0.05 for index in range(count)]
    elif count <= 20:
        cmap, positions = colormaps["tab20"], [index / 20 + 0.025 for index in range(count)]
    else:
        cmap, positions = colormaps["turbo"], list(np.linspace(0.05, 0.95, count))
    return [to_hex(cmap(position)) for position in positions]


def _memory_unit(largest_bytes: float) -> tuple[float, str]:
    """Divisor and name of the decimal unit (as `--memory` and the plan table use) for an axis up to
    `largest_bytes`: GB from 1 GB, else MB."""
    return (1e9, "GB") if largest_bytes >= 1e9 else (1e6, "MB")


def _tick_step(count: int, most: int = MAX_TICK_LABELS) -> int:
    """Label every k-th of `count` ticks so that at most `most` are labelled."""
    return max(1, math.ceil(count / most))


def _short_names(names: Sequence[str], max_chars: int = MAX_NAME_CHARS) -> list[str]:
    """Layer names for tick labels: the last dotted component (with its parent when it is a number,
    'h.0' not '0'), more components where two would read the same, cut in the middle with an
    ellipsis beyond `max_chars`."""
    parts = [name.split(".") for name in names]
    keep = [2 if len(p) > 1 and p[-1].isdigit() else 1 for p in parts]
    while True:
        short = [".".join(p[-k:]) for p, k in zip(parts, keep)]
        counts = Counter(short)
        clashing = [i for i, text in enumerate(short) if counts[text] > 1 and keep[i] < len(parts[i])]
        if not clashing:
            return [_ellipsize(text, max_chars) for text in short]
        for i in clashing:
            keep[i] += 1


def _peak_rank_memory(memory: pd.DataFrame, stage: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Of `timeline.memory()` rows, the rank of `stage` with the highest peak, its times (s) and bytes."""
    rows = memory[memory["stage"] == stage]
    rank = int(rows.groupby("rank")["bytes"].max().idxmax())
    chosen = rows[rows["rank"] == rank]
    return rank, chosen["time_s"].to_numpy(dtype=float), chosen["bytes"].to_numpy(dtype=float)


def _format_rate(value: float) -> str:
    """A throughput for titles: 72.1, 493.6, 10,442 (no exponents)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _ellipsize(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    head = (max_chars - 1) // 2
    return text[:head] + "…" + text[len(text) - (max_chars - 1 - head):]


def _layer_ticks(ax: Axes, names: Sequence[str]) -> None:
    """Short layer names as rotated tick labels, every k-th when there are many."""
    step = _tick_step(len(names))
    positions = list(range(0, len(names), step))
    labels = _short_names(names)
    ax.set_xticks(positions)
    ax.set_xticklabels([labels[i] for i in positions], rotation=90, fontsize=8)


def _outside_legend(ax: Axes, handles: Sequence[Artist], labels: Sequence[str]) -> None:
    """A legend right of the axes, so it never covers data (constrained layout makes room)."""
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=9,
              ncols=1 if len(labels) <= 16 else 2)


def _axes_width_in(fig: FigureBase) -> float:
    """About how wide a full-width axes of `fig` is, in inches (without rank labels and legend)."""
    return max(fig.get_figure(root=True).get_figwidth() - 3.2, 1.0)


def _label_width_pt(chars: int) -> float:
    """About how wide a box must be, in points, for `chars` digits at LABEL_FONT_PT."""
    return 0.6 * LABEL_FONT_PT * chars + 3.0


def _stage_label(index: int, replicas: int, recompute: bool) -> str:
    return f"stage {index} ({plural(replicas, 'replica')})" + (", recompute" if recompute else "")


def _plan_title(plan: Plan, profile: Profile) -> str:
    """The schedule, what one optimizer step trains (global batch = microbatches x samples each), GPUs, throughput."""
    schedule = plan.schedule
    unit = "samples" if profile.batch_size else "profiled mini-batches"
    if plan.global_batch_size is not None:
        schedule += (f", global batch {plan.global_batch_size} = "
                     f"{plural(plan.microbatches or 1, 'microbatch', 'microbatches')} x {plan.microbatch_size} {unit}")
    elif plan.microbatch_size is not None:  # pipedream: the weights update after every microbatch
        schedule += f", microbatches of {plan.microbatch_size} {unit}"
    return (f"{plan.profile.name}: {schedule}; {plan.predicted.devices_used} of "
            f"{plural(plan.cluster.num_devices, 'GPU')}; "
            f"{_format_rate(plan.predicted.samples_per_s)} samples/s predicted")


def _measured_title(report: RunReport, drawn: Timeline) -> str:
    """The run's iteration (pipedream: time per microbatch) as `run_report.comparison_table` states it, the median of
    its steps, then the step `drawn` (`RunReport.representative_step`): its number, time and idle share."""
    steps = f"the median of {report.steps} steps" if report.steps > 1 else "1 step"
    if report.schedule == "pipedream":
        timing = f"{format_ms(report.iteration_ms)} ms per microbatch in steady state ({steps})"
    else:
        timing = f"{format_ms(report.iteration_ms)} ms per iteration ({steps})"
    over = ", fill and drain included" if report.schedule == "pipedream" else ""
    return (f"{report.schedule} schedule: {timing}; step {report.representative_step_number} drawn: "
            f"{format_ms(report.representative_step_ms)} ms, idle {drawn.idle_fraction():.1%} of device time{over}")


def _timeline_title(timeline: Timeline) -> str:
    iteration_ms = timeline.iteration_s() * 1000.0
    microbatches = plural(timeline.microbatches, "microbatch", "microbatches")
    if timeline.schedule == "pipedream":
        timing = f"{significant(iteration_ms, 4)} ms per microbatch (steady state), {microbatches} shown"
    else:
        count = "" if timeline.iterations == 1 else f" x {timeline.iterations} iterations"
        timing = f"{significant(iteration_ms, 4)} ms per iteration ({microbatches}{count})"
    over = " over the run, fill and drain included" if timeline.schedule == "pipedream" else ""
    return f"{timeline.schedule} schedule: {timing}; idle {timeline.idle_fraction():.1%} of device time{over}"
