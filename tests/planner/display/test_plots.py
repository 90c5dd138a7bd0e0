"""The figures draw what the plan and timeline say: bars, boundaries, boxes, lines and limits, and render as PNG."""

from __future__ import annotations

import dataclasses
import re
from io import BytesIO
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import imread
from matplotlib.patches import Rectangle

from planner.files.cluster import make_cluster
from planner.planning.partition import partition
from planner.files.plan import Plan
from planner.simulation.plan_simulation import simulate
from planner.display.plots import (
    MAX_NAME_CHARS,
    MAX_TICK_LABELS,
    _short_names,
    _format_rate,
    gantt_figure,
    memory_figure,
    schedules_figure,
    partition_figure,
    plan_figure,
    scaling_figure,
)
from planner.files.profile import PER_LAYER_FIELDS, Profile, load_profile
from planner.schedules.schedule import BACKWARD, FORWARD, SEND_ACTIVATION, SEND_GRADIENT, WEIGHT, build_schedule
from planner.files.timeline import StageTimes, Timeline
from planner.simulation.simulator import simulate_schedule
from planner.units import format_bytes

PROFILES = Path(__file__).resolve().parents[3] / "profiles"
UNITS = {"MB": 1e6, "GB": 1e9}


@pytest.fixture(scope="module")
def gpt() -> Profile:
    return load_profile(PROFILES / "gpt.json")


@pytest.fixture(scope="module")
def replicated(gpt: Profile) -> Plan:
    """Several stages, some replicated, under a 120 MB limit (today three stages, the last x2)."""
    plan = partition(gpt, make_cluster(4, memory="120MB"), schedule="1f1b", microbatches=8)
    assert len(plan.stages) >= 2 and any(stage.replicas > 1 for stage in plan.stages)
    return plan


@pytest.fixture(scope="module")
def pipedream(gpt: Profile) -> Plan:
    """Five stages on two nodes, replicated and recomputing, asynchronous schedule."""
    plan = partition(gpt, make_cluster(8, 4, ("10GB/s", "1GB/s"), memory="100MB"), schedule="pipedream")
    assert len(plan.stages) >= 2 and any(stage.replicas > 1 for stage in plan.stages)
    return plan


@pytest.fixture(scope="module")
def unlimited(gpt: Profile) -> Plan:
    """No memory limit (today: one stage on every GPU, data parallel)."""
    plan = partition(gpt, make_cluster(4, bandwidths=("2GB/s",)), schedule="gpipe", microbatches=4)
    assert plan.cluster.memory_bytes is None
    return plan


@pytest.fixture(scope="module")
def timeline(gpt: Profile, replicated: Plan) -> Timeline:
    return simulate(replicated, gpt)


def png_bytes(fig: Figure) -> bytes:
    buffer = BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def assert_real_png(fig: Figure) -> None:
    """The figure renders to a PNG over 10 KB that is not one flat colour."""
    data = png_bytes(fig)
    assert len(data) > 10_000
    pixels = imread(BytesIO(data), format="png")
    assert pixels.std() > 0


def unit_of(label: str) -> float:
    """Bytes per plotted unit, from an axis label ending in '(MB)' or '(GB)'."""
    found = re.search(r"\((MB|GB)\)\s*$", label)
    assert found, label
    return UNITS[found.group(1)]


def bars(ax: Axes) -> list[Rectangle]:
    return [patch for patch in ax.patches if isinstance(patch, Rectangle)]


def gid_lines(ax: Axes, gid: str) -> list:
    return [line for line in ax.lines if line.get_gid() == gid]


# ---------------------------------------------------------------- partition


@pytest.mark.parametrize("name", ["replicated", "pipedream", "unlimited"])
def test_partition_bars_one_per_layer_coloured_by_stage(name: str, gpt: Profile,
                                                         request: pytest.FixtureRequest) -> None:
    """Top panel: one bar per layer of height fwd + bwd ms, as many colours as stages, one colour per stage."""
    plan: Plan = request.getfixturevalue(name)
    time_ax, memory_ax = partition_figure(plan, gpt).axes
    layer_bars = bars(time_ax)
    assert len(layer_bars) == gpt.num_layers
    heights = [bar.get_height() for bar in sorted(layer_bars, key=lambda bar: bar.get_x())]
    assert heights == pytest.approx([layer.fwd_ms + layer.bwd_ms for layer in gpt.layers])
    colours = [tuple(bar.get_facecolor()) for bar in sorted(layer_bars, key=lambda bar: bar.get_x())]
    assert len(set(colours)) == len(plan.stages)
    for stage in plan.stages:
        assert len(set(colours[stage.start:stage.stop])) == 1
    labels = time_ax.get_legend().get_texts()
    for index, stage in enumerate(plan.stages):
        assert any(text.get_text().startswith(f"stage {index} ({stage.replicas} replica") for text in labels)


@pytest.mark.parametrize("name", ["replicated", "pipedream", "unlimited"])
def test_partition_boundaries_and_cut_bytes(name: str, gpt: Profile, request: pytest.FixtureRequest) -> None:
    """stages - 1 boundary lines between the stages' layers, each labelled with the bytes crossing it."""
    plan: Plan = request.getfixturevalue(name)
    time_ax, _ = partition_figure(plan, gpt).axes
    lines = gid_lines(time_ax, "stage-boundary")
    assert len(lines) == len(plan.stages) - 1
    assert sorted(line.get_xdata()[0] for line in lines) == [stage.stop - 0.5 for stage in plan.stages[:-1]]
    annotations = sorted(time_ax.texts, key=lambda text: text.xy[0])
    assert [text.get_text() for text in annotations] == [
        format_bytes(gpt.layers[stage.stop - 1].cut_bytes) for stage in plan.stages[:-1]
    ]


@pytest.mark.parametrize("name", ["replicated", "unlimited"])
def test_partition_memory_bars_and_limit(name: str, gpt: Profile, request: pytest.FixtureRequest) -> None:
    """Bottom panel: one memory bar per stage spanning its layers; the dashed limit line iff the cluster has memory."""
    plan: Plan = request.getfixturevalue(name)
    _, memory_ax = partition_figure(plan, gpt).axes
    scale = unit_of(memory_ax.get_ylabel())
    stage_bars = sorted(bars(memory_ax), key=lambda bar: bar.get_x())
    assert [bar.get_height() * scale for bar in stage_bars] == pytest.approx([s.memory_bytes for s in plan.stages])
    for bar, stage in zip(stage_bars, plan.stages):
        assert stage.start - 0.5 <= bar.get_x() < bar.get_x() + bar.get_width() <= stage.stop - 0.5
    limits = gid_lines(memory_ax, "memory-limit")
    if plan.cluster.memory_bytes is None:
        assert limits == []
    else:
        assert len(limits) == 1
        assert limits[0].get_ydata()[0] * scale == pytest.approx(plan.cluster.memory_bytes)
        assert limits[0].get_linestyle() == "--"


def test_partition_title_names_model_schedule_gpus_and_throughput(gpt: Profile, replicated: Plan) -> None:
    title = partition_figure(replicated, gpt)._suptitle.get_text()
    assert "gpt" in title and "1f1b" in title
    assert f"{replicated.predicted.devices_used} of 4 GPUs" in title
    assert f"{_format_rate(replicated.predicted.samples_per_s)} samples/s" in title


def test_partition_title_says_what_one_step_trains_and_the_bars_the_profiled_batch(gpt: Profile,
                                                                                    replicated: Plan) -> None:
    """(A user read "mini-batch of 8" as the plan's batch.) The title states the global batch as microbatches x
    samples; the layer times are labelled as the profiled batch's."""
    figure = partition_figure(replicated, gpt)
    title = figure._suptitle.get_text()
    assert replicated.global_batch_size == replicated.microbatches * replicated.microbatch_size
    assert (f"1f1b, global batch {replicated.global_batch_size} = {replicated.microbatches} microbatches x "
            f"{replicated.microbatch_size} samples;") in title
    assert "mini-batch of" not in title
    time_ax = figure.axes[0]
    assert f"ms per profiled batch of {gpt.batch_size} samples" in time_ax.get_ylabel()
    assert f"per profiled batch of {gpt.batch_size} samples" in time_ax.get_title()


def test_plan_figure_states_the_idle_share_the_plan_states(gpt: Profile) -> None:
    """`planner show`'s figure and `planner partition`'s table give one idle figure for one plan."""
    from planner.display.tables import plan_table

    plan = partition(gpt, make_cluster(2, bandwidths=("2GB/s",)), straight=True, schedule="1f1b", microbatches=4)
    fig = plan_figure(plan, gpt, simulate(plan, gpt))
    shown = f"idle {plan.predicted.bubble_fraction:.1%} of device time"
    assert shown in fig.subfigs[1]._suptitle.get_text()
    assert shown in str(plan_table(plan).caption)


def test_a_one_gpu_plan_is_titled_in_the_singular(gpt: Profile) -> None:
    plan = partition(gpt, make_cluster(1), schedule="1f1b", microbatches=1)
    title = partition_figure(plan, gpt)._suptitle.get_text()
    assert "1 of 1 GPU;" in title and "= 1 microbatch x" in title and "GPUs" not in title


def test_many_layers_get_at_most_forty_short_tick_labels(gpt: Profile) -> None:
    """200 layers with long names: at most MAX_TICK_LABELS labels, none longer than MAX_NAME_CHARS."""
    template = gpt.layers[3]
    layers = tuple(dataclasses.replace(template, name=f"model.encoder.layers.{i}.attention_block_with_long_name")
                   for i in range(200))
    per_layer = {name: (getattr(gpt, name)[3],) * len(layers) if getattr(gpt, name) else ()
                 for name in PER_LAYER_FIELDS}  # (per-layer fields follow the layers, whichever the profile has:
    # `./dev.sh demo` replaces profiles/gpt.json with this machine's; one batch size; no tied weights, which the
    # copies of one layer do not hold)
    big = dataclasses.replace(gpt, layers=layers, **per_layer, size_times=(), shared_params=())
    plan = partition(big, make_cluster(2), schedule="1f1b", microbatches=2)
    _, memory_ax = partition_figure(plan, big).axes
    labels = [label.get_text() for label in memory_ax.get_xticklabels()]
    assert 0 < len(labels) <= MAX_TICK_LABELS
    assert all(0 < len(label) <= MAX_NAME_CHARS for label in labels)
    assert len(set(labels)) == len(labels)


def test_format_rate_has_no_exponent() -> None:
    assert [_format_rate(v) for v in (72.123, 493.64, 10442.4, 1.5e6)] == ["72.12", "493.6", "10,442", "1,500,000"]


def test_short_names_keep_the_distinguishing_end() -> None:
    names = ["transformer.wte", "transformer.h.0", "transformer.h.11", "lm_head", "a.attn.proj", "b.mlp.proj", "3"]
    assert _short_names(names) == ["wte", "h.0", "h.11", "lm_head", "attn.proj", "mlp.proj", "3"]
    long = _short_names(["x." + "y" * 40])[0]
    assert len(long) == MAX_NAME_CHARS and "…" in long and long.startswith("y") and long.endswith("y")


# ---------------------------------------------------------------- gantt


def test_gantt_has_one_box_per_compute_event_at_its_time(timeline: Timeline) -> None:
    """Each forward and backward is a box from its start to its end (ms), rank 0 in the top row."""
    ax = gantt_figure(timeline).axes[0]
    for op in (FORWARD, BACKWARD):
        events = timeline.events[timeline.events["op"] == op]
        boxes = [patch for patch in ax.patches if patch.get_gid() == op]
        assert len(boxes) == len(events)
        drawn = sorted((box.get_x(), box.get_width()) for box in boxes)
        expected = sorted(zip(events["start_s"] * 1000, (events["end_s"] - events["start_s"]) * 1000))
        np.testing.assert_allclose(np.array(drawn), np.array(expected), rtol=1e-12, atol=1e-9)
    ranks = sorted(timeline.events["rank"].unique())
    assert ax.yaxis_inverted()
    rank_of_tick = {label.get_text(): tick for label, tick in zip(ax.get_yticklabels(), ax.get_yticks())}
    assert rank_of_tick["rank 0 (stage 0)"] < rank_of_tick[f"rank {ranks[-1]} (stage {len(timeline.stage_times) - 1})"]
    forward_colours = {tuple(p.get_facecolor()) for p in ax.patches if p.get_gid() == FORWARD}
    backward_colours = {tuple(p.get_facecolor()) for p in ax.patches if p.get_gid() == BACKWARD}
    assert len(forward_colours) == len(backward_colours) == 1 and forward_colours != backward_colours


def test_gantt_of_a_chunked_schedule_names_each_ranks_stages_and_lightens_later_chunks() -> None:
    """interleaved-1f1b, 2 ranks x 2 chunks: one row per rank labelled with both its stages, a box per
    forward and backward, chunk 1's boxes lighter than chunk 0's; the memory panel has a line per rank."""
    times = [StageTimes(1e-3, 2e-3, 0.0, 0.0, held_bytes=1e6, base_bytes=1e8) for _ in range(4)]
    timeline = simulate_schedule(build_schedule("interleaved-1f1b", [1] * 4, 4, chunks=2), times)
    ax = gantt_figure(timeline).axes[0]
    assert [label.get_text() for label in ax.get_yticklabels()] == ["rank 0 (stages 0, 2)", "rank 1 (stages 1, 3)"]
    for op in (FORWARD, BACKWARD):
        boxes = [patch for patch in ax.patches if patch.get_gid() == op]
        assert len(boxes) == len(timeline.events[timeline.events["op"] == op]) == 16
        shades = sorted({tuple(box.get_facecolor()) for box in boxes}, key=sum)
        assert len(shades) == 2 and sum(shades[1][:3]) > sum(shades[0][:3])  # chunk 1 lighter
    memory_ax = memory_figure(timeline).axes[0]
    assert [line.get_label() for line in memory_ax.get_lines() if not line.get_label().startswith("_")] == [
        "rank 0 (stages 0, 2)", "rank 1 (stages 1, 3)"]


def test_gantt_sends_only_with_communication(timeline: Timeline) -> None:
    sends = timeline.events[timeline.events["op"].isin((SEND_ACTIVATION, SEND_GRADIENT))]
    assert len(sends) > 0
    without = gantt_figure(timeline).axes[0]
    assert not [p for p in without.patches if p.get_gid() in (SEND_ACTIVATION, SEND_GRADIENT)]
    ax = gantt_figure(timeline, communication=True).axes[0]
    boxes = [p for p in ax.patches if p.get_gid() in (SEND_ACTIVATION, SEND_GRADIENT)]
    assert len(boxes) == len(sends)
    compute_height = max(p.get_height() for p in ax.patches if p.get_gid() == FORWARD)
    assert all(box.get_height() < compute_height for box in boxes)
    legend = {text.get_text() for text in ax.get_legend().get_texts()}
    assert {"forward", "backward", "send activation", "send gradient"} <= legend


def test_gantt_title_and_microbatch_labels(timeline: Timeline) -> None:
    fig = gantt_figure(timeline)
    title = fig._suptitle.get_text()
    assert "1f1b" in title
    assert f"{timeline.iteration_s() * 1000:.4g} ms" in title
    assert f"idle {max(timeline.bubble_fraction().mean(), 0.0):.1%} of device time" in title
    ax = fig.axes[0]
    numbers = {int(text.get_text()) for text in ax.texts}
    assert numbers and numbers <= set(range(timeline.microbatches))
    assert ax.get_xlabel() == "time (ms)"


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("limit", [None, 100e6])
def test_memory_lines_peak_at_the_timeline_peak(timeline: Timeline, limit: float | None) -> None:
    """One step line per stage; each one's maximum is that stage's peak, in the axis unit; the limit iff given."""
    ax = memory_figure(timeline, limit).axes[0]
    scale = unit_of(ax.get_ylabel())
    stage_lines = [line for line in ax.lines if line.get_label().startswith("stage")]
    peaks = timeline.peak_memory()
    assert len(stage_lines) == len(peaks)
    for line in stage_lines:
        stage = int(line.get_label().split()[1])
        assert max(line.get_ydata()) * scale == pytest.approx(peaks[stage])
        assert line.get_drawstyle() == "steps-post"
    limits = gid_lines(ax, "memory-limit")
    assert len(limits) == (0 if limit is None else 1)
    if limit is not None:
        assert limits[0].get_ydata()[0] * scale == pytest.approx(limit)
    assert ax.get_xlabel() == "time (ms)"
    assert max(max(line.get_xdata()) for line in stage_lines) == pytest.approx(timeline.makespan_s * 1000)


# ---------------------------------------------------------------- scaling and the combined figure


def test_scaling_figure_lines_and_log2_axis() -> None:
    table = pd.DataFrame({
        "gpus": [1, 2, 4, 8], "pipeline_samples_per_s": [10.0, 19.0, 35.0, 60.0],
        "data_parallel_samples_per_s": [10.0, 18.0, np.nan, np.nan], "ideal_samples_per_s": [10.0, 20.0, 40.0, 80.0],
        "devices_used": [1.0, 2.0, 4.0, 6.0], "stages": [1.0, 1.0, 2.0, 3.0],
    })
    fig = scaling_figure(table)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    assert [label.get_text() for label in ax.get_xticklabels()] == ["1", "2", "4", "8"]
    lines = {line.get_label().split(" (")[0]: line for line in ax.lines}
    assert list(lines["planned pipeline"].get_ydata()) == [10.0, 19.0, 35.0, 60.0]
    assert lines["ideal"].get_linestyle() == "--"
    assert np.isnan(lines["data parallel"].get_ydata()[2:]).all()
    assert "samples/s" in ax.get_ylabel() and ax.get_xlabel() == "GPUs"
    assert any(text.get_text() == "6 used" for text in ax.texts)
    assert_real_png(fig)


def test_plan_figure_stacks_the_three_panels(gpt: Profile, pipedream: Plan) -> None:
    timeline = simulate(pipedream, gpt)
    fig = plan_figure(pipedream, gpt, timeline)
    assert len(fig.subfigs) == 3
    partition_axes, gantt_axes, memory_axes = (subfig.axes for subfig in fig.subfigs)
    assert len(bars(partition_axes[0])) == gpt.num_layers
    assert len([p for p in gantt_axes[0].patches if p.get_gid() == FORWARD]) == \
        int((timeline.events["op"] == FORWARD).sum())
    assert len(gid_lines(memory_axes[0], "memory-limit")) == 1
    assert_real_png(fig)


def test_every_figure_renders_to_a_real_png(gpt: Profile, replicated: Plan, timeline: Timeline) -> None:
    for fig in (partition_figure(replicated, gpt), gantt_figure(timeline), gantt_figure(timeline, communication=True),
                memory_figure(timeline, replicated.cluster.memory_bytes)):
        assert_real_png(fig)


def test_figures_show_in_jupyter_without_pyplot() -> None:
    """Jupyter displays an object through its `_repr_png_`; a bare matplotlib Figure has none."""
    profile = load_profile(Path(__file__).resolve().parents[3] / "profiles" / "mlp.json")
    plan = partition(profile, make_cluster(2, None, ["10GB/s"]))
    png = partition_figure(plan, profile)._repr_png_()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_schedules_figure_stacks_gantt_charts_on_one_time_axis(gpt: Profile) -> None:
    """zb-h1's W boxes are drawn apart (their own colour and legend entry); both panels span the longer run."""
    plans = [partition(gpt, make_cluster(4), straight=True, schedule=name, microbatches=8) for name in ("1f1b", "zb-h1")]
    timelines = [simulate(plan, gpt) for plan in plans]
    fig = schedules_figure(timelines)
    axes = fig.axes
    assert len(axes) == 2
    span = max(timeline.makespan_s for timeline in timelines) * 1000.0
    assert [ax.get_xlim()[1] for ax in axes] == [pytest.approx(span * 1.01)] * 2
    weights = timelines[1].events[timelines[1].events["op"] == WEIGHT]
    assert len(weights) == 4 * 8
    assert len([patch for patch in axes[1].patches if patch.get_gid() == WEIGHT]) == len(weights)
    assert not [patch for patch in axes[0].patches if patch.get_gid() == WEIGHT]
    assert "weight gradients (W)" in {text.get_text() for text in axes[1].get_legend().get_texts()}
    assert_real_png(fig)
