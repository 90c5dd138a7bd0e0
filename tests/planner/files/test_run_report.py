"""Run reports read back: loading, the comparison table, the measured timeline and figure,
and the `planner compare` / `planner calibrate` commands.

The fixture run is the simulator played back (`tests/replay.py`) with a "true"
profile whose stages run TRUE_FACTORS times their profiled times: the report must find those
factors, and calibration must give back the true profile."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from matplotlib.patches import Rectangle
from typer.testing import CliRunner, Result

from planner.cli import app
from planner.files.cluster import make_cluster
from planner.errors import FileFormatError
from planner.planning.partition import partition
from planner.simulation.plan_simulation import plan_cost_inputs
from planner.files.plan import Plan, load_plan
from planner.simulation.plan_simulation import plan_stages, simulate
from planner.display.plots import comparison_figure
from planner.files.profile import Profile, load_profile
from planner.files.run_report import (
    IDLE_ROW, RunReport, RunReportError, comparison_table, load_run_report,
    measured_timeline, run_report_from_dict, run_report_table,
)
from planner.costs.schedule_cost import stage_costs
from planner.files.timeline import Timeline
from planner.simulation.simulator import simulate_stages
from runtime.report import build_run_report, write_run_report
from tests.replay import replay_timeline

REPO = Path(__file__).resolve().parents[3]
TRUE_FACTORS = (2.0, 0.5, 1.0, 1.25)  # how much slower than profiled each stage of PLAN really runs
runner = CliRunner()


@dataclasses.dataclass(frozen=True)
class Files:
    profile: Path
    plan: Path
    report: Path


def accumulated_ms(plan: Plan, index: int) -> float:
    """The gradient accumulation in stage `index`'s mean compute per microbatch (not scaled by TRUE_FACTORS)."""
    return plan.mean_compute_ms(index) - plan.stages[index].compute_ms


def scaled(profile: Profile, plan: Plan, factors: tuple[float, ...]) -> Profile:
    """`profile` with the layers of each of the plan's stages `factors[s]` times slower, at every measured batch
    size."""
    layers = list(profile.layers)
    per_layer = [1.0] * len(layers)
    for stage, factor in zip(plan.stages, factors):
        for index in range(stage.start, stage.stop):
            per_layer[index] = factor
            layers[index] = dataclasses.replace(layers[index], fwd_ms=layers[index].fwd_ms * factor,
                                                bwd_ms=layers[index].bwd_ms * factor)
    sized = tuple(dataclasses.replace(times, fwd_ms=tuple(ms * f for ms, f in zip(times.fwd_ms, per_layer)),
                                      bwd_ms=tuple(ms * f for ms, f in zip(times.bwd_ms, per_layer)))
                  for times in profile.size_times)
    return dataclasses.replace(profile, layers=tuple(layers), size_times=sized)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    """A 4-stage 1f1b plan of the mlp profile and the report of a run that went as the true profile says."""
    folder = tmp_path_factory.mktemp("run-report")
    profile = load_profile(REPO / "profiles" / "mlp.json")
    profile_path = profile.save(folder / "mlp.json")
    plan = partition(profile, make_cluster(4, None, ["1GB/s"]), straight=True, schedule="1f1b", microbatches=4,
                     profile_path=str(profile_path))
    assert [stage.replicas for stage in plan.stages] == [1, 1, 1, 1]
    plan_path = plan.save(folder / "plan.json")
    truth = simulate_stages(plan_cost_inputs(scaled(profile, plan, TRUE_FACTORS), plan), plan_stages(plan))
    report = build_run_report(plan, replay_timeline(truth, 3, clock_offsets_s={1: 2.0, 3: -1.0}),
                              batch_size=4 * plan.microbatch_size, losses=[(1, 0.75), (2, 0.5)], plan_path=str(plan_path))
    return Files(profile_path, plan_path, write_run_report(folder / "run.json", report))


@pytest.fixture(scope="module")
def profile(files: Files) -> Profile:
    return load_profile(files.profile)


@pytest.fixture(scope="module")
def plan(files: Files) -> Plan:
    return load_plan(files.plan)


@pytest.fixture(scope="module")
def report(files: Files) -> RunReport:
    return load_run_report(files.report)


@pytest.fixture(scope="module")
def truth(profile: Profile, plan: Plan) -> Timeline:
    """What the run did: the plan simulated with the true layer times."""
    return simulate_stages(plan_cost_inputs(scaled(profile, plan, TRUE_FACTORS), plan), plan_stages(plan))


# ---------------------------------------------------------------- loading


def test_load_reads_what_the_run_measured(report: RunReport, plan: Plan, truth: Timeline) -> None:
    assert (report.schedule, report.microbatches, report.steps, report.batch_size) == ("1f1b", 4, 2, 32)
    assert report.stage_layers == tuple((stage.start, stage.stop) for stage in plan.stages)
    assert report.iteration_ms == pytest.approx(truth.iteration_s() * 1000.0)
    assert report.predicted_iteration_ms == plan.predicted.iteration_ms
    assert report.losses == ((1, 0.75), (2, 0.5))
    assert len(report.events) == len(truth.events)


def damaged(files: Files, tmp_path: Path, change: Any) -> Path:
    body = json.loads(files.report.read_text())
    change(body)
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(body))
    return path


@pytest.mark.parametrize("change, fragment", [
    (lambda body: body["measured"].pop("iteration_ms"), "missing the field 'iteration_ms'"),
    (lambda body: body["events"].append([0, 0, 0, 1]), "9 values"),
    (lambda body: body["events"].append([0, 0, 0, 1, 0, "dance", -1, 0.0, 1.0]), "unknown op 'dance'"),
    (lambda body: body["measured"]["stages"].pop(), "4 plan stages, 3 measured"),
    (lambda body: body["measured"].update(steps=0), "steps 0"),
    (lambda body: body["measured"].update(batch_size="many"), "malformed"),
    (lambda body: body.update(format="pipeline-planner/plan"), "expected 'pipeline-planner/run-report'"),
])
def test_bad_report_files_are_refused_naming_the_file(files: Files, tmp_path: Path, change: Any, fragment: str) -> None:
    path = damaged(files, tmp_path, change)
    with pytest.raises(FileFormatError) as error:
        load_run_report(path)
    assert str(path) in str(error.value) and fragment in str(error.value)


# ---------------------------------------------------------------- comparison


def test_comparison_table_finds_the_true_factors(report: RunReport, plan: Plan, truth: Timeline) -> None:
    table = comparison_table(report, simulate(plan, load_profile(plan.profile.path)))
    assert list(table.columns) == ["predicted", "measured", "ratio"]
    assert table.loc["iteration (ms)", "predicted"] == plan.predicted.iteration_ms
    assert table.loc["iteration (ms)", "measured"] == pytest.approx(truth.iteration_s() * 1000.0)
    assert table.loc["samples/s", "measured"] == pytest.approx(32 / truth.iteration_s())
    for index, (factor, stage) in enumerate(zip(TRUE_FACTORS, plan.stages)):
        assert table.loc[f"stage {index} compute (ms/microbatch)", "predicted"] == plan.mean_compute_ms(index)
        extra = accumulated_ms(plan, index)  # gradient accumulation: the same in the true run
        assert extra > 0  # the shipped profile times it
        assert table.loc[f"stage {index} compute (ms/microbatch)", "ratio"] == pytest.approx(
            (factor * stage.compute_ms + extra) / (stage.compute_ms + extra))
        assert table.loc[f"stage {index} comm (ms/microbatch)", "ratio"] == pytest.approx(1.0)
        assert math.isnan(table.loc[f"stage {index} all-reduce (ms/step)", "ratio"])  # nothing to all-reduce: 0 / 0
        assert table.loc[f"stage {index} step (ms)", "predicted"] == stage.step_ms
        measured_idle = table.loc[f"stage {index} idle (share)", "measured"]
        assert measured_idle == pytest.approx(float(truth.bubble_fraction()[index]))
        assert 0 <= table.loc[f"stage {index} idle (share)", "predicted"] < 1
    assert len(table) == 3 + 6 * len(plan.stages)  # iteration, samples/s, idle of all devices; 6 rows per stage


def test_comparison_table_states_the_plans_idle_share_against_the_runs(report: RunReport, plan: Plan,
                                                                     truth: Timeline) -> None:
    """(compare showed only per-stage idle shares, none the figure partition states.) Its idle row predicts the
    plan's idle share of device time and measures the stages' shares weighted by their ranks."""
    table = comparison_table(report, simulate(plan, load_profile(plan.profile.path)))
    assert table.loc[IDLE_ROW, "predicted"] == pytest.approx(plan.predicted.bubble_fraction, abs=1e-9)
    assert table.loc[IDLE_ROW, "measured"] == pytest.approx(truth.idle_fraction())
    stages = [table.loc[f"stage {index} idle (share)", "predicted"] for index in range(len(plan.stages))]
    assert sum(stages) / len(stages) == pytest.approx(plan.predicted.bubble_fraction, abs=1e-9)


def test_comparison_table_without_a_simulation_has_no_predicted_idle(report: RunReport) -> None:
    table = comparison_table(report)
    assert table.loc[[name for name in table.index if "idle" in name], "predicted"].isna().all()
    assert not table.loc[[name for name in table.index if "idle" not in name], "predicted"].isna().any()


def test_pipedream_compares_the_steady_state_time_per_microbatch(profile: Profile) -> None:
    plan = partition(profile, make_cluster(3, None, ["1GB/s"]), straight=True, schedule="pipedream")
    simulated = simulate(plan, profile)
    built = build_run_report(plan, replay_timeline(simulated, 2), batch_size=simulated.microbatches * 8, losses=[])
    table = comparison_table(built, simulated)
    assert table.index[0] == "time per microbatch (ms)"
    assert table.loc["time per microbatch (ms)", "measured"] == pytest.approx(simulated.iteration_s() * 1000.0)
    assert table.loc["time per microbatch (ms)", "ratio"] == pytest.approx(1.0)
    assert table.loc["samples/s", "ratio"] == pytest.approx(1.0)
    assert any("steady-state" in note for note in built.notes)


def test_measured_timeline_is_the_run(report: RunReport, truth: Timeline, plan: Plan, profile: Profile) -> None:
    stage_times = simulate(plan, profile).stage_times
    timeline = measured_timeline(report, stage_times)
    assert (timeline.schedule, timeline.microbatches, timeline.iterations) == ("1f1b", 4, 1)
    assert timeline.makespan_s == pytest.approx(truth.makespan_s)
    assert timeline.bubble_fraction().to_list() == pytest.approx(truth.bubble_fraction().to_list())
    assert timeline.peak_memory().to_list() == pytest.approx(truth.peak_memory().to_list())
    with pytest.raises(RunReportError, match="4 stages, but 2 stage times"):
        measured_timeline(report, stage_times[:2])


def test_comparison_figure_draws_both_schedules_on_one_axis(report: RunReport, plan: Plan, profile: Profile) -> None:
    simulated = simulate(plan, profile)
    measured = measured_timeline(report, simulated.stage_times)
    fig = comparison_figure(simulated, report)
    top, bottom = fig.subfigs
    assert top._suptitle.get_text().startswith("predicted (simulated): 1f1b schedule")
    assert bottom._suptitle.get_text().startswith("measured: 1f1b schedule")
    (top_ax,), (bottom_ax,) = top.axes, bottom.axes
    assert top_ax.get_xlim() == bottom_ax.get_xlim()
    assert top_ax.get_xlim()[1] >= max(simulated.makespan_s, measured.makespan_s) * 1000.0
    for ax, timeline in ((top_ax, simulated), (bottom_ax, measured)):
        forwards = [patch for patch in ax.patches if isinstance(patch, Rectangle) and patch.get_gid() == "forward"]
        assert len(forwards) == int((timeline.events["op"] == "forward").sum())


def test_the_measured_chart_states_the_tables_iteration_and_which_step_it_draws(report: RunReport, plan: Plan,
                                                                               profile: Profile) -> None:
    """(Titled "measured: 216.1 ms per iteration" under a table of "median train step 243.6 ms": the chart drew one
    step, the shorter middle one of 2, and called its length the iteration.)"""
    run = dataclasses.replace(report, step_times_ms=(271.1, 216.1), train_step_ms=243.6, iteration_ms=243.6,
                              representative_step=3, meta={"first_step": 41})  # a run resumed at step 40
    assert run.representative_step_ms == 216.1 and run.representative_step_number == 44
    assert dataclasses.replace(run, step_times_ms=(3.0, 1.0, 2.0)).representative_step_ms == 2.0  # the median
    assert dataclasses.replace(run, meta={}).representative_step_number == 4  # counted from 1
    simulated = simulate(plan, profile)
    title = comparison_figure(simulated, run).subfigs[1]._suptitle.get_text()
    idle = measured_timeline(run, simulated.stage_times).idle_fraction()
    assert title == (f"measured: 1f1b schedule: 243.6 ms per iteration (the median of 2 steps); step 44 drawn: "
                     f"216.1 ms, idle {idle:.1%} of device time")
    assert comparison_table(run).loc["iteration (ms)", "measured"] == 243.6  # the table's, as the title states it
    assert str(run_report_table(run).caption).startswith("median train step 243.6 ms")


# ---------------------------------------------------------------- the commands


def invoke(*args: str | Path) -> Result:
    return runner.invoke(app, [str(arg) for arg in args])


def assert_one_line_error(result: Result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_compare_prints_the_table_and_draws_the_figure(files: Files, tmp_path: Path) -> None:
    result = invoke("compare", files.plan, files.report, "--out", tmp_path / "cmp.png")
    assert result.exit_code == 0, result.output
    assert "measured against predicted" in result.stdout
    table = comparison_table(load_run_report(files.report))
    for index in (0, 1):
        ratio = table.loc[f"stage {index} compute (ms/microbatch)", "ratio"]
        assert f"stage {index} compute (ms/microbatch)" in result.stdout and f"x{ratio:.3g}" in result.stdout
    assert "stage 3 idle (share)" in result.stdout
    assert IDLE_ROW in result.stdout and f"{load_plan(files.plan).predicted.bubble_fraction:.1%}" in result.stdout
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 'cmp.png'}" in result.stdout


def test_compare_without_the_profile_prints_the_table_and_says_what_is_missing(files: Files, plan: Plan,
                                                                               tmp_path: Path) -> None:
    lost = dataclasses.replace(plan, profile=dataclasses.replace(plan.profile, path=str(tmp_path / "gone.json")))
    path = lost.save(tmp_path / "plan.json")
    result = invoke("compare", path, files.report)
    assert result.exit_code == 0, result.output
    assert "stage 0 compute" in result.stdout and "--profile" in result.stdout
    assert_one_line_error(invoke("compare", path, files.report, "--out", tmp_path / "x.png"), "gone.json",
                          "--profile")
    assert not (tmp_path / "x.png").exists()
    assert invoke("compare", path, files.report, "--profile", files.profile).exit_code == 0


def test_compare_bad_report_is_one_line(files: Files, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert_one_line_error(invoke("compare", files.plan, bad), str(bad), "not valid JSON")
    assert_one_line_error(invoke("compare", files.plan, files.plan), str(files.plan), "run-report")
    missing = damaged(files, tmp_path, lambda body: body["plan"].pop("stages"))
    assert_one_line_error(invoke("compare", files.plan, missing), str(missing), "'stages'")


def test_compare_report_of_another_plan_is_one_line(files: Files, plan: Plan, tmp_path: Path) -> None:
    other = dataclasses.replace(plan, schedule="gpipe").save(tmp_path / "gpipe.json")
    assert_one_line_error(invoke("compare", other, files.report), str(files.report), str(other), "schedule 1f1b")


def test_calibrate_writes_a_new_profile_next_to_the_old_and_plans_with_it(files: Files, tmp_path: Path,
                                                                          plan: Plan, report: RunReport) -> None:
    source = tmp_path / "mlp.json"
    source.write_bytes(files.profile.read_bytes())
    before = source.read_bytes()
    result = invoke("calibrate", source, files.report, "--plan", files.plan)
    assert result.exit_code == 0, result.output
    written = tmp_path / "mlp-calibrated.json"
    assert source.read_bytes() == before
    assert f"wrote {written}" in result.stdout
    assert "x2" in result.stdout and "x0.5" in result.stdout and "x1.25" in result.stdout
    calibrated = load_profile(written)
    costs = stage_costs(plan_cost_inputs(calibrated, plan), plan_stages(plan))
    assert [cost.compute_s * 1000.0 + accumulated_ms(plan, index) for index, cost in enumerate(costs)] == \
        pytest.approx([s.compute_ms for s in report.measured])
    replanned = invoke("partition", written, "--gpus", "4", "--bandwidth", "1GB/s", "--straight", "--schedule",
                       "1f1b", "--microbatches", "4", "--out", tmp_path / "replanned.json")
    assert replanned.exit_code == 0, replanned.output
    new_plan = load_plan(tmp_path / "replanned.json")
    new_plan.check_profile(calibrated)
    # stage 0 really is 2x slower: the new plan gives it fewer of those layers' time than the old did
    assert new_plan.stages[0].stop <= plan.stages[0].stop


def test_calibrate_out_and_errors(files: Files, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "tuned.json"
    assert invoke("calibrate", files.profile, files.report, "--plan", files.plan, "--out", out).exit_code == 0
    assert load_profile(out).settings["calibrations"][-1]["report"] == str(files.report)
    other = tmp_path / "other.json"
    profile = load_profile(files.profile)
    dataclasses.replace(profile, layers=profile.layers[::-1]).save(other)
    assert_one_line_error(invoke("calibrate", other, files.report, "--plan", files.plan), str(other), "digest")
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert_one_line_error(invoke("calibrate", files.profile, bad, "--plan", files.plan), str(bad))


def test_report_round_trips_through_the_dict(files: Files) -> None:
    body = json.loads(files.report.read_text())
    report = run_report_from_dict(body, "here")
    assert report.source == "here" and report.measured[0].compute_ms == body["measured"]["stages"][0]["compute_ms"]
    written = {key: value for key, value in body.items() if key not in ("format", "version", "planner_version")}
    assert report.to_dict() == written  # nothing the file has is dropped on the way through RunReport


def test_a_report_from_before_steps_were_predicted_still_loads(files: Files, tmp_path: Path) -> None:
    def drop_steps(body: dict[str, Any]) -> None:
        for stage in body["predicted"]["stages"]:
            del stage["step_ms"]

    report = load_run_report(damaged(files, tmp_path, drop_steps))
    assert [stage.step_ms for stage in report.predicted] == [0.0] * len(report.predicted)
