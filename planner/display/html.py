"""Rich HTML tables of plans and profiles for Jupyter (`_repr_html_`), built with pandas (pure)."""

from __future__ import annotations

import html

import pandas as pd

from planner.files.plan import Plan
from planner.files.profile import Profile
from planner.display.tables import (
    allreduce_cell, memory_cell, plan_summary, profile_summary, rank_range, tied_footnote,
)
from planner.units import format_bytes, name_range, plural

MAX_PROFILE_ROWS = 60  # longer profiles show their first and last rows


def plan_html(plan: Plan) -> str:
    """The plan's stage table (times in ms per microbatch, memory per device) under its summary and notes."""
    rows = [
        {
            "stage": index, "layers": name_range(stage.first_layer, stage.last_layer), "#": stage.stop - stage.start,
            "replicas": stage.replicas, "ranks": rank_range(stage.ranks), "compute ms": round(stage.compute_ms, 4),
            "comm ms": round(stage.comm_ms, 4), "all-reduce ms": allreduce_cell(stage),
            "period ms": round(stage.period_ms, 4), "memory/GPU": memory_cell(stage.memory_bytes, plan.cluster.memory_bytes),
            "recompute": "yes" if stage.recompute else "no",
        }
        for index, stage in enumerate(plan.stages)
    ]
    title = (f"{plan.profile.name}: {plural(len(plan.stages), 'stage')} on {plan.cluster.describe()} "
             f"({plan.cost_model} cost model)")
    tied = tied_footnote(plan)
    summary = plan_summary(plan) + (f"\n{tied}" if tied else "")
    return _titled(title, pd.DataFrame(rows).to_html(index=False), summary)


def profile_html(profile: Profile) -> str:
    """The profile's layer table (ms per mini-batch, bytes in binary units; `bwd_input_ms` only where
    measured) under its summary."""
    frame = profile.to_dataframe()
    for column in ("output_bytes", "cut_bytes", "param_bytes", "saved_bytes"):
        frame[column] = frame[column].map(format_bytes)
    if frame["bwd_input_ms"].isna().all():  # not measured (older and imported profiles)
        frame = frame.drop(columns="bwd_input_ms")
    times = [column for column in ("fwd_ms", "bwd_ms", "bwd_input_ms") if column in frame]
    frame[times] = frame[times].astype(float).round(4)
    table = frame.to_html(max_rows=MAX_PROFILE_ROWS)
    return _titled(f"{profile.model_name}: {profile.num_layers} layers", table, profile_summary(profile))


def _titled(title: str, table: str, summary: str) -> str:
    """A bold title, the table, then the summary lines (escaped)."""
    lines = "<br>".join(html.escape(line) for line in summary.splitlines())
    return f"<div><b>{html.escape(title)}</b>{table}<p style='font-size:smaller'>{lines}</p></div>"
