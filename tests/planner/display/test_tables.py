"""The terminal tables: plans, simulated timelines and profiles say one idle figure, every all-reduce, and read well."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from rich.table import Table

from planner.display.plots import plan_figure
from planner.display.tables import (
    comparison_table, memory_cell, plan_summary, plan_table, profile_table, timeline_table,
)
from planner.files.cluster import make_cluster
from planner.files.plan import Plan
from planner.files.profile import Profile, load_profile
from planner.files.run_report import _simulated_idle
from planner.planning.partition import compare_schedules, partition
from planner.simulation.plan_simulation import simulate
from planner.units import format_ms

PROFILES = Path(__file__).resolve().parents[3] / "profiles"


@pytest.fixture(scope="module")
def gpt() -> Profile:
    return load_profile(PROFILES / "gpt.json")


@pytest.fixture(scope="module")
def straight(gpt: Profile) -> Plan:
    """The user's path: 2 GPUs, straight, 1f1b, 4 microbatches; the tied embedding on stage 0, the head on stage 1."""
    plan = partition(gpt, make_cluster(2), straight=True, schedule="1f1b", microbatches=4)
    assert [stage.tied_allreduce_ms > 0 for stage in plan.stages] == [True, True]
    return plan


def cells(table: Table, header: str) -> list[str]:
    """The cells of the column named `header`, as printed."""
    column = next(column for column in table.columns if column.header == header)
    return [str(cell) for cell in column._cells]


def test_partition_show_simulate_and_compare_state_one_idle_figure(gpt: Profile, straight: Plan) -> None:
    """(A user read 22.1%, 20.1% and 19.0%/21.3% for one plan.) The plan's idle share is the simulated iteration's:
    partition's table, simulate's table and show's figure print the same figure, and compare's per-stage predicted
    idle shares average to it, weighted by each stage's devices."""
    timeline = simulate(straight, gpt)
    idle = straight.predicted.bubble_fraction
    assert idle == pytest.approx(timeline.idle_fraction()) and 0 < idle < 1
    shown = f"idle {idle:.1%} of device time"
    assert shown in str(plan_table(straight).caption)
    assert shown in str(timeline_table(straight, timeline).caption)
    assert shown in plan_figure(straight, gpt, timeline).subfigs[1]._suptitle.get_text()
    per_stage = _simulated_idle(timeline)
    weights = [len(stage.ranks) for stage in straight.stages]
    assert sum(w * per_stage[index] for index, w in enumerate(weights)) / sum(weights) == pytest.approx(idle)


def test_the_simulated_table_says_its_idle_figure_is_the_mean_of_the_ranks(gpt: Profile, straight: Plan) -> None:
    timeline = simulate(straight, gpt)
    caption = str(timeline_table(straight, timeline).caption)
    assert f"(mean of the ranks; worst rank {timeline.bubble_fraction().max():.1%})" in caption
    assert "mean bubble" not in caption


def test_a_pipedream_plan_says_its_idle_share_is_the_steady_states(gpt: Profile) -> None:
    """pipedream's plan states the steady state; its simulated run has a fill and a drain, labelled as such."""
    plan = partition(gpt, make_cluster(2), straight=True, schedule="pipedream")
    assert f"idle {plan.predicted.bubble_fraction:.1%} of device time in steady state" in plan_summary(plan)
    caption = str(timeline_table(plan, simulate(plan, gpt)).caption)
    assert "over the simulated run, fill and drain included" in caption
    assert f"the plan states {plan.predicted.bubble_fraction:.1%} in steady state" in caption


def test_the_all_reduce_column_counts_tied_weights_with_a_footnote(straight: Plan) -> None:
    """(The column read 0 while compare predicted the tied all-reduce.) Each stage's cell is its replicas' and its
    tied weights' all-reduce, marked, and the caption says so."""
    table = plan_table(straight)
    assert cells(table, "all-reduce ms") == [
        f"{format_ms(stage.allreduce_ms + stage.tied_allreduce_ms)}*" for stage in straight.stages]
    assert all(stage.tied_allreduce_ms > 0 and cell != "0*" for stage, cell in
               zip(straight.stages, cells(table, "all-reduce ms")))
    caption = str(table.caption)
    assert "* all-reduce ms includes summing tied weights' gradients" in caption
    assert f"stage 0: {format_ms(straight.stages[0].tied_allreduce_ms)} ms" in caption


def test_a_plan_without_tied_weights_has_no_footnote(gpt: Profile) -> None:
    untied = dataclasses.replace(gpt, shared_params=())
    plan = partition(untied, make_cluster(2), straight=True, schedule="1f1b", microbatches=4)
    table = plan_table(plan)
    assert all(not cell.endswith("*") for cell in cells(table, "all-reduce ms"))
    assert "tied" not in str(table.caption)


def test_a_stage_of_one_layer_shows_just_its_name(straight: Plan) -> None:
    first = straight.stages[0]
    one = dataclasses.replace(first, stop=first.start + 1, last_layer=first.first_layer)
    plan = dataclasses.replace(straight, stages=(one, *straight.stages[1:]))
    layers = cells(plan_table(plan), "layers")
    assert layers[0] == first.first_layer
    assert layers[1] == f"{straight.stages[1].first_layer} .. {straight.stages[1].last_layer}"


def test_one_gpu_and_one_microbatch_read_in_the_singular(gpt: Profile) -> None:
    plan = partition(gpt, make_cluster(1), schedule="1f1b", microbatches=1)
    table = plan_table(plan)
    text = f"{table.title}\n{table.caption}"
    assert "1 stage on 1 GPU:" in text and "1 microbatch of" in text
    assert "data parallelism on 1 GPU;" in text and "; 1 GPU used" in text
    assert "1 GPUs" not in text and "1 microbatches" not in text


def test_sizes_never_print_in_exponent_notation(gpt: Profile) -> None:
    """(The profile table printed "1e+03 KiB".) Sizes that round to 1000 or more of a unit print whole, and what
    rounds to 1024 is the next unit."""
    assert memory_cell(int(999.7e9), None) == "1000 GB"
    assert memory_cell(int(1.5e9), int(3e9)) == "1.5 GB (50%)"
    layers = list(gpt.layers)
    layers[0] = dataclasses.replace(layers[0], output_bytes=int(1023.9 * 1024), saved_bytes=int(1000.2 * 1024))
    table = profile_table(dataclasses.replace(gpt, layers=tuple(layers)))
    assert cells(table, "output")[0] == "1 MiB" and cells(table, "saved")[0] == "1000 KiB"
    assert not any("e+" in cell for header in ("output", "cut", "params", "saved") for cell in cells(table, header))


def test_the_comparison_counts_the_gpus_a_chunked_plan_uses_not_its_stages(gpt: Profile, straight: Plan) -> None:
    """(`--compare` printed 6 GPUs for the best interleaved-1f1b plan of 2 GPUs, 3 chunks each, and 4 for zbv's.)"""
    baselines = compare_schedules(gpt, straight)
    chunked = {baseline.name: baseline for baseline in baselines if baseline.chunks > 1}
    assert set(chunked) == {"best interleaved-1f1b", "best zbv"}
    assert all(len(baseline.stages) > 2 for baseline in chunked.values())  # stages beyond the GPUs
    table = comparison_table(straight, baselines)
    assert cells(table, "plan")[:len(baselines) + 1] == ["optimized", *(baseline.name for baseline in baselines)]
    assert set(cells(table, "GPUs")) == {"2"}
