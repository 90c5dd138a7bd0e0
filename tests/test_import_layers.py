"""The planner's import layers (pyproject.toml [tool.importlinter]) hold: imports point down the data flow."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint(root: Path) -> subprocess.CompletedProcess:
    """import-linter run on the repository at `root` with the project's contracts."""
    script = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())"
    return subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": ""}, check=False)


def test_the_layer_contracts_are_kept() -> None:
    finished = lint(REPO)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "2 kept, 0 broken" in finished.stdout


def test_an_import_up_the_layers_is_caught(tmp_path: Path) -> None:
    """A file type importing a plot module at the top of its file breaks the contract."""
    copy = tmp_path / "repo"
    for package in ("planner", "runtime"):
        shutil.copytree(REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    profile = copy / "planner" / "files" / "profile.py"
    profile.write_text(profile.read_text().replace("from __future__ import annotations\n",
                                                   "from __future__ import annotations\n\nimport planner.display.plots\n", 1))
    finished = lint(copy)
    assert finished.returncode != 0
    assert "planner.files.profile -> planner.display.plots" in finished.stdout
