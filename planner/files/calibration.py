"""Calibration: a profile's layer times scaled by what a run measured against its plan's predictions."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from rich import box
from rich.table import Table

from planner.files.plan import Plan
from planner.files.profile import Profile
from planner.files.run_report import RunReport, RunReportError, check_report_plan
from planner.units import format_ms, name_range

__all__ = ["calibrate_profile", "calibration_ratios", "calibration_table"]


def calibration_ratios(plan: Plan, report: RunReport, plan_path: str = "<plan>") -> tuple[float, ...]:
    """Per stage: measured compute_ms, less the gradient accumulation the plan predicts in it
    (`Plan.mean_compute_ms`), over the plan's compute_ms (1.0 where the plan predicts 0), after
    checking that the report measured this plan (`check_report_plan`) at its microbatch size."""
    check_report_plan(report, plan, plan_path)
    if plan.microbatch_size is not None and abs(report.microbatch_size - plan.microbatch_size) > 1e-9:
        raise RunReportError(f"{report.source}: the run's microbatches have {report.microbatch_size:g} samples, "
                             f"the plan's {plan.microbatch_size} ({plan_path}): their compute times do not compare; "
                             "run the plan's microbatch size to calibrate")
    ratios = []
    for index, (found, stage) in enumerate(zip(report.measured, plan.stages)):
        if stage.compute_ms <= 0:
            ratios.append(1.0)
            continue
        if not found.compute_ms > 0 or not math.isfinite(found.compute_ms):
            raise RunReportError(f"{report.source}: stage {index} measured {found.compute_ms} ms of compute per "
                                 "microbatch; cannot calibrate from a stage that was not timed")
        accumulated = plan.mean_compute_ms(index) - stage.compute_ms  # gradient accumulation: not layer time
        ratios.append(max(found.compute_ms - accumulated, 0.0) / stage.compute_ms)
    return tuple(ratios)


def calibrate_profile(profile: Profile, plan: Plan, report: RunReport, plan_path: str = "<plan>",
                      profile_path: str = "<profile>") -> Profile:
    """`profile` with each stage's layers' fwd_ms, bwd_ms and bwd_input_ms multiplied by that stage's ratio
    measured / predicted compute_ms (`calibration_ratios`); everything else kept, and
    `settings["calibrations"]` extended with the report, plan and ratios; the times measured at other
    batch sizes (`size_times`) by the same factors. Afterwards the cost model's compute time of each of
    the plan's stages equals the measured one (it is linear in the layer times, the recomputed forward
    included, and a microbatch size between measured sizes interpolates them linearly). The plan must have been made from `profile`
    (PlanProfileMismatchError) and the report must be of a run of the plan (ReportPlanMismatchError).

    Calibration helps when the profile was measured under other conditions than training: other
    thread counts, ranks contending for one machine's cores or memory bandwidth, other kernels or
    fusion inside a stage than layer by layer, another microbatch size than profiled (times do
    not scale linearly). It does not help when the plan is communication-bound (only compute is
    calibrated; fix the cluster's bandwidths instead), and it is misleading from a one-off noisy
    run (check the report's step times spread and use several warm steps). Every layer of a stage
    gets one factor, so re-planning with other cuts inside a stage inherits that average.
    """
    plan.check_profile(profile, plan_path, profile_path)
    ratios = calibration_ratios(plan, report, plan_path)
    factors = [1.0] * profile.num_layers
    for stage, ratio in zip(plan.stages, ratios):
        factors[stage.start:stage.stop] = [ratio] * (stage.stop - stage.start)
    layers = tuple(dataclasses.replace(layer, fwd_ms=layer.fwd_ms * factor, bwd_ms=layer.bwd_ms * factor,
                                       bwd_input_ms=None if layer.bwd_input_ms is None else layer.bwd_input_ms * factor)
                   for layer, factor in zip(profile.layers, factors))
    sized = tuple(dataclasses.replace(times, fwd_ms=_scaled(times.fwd_ms, factors), bwd_ms=_scaled(times.bwd_ms, factors),
                                      bwd_input_ms=_scaled(times.bwd_input_ms, factors))
                  for times in profile.size_times)
    record = {"report": report.source, "plan": plan_path, "stages": [[s.start, s.stop] for s in plan.stages],
              "ratios": list(ratios)}
    settings = {**profile.settings, "calibrations": [*profile.settings.get("calibrations", []), record]}
    return dataclasses.replace(profile, layers=layers, size_times=sized, settings=settings)


def _scaled(times_ms: Sequence[float], factors: Sequence[float]) -> tuple[float, ...]:
    """Each layer's time times its factor (an empty tuple, times not measured, stays empty)."""
    return tuple(ms * factor for ms, factor in zip(times_ms, factors))


def calibration_table(plan: Plan, report: RunReport, ratios: Sequence[float]) -> Table:
    """Per stage: its layers, the plan's and the measured compute per microbatch, the factor applied."""
    table = Table(title=f"{report.profile_name}: layer times scaled per stage by measured / predicted compute",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for header, justify in (("stage", "right"), ("layers", "left"), ("predicted ms", "right"),
                            ("measured ms", "right"), ("factor", "right")):
        table.add_column(header, justify=justify, no_wrap=header != "layers", overflow="fold")
    for index, (stage, found, ratio) in enumerate(zip(plan.stages, report.measured, ratios)):
        table.add_row(str(index), name_range(stage.first_layer, stage.last_layer), format_ms(stage.compute_ms),
                      format_ms(found.compute_ms), f"x{ratio:.3g}")
    return table

