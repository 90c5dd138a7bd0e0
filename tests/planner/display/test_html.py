"""HTML tables for Jupyter: Plan._repr_html_ and Profile._repr_html_, and the Plan/Timeline plot methods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from planner.files.cluster import make_cluster
from planner.errors import PlannerError
from planner.display.html import MAX_PROFILE_ROWS
from planner.planning.partition import partition
from planner.files.pipedream import import_pipedream
from planner.files.profile import load_profile

REPO = Path(__file__).resolve().parents[3]
GPT = REPO / "profiles" / "gpt.json"
PIPEDREAM_GRAPH = REPO.parent / "shared" / "pipedream-profiles" / "nasnetamobile.txt"


def body_rows(html_text: str) -> int:
    """Rows in the table body."""
    return len(re.findall(r"<tr>", html_text.split("<tbody>", 1)[1]))


def test_plan_html_has_one_row_per_stage_and_the_predictions() -> None:
    profile = load_profile(GPT)
    plan = partition(profile, make_cluster(4, None, ["10GB/s"], "0.1GB"), profile_path=str(GPT))
    text = plan._repr_html_()
    assert body_rows(text) == len(plan.stages) > 1
    cells = re.findall(r"<td>([^<]*)</td>", text)
    width = len(cells) // len(plan.stages)
    rows = [cells[index * width:(index + 1) * width] for index in range(len(plan.stages))]
    assert [row[1] for row in rows] == [s.first_layer if s.stop - s.start == 1 else f"{s.first_layer} .. {s.last_layer}"
                                        for s in plan.stages]
    assert [int(row[3]) for row in rows] == [stage.replicas for stage in plan.stages]
    assert f"{plan.predicted.samples_per_s:.4g} samples/s" in text
    assert all(note.replace("'", "&#x27;") in text for note in plan.notes if "<" not in note)


def test_profile_html_has_one_row_per_layer() -> None:
    profile = load_profile(GPT)
    text = profile._repr_html_()
    assert body_rows(text) == profile.num_layers
    assert all(layer.name in text for layer in profile.layers)


@pytest.mark.skipif(not PIPEDREAM_GRAPH.is_file(), reason="../shared/pipedream-profiles is not present")
def test_long_profiles_are_shortened() -> None:
    profile = import_pipedream(PIPEDREAM_GRAPH)
    assert profile.num_layers > MAX_PROFILE_ROWS
    assert body_rows(profile._repr_html_()) == MAX_PROFILE_ROWS + 1  # first and last rows, and "..."


def test_plan_plot_and_simulate_find_the_recorded_profile(tmp_path: Path) -> None:
    profile = load_profile(GPT)
    plan = partition(profile, make_cluster(4, None, ["10GB/s"], "0.1GB"), profile_path=str(GPT))
    assert isinstance(plan.plot(), Figure)
    timeline = plan.simulate(iterations=2)
    assert timeline.iteration_s() * 1000.0 == pytest.approx(plan.predicted.iteration_ms, rel=0.02)
    assert isinstance(timeline.plot(communication=True), Figure)
    moved = partition(profile, make_cluster(4, None, ["10GB/s"]), profile_path=str(tmp_path / "gone.json"))
    with pytest.raises(PlannerError, match="gone.json"):
        moved.plot()
    assert isinstance(moved.plot(profile), Figure)
