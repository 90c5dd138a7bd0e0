"""Runs notebooks/plan_visualization.ipynb headless (nbclient, the `python3` kernel) and checks what it shows.

The notebook is committed without outputs; here it is executed in memory (nothing is written to
the repository) and any cell error fails the test (nbclient raises CellExecutionError).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

nbclient = pytest.importorskip(
    "nbclient", reason="nbclient is not installed (a dev extra): pip install -c constraints.txt -e '.[dev]'"
)
import nbformat  # a dependency of nbclient, so importable whenever nbclient is

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "plan_visualization.ipynb"
CELL_TIMEOUT_S = 180  # per cell; the whole notebook takes about 25 s on 2 CPU cores
# plan.plot, timeline.plot, partition_figure, memory_figure, one gantt_figure per schedule (3), scaling_figure
EXPECTED_IMAGES = 8
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "pipedream")


def _execute(notebook: Any, working_dir: Path) -> Any:
    """Execute `notebook` in place with the `python3` kernel, started in `working_dir`."""
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
        resources={"metadata": {"path": str(working_dir)}},
    )
    client.execute()
    return notebook


def _tagged(notebook: Any, tag: str) -> Any:
    """The one cell carrying `tag` in its metadata."""
    found = [cell for cell in notebook.cells if tag in cell.get("metadata", {}).get("tags", [])]
    assert len(found) == 1, f"expected one cell tagged {tag!r}, found {len(found)}"
    return found[0]


def _result_html(cell: Any) -> str:
    """The text/html of the cell's execute_result (what the cell's last expression displayed)."""
    results = [output for output in cell.outputs if output.output_type == "execute_result"]
    assert results, f"cell {cell.get('id')} displayed no result"
    assert "text/html" in results[-1].data, f"cell {cell.get('id')} result has no HTML: {list(results[-1].data)}"
    return results[-1].data["text/html"]


def _stdout(cell: Any) -> str:
    return "".join(output.text for output in cell.outputs if output.output_type == "stream" and output.name == "stdout")


def _repo_listing() -> set[str]:
    """Files at the top of the repository and in the folders the notebook could write to."""
    names = {path.name for path in REPO.iterdir()}
    for folder in ("notebooks", "plans", "profiles"):
        if (REPO / folder).is_dir():
            names |= {f"{folder}/{path.name}" for path in (REPO / folder).iterdir()}
    return names


@pytest.fixture(scope="module")
def executed() -> Any:
    """The notebook executed from the repository root, plus one appended cell reporting the kernel's interpreter."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    probe = nbformat.v4.new_code_cell("import sys\nprint(sys.prefix)\nprint(sys.executable)")
    probe.metadata["tags"] = ["test-interpreter"]
    notebook.cells.append(probe)
    before = _repo_listing()
    _execute(notebook, REPO)
    assert _repo_listing() == before, "the notebook wrote into the repository (plans belong in a temporary folder)"
    return notebook


def test_committed_notebook_has_no_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code), (
        "commit the notebook with outputs cleared (Jupyter: Edit > Clear Outputs of All Cells)"
    )


@pytest.mark.slow
def test_kernel_is_this_interpreter(executed: Any) -> None:
    prefix, executable = _stdout(_tagged(executed, "test-interpreter")).splitlines()
    assert prefix == sys.prefix, f"the python3 kernel ran in {prefix}, not in this environment ({sys.prefix})"
    assert executable == sys.executable


@pytest.mark.slow
def test_no_cell_failed(executed: Any) -> None:
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), "some cells did not run"
    assert not [output for cell in code for output in cell.outputs if output.output_type == "error"]


@pytest.mark.slow
def test_profiles_and_plans_show_html_tables(executed: Any) -> None:
    for tag in ("profile-fresh", "profile-shipped"):
        html = _result_html(_tagged(executed, tag))
        assert "<table" in html and "transformer.h.11" in html and "lm_head" in html, tag
    for tag, gpus in (("plan-4gpu", 4), ("plan-8gpu", 8)):
        html = _result_html(_tagged(executed, tag))
        assert "<table" in html and f"on {gpus} GPUs" in html, tag
        stages = len(re.findall(r"<tr>", html.split("<tbody>", 1)[1]))
        assert stages >= 2, f"{tag}: expected a pipeline of several stages, got {stages}"
    shipped = _stdout(_tagged(executed, "profile-shipped"))
    assert "measured just now" in shipped and "shipped profile" in shipped


@pytest.mark.slow
def test_figures_render_as_png(executed: Any) -> None:
    images = [output for cell in executed.cells if cell.cell_type == "code" for output in cell.outputs
              if "image/png" in output.get("data", {})]
    assert len(images) >= EXPECTED_IMAGES, f"expected {EXPECTED_IMAGES} PNG figures, found {len(images)}"
    shown_as_text = [output.data["text/plain"] for cell in executed.cells if cell.cell_type == "code"
                     for output in cell.outputs if output.get("data", {}).get("text/plain", "").startswith("<Figure")
                     and "image/png" not in output.data]
    assert not shown_as_text, f"figures shown as text instead of images: {shown_as_text}"


@pytest.mark.slow
def test_schedule_comparison_has_one_row_per_schedule(executed: Any) -> None:
    html = _result_html(_tagged(executed, "schedule-comparison"))
    body = html.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    rows = re.findall(r"<tr>\s*<th>([^<]*)</th>", body)
    assert rows == list(SCHEDULES)
    for column in ("samples/s", "iteration ms", "bubble fraction", "peak memory MB"):
        assert f"<th>{column}</th>" in html


@pytest.mark.slow
def test_scaling_table_lists_gpu_counts(executed: Any) -> None:
    html = _result_html(_tagged(executed, "scaling-table"))
    body = html.split("<tbody>", 1)[1]
    gpus = [int(value) for value in re.findall(r"<tr>\s*<th>\d+</th>\s*<td>(\d+)</td>", body)]
    assert gpus == [1, 2, 4, 8]


@pytest.mark.slow
def test_setup_cell_finds_the_repository_from_notebooks_dir() -> None:
    """Started in notebooks/ (as `jupyter lab` there would), the setup cell still finds the repository root."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    setup = next(cell for cell in notebook.cells if cell.cell_type == "code")
    check = nbformat.v4.new_code_cell("print(ROOT)\nprint(Path.cwd())")
    notebook.cells = [setup, check]
    _execute(notebook, REPO / "notebooks")
    root, cwd = _stdout(check).splitlines()
    assert Path(root) == REPO.resolve()
    assert Path(cwd).resolve() == (REPO / "notebooks").resolve()
