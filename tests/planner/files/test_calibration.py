"""Calibration: the fixture run of `test_run_report` (stages TRUE_FACTORS times slower than profiled)
must give back the true layer times; reports of other plans, profiles or microbatch sizes are refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from planner.costs.schedule_cost import stage_costs
from planner.files.calibration import calibrate_profile, calibration_table
from planner.files.cluster import make_cluster
from planner.files.plan import Plan, PlanProfileMismatchError
from planner.files.profile import Profile
from planner.files.run_report import ReportPlanMismatchError, RunReport, RunReportError
from planner.planning.partition import partition
from planner.simulation.plan_simulation import plan_cost_inputs, plan_stages
from planner.simulation.simulator import simulate_stages
from runtime.report import build_run_report
from tests.replay import replay_timeline
from tests.planner.files.test_run_report import (  # noqa: F401 (fixtures)
    TRUE_FACTORS, accumulated_ms, files, plan, profile, report, scaled,
)


def test_calibration_gives_back_the_true_layer_times(profile: Profile, plan: Plan, report: RunReport) -> None:
    calibrated = calibrate_profile(profile, plan, report, "plan.json")
    truth = scaled(profile, plan, TRUE_FACTORS)
    assert [layer.fwd_ms for layer in calibrated.layers] == pytest.approx([layer.fwd_ms for layer in truth.layers])
    assert [layer.bwd_ms for layer in calibrated.layers] == pytest.approx([layer.bwd_ms for layer in truth.layers])
    assert dataclasses.replace(calibrated, layers=profile.layers, size_times=profile.size_times,
                               settings=profile.settings) == profile
    # the times measured at the profile's other batch sizes take each layer's factor too
    factors = [factor for stage, factor in zip(plan.stages, TRUE_FACTORS) for _ in range(stage.start, stage.stop)]
    assert len(profile.size_times) == 3 and len(factors) == profile.num_layers
    for before, after in zip(profile.size_times, calibrated.size_times):
        assert after.batch_size == before.batch_size and after.step_ms == before.step_ms
        for name in ("fwd_ms", "bwd_ms", "bwd_input_ms"):
            assert getattr(after, name) == pytest.approx([ms * f for ms, f in zip(getattr(before, name), factors)])
    record = calibrated.settings["calibrations"][-1]
    assert record["report"] == report.source and record["plan"] == "plan.json"
    assert record["ratios"] == pytest.approx(list(TRUE_FACTORS))
    assert record["stages"] == [[stage.start, stage.stop] for stage in plan.stages]
    earlier = dataclasses.replace(profile, settings={**profile.settings, "calibrations": [{"report": "earlier"}]})
    again = calibrate_profile(earlier, plan, report)  # settings are not in the digest: still the plan's profile
    assert [entry["report"] for entry in again.settings["calibrations"]] == ["earlier", report.source]


def test_calibrated_stage_times_are_the_measured_ones(profile: Profile, plan: Plan, report: RunReport) -> None:
    calibrated = calibrate_profile(profile, plan, report)
    costs = stage_costs(plan_cost_inputs(calibrated, plan), plan_stages(plan))
    # the layer times now give what was measured; the gradient accumulation in it is left as it was
    assert [cost.compute_s * 1000.0 + accumulated_ms(plan, index) for index, cost in enumerate(costs)] == \
        pytest.approx([s.compute_ms for s in report.measured])


def test_a_plan_of_microbatches_between_measured_sizes_is_calibrated_to_its_measured_stage_times(
        profile: Profile, tmp_path: Path) -> None:
    """Microbatches of 3 samples, priced between the profile's measured 2 and 4: calibration scales the times at
    every measured size, so the interpolated stage times become the measured ones too."""
    assert profile.batch_sizes == (1, 2, 4, 8)
    plan = partition(profile, make_cluster(4, None, ["1GB/s"]), straight=True, schedule="1f1b", microbatches=4,
                     global_batch_size=12, profile_path="mlp.json")
    assert plan.microbatch_size == 3 and len(plan.stages) == 4
    truth = simulate_stages(plan_cost_inputs(scaled(profile, plan, TRUE_FACTORS), plan), plan_stages(plan))
    report = build_run_report(plan, replay_timeline(truth, 3), batch_size=12, losses=[(1, 0.5)], plan_path="plan.json")
    calibrated = calibrate_profile(profile, plan, report, "plan.json")
    costs = stage_costs(plan_cost_inputs(calibrated, plan), plan_stages(plan))
    assert [cost.compute_s * 1000.0 + accumulated_ms(plan, index) for index, cost in enumerate(costs)] == \
        pytest.approx([s.compute_ms for s in report.measured])


def test_calibration_refuses_another_profile(profile: Profile, plan: Plan, report: RunReport) -> None:
    with pytest.raises(PlanProfileMismatchError):
        calibrate_profile(scaled(profile, plan, (3.0, 1.0, 1.0, 1.0)), plan, report)


def test_calibration_refuses_a_report_of_another_plan(profile: Profile, plan: Plan, report: RunReport) -> None:
    first, second, *rest = plan.stages
    moved = dataclasses.replace(plan, stages=(dataclasses.replace(first, stop=first.stop + 1),
                                              dataclasses.replace(second, start=second.start + 1), *rest))
    with pytest.raises(ReportPlanMismatchError, match="stage layers"):
        calibrate_profile(profile, moved, report, "moved.json")
    with pytest.raises(ReportPlanMismatchError, match="schedule gpipe"):
        calibrate_profile(profile, plan, dataclasses.replace(report, schedule="gpipe"))


def test_calibration_refuses_a_run_of_another_microbatch_size(profile: Profile, plan: Plan, report: RunReport) -> None:
    with pytest.raises(RunReportError, match="2 samples"):
        calibrate_profile(profile, plan, dataclasses.replace(report, microbatch_size=2.0))


def test_the_calibration_table_names_a_stage_of_one_layer_by_its_name(plan: Plan, report: RunReport) -> None:
    first = plan.stages[0]
    one = dataclasses.replace(plan, stages=(dataclasses.replace(first, last_layer=first.first_layer),
                                            *plan.stages[1:]))
    layers = [str(cell) for cell in calibration_table(one, report, [1.0] * len(plan.stages)).columns[1]._cells]
    assert layers[0] == first.first_layer
    assert layers[1:] == [f"{stage.first_layer} .. {stage.last_layer}" for stage in plan.stages[1:]]
