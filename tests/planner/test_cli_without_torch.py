"""The commands that only read and write files run where torch cannot be imported; --help imports no heavy library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from planner.files.cluster import make_cluster
from planner.files.profile import load_profile
from planner.planning.partition import partition
from planner.simulation.plan_simulation import plan_cost_inputs, plan_stages
from planner.simulation.simulator import simulate_stages

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # `import name` raises ImportError
import typer.main
from planner.cli import app
command = typer.main.get_command(app)
for args in json.loads(sys.argv[2]):
    code = command.main(args, prog_name="planner", standalone_mode=False)  # an exit code, or None
    if code:
        sys.exit(f"planner {' '.join(args)} exited with {code}")
print("blocked and still imported:", [name for name in sys.argv[1].split(",") if sys.modules.get(name) is not None])
"""


def run_blocked(blocked: tuple[str, ...], commands: list[list[str]], cwd: Path) -> subprocess.CompletedProcess:
    """`planner` commands run in one fresh interpreter in which every module of `blocked` fails to import."""
    return subprocess.run([sys.executable, "-c", CHILD, ",".join(blocked), json.dumps(commands)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""},
                          check=False)


def test_help_imports_no_heavy_library(tmp_path: Path) -> None:
    finished = run_blocked(("torch", "numpy", "pandas", "matplotlib", "scipy"),
                           [["--help"], ["partition", "--help"], ["train", "--help"], ["profile", "--help"]], tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "Profile a PyTorch model" in finished.stdout and "--microbatch-size" in finished.stdout


def test_file_commands_run_without_torch(tmp_path: Path) -> None:
    """partition, inspect, simulate, show, export, compare, calibrate and import-pipedream, torch blocked."""
    from runtime.report import build_run_report, write_run_report  # the parent may use torch
    from tests.replay import replay_timeline

    profile = load_profile(REPO / "profiles" / "mlp.json")
    profile_path = profile.save(tmp_path / "mlp.json")
    plan = partition(profile, make_cluster(2, None, ["1GB/s"]), straight=True, schedule="1f1b", microbatches=2,
                     profile_path=str(profile_path))
    plan_path = plan.save(tmp_path / "given.json")
    timeline = simulate_stages(plan_cost_inputs(profile, plan), plan_stages(plan))
    report = build_run_report(plan, replay_timeline(timeline, 3), batch_size=2 * plan.microbatch_size,
                              losses=[(1, 0.5)], plan_path=str(plan_path))
    report_path = write_run_report(tmp_path / "run.json", report)
    commands = [
        ["import-pipedream", str(REPO / "tests" / "data" / "pipedream_skip.txt"), "-o", "imported.json"],
        ["inspect", "imported.json"],
        ["partition", str(profile_path), "--gpus", "2", "--schedule", "1f1b", "-o", "plan.json", "--compare"],
        ["simulate", "plan.json", "--trace", "trace.json"],
        ["show", "plan.json", "-o", "plan.png"],
        ["export", "plan.json", "--to", "pippy"],
        ["compare", str(plan_path), str(report_path), "-o", "compare.png"],
        ["calibrate", str(profile_path), str(report_path), "--plan", str(plan_path), "-o", "calibrated.json"],
    ]
    finished = run_blocked(("torch",), commands, tmp_path)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    assert "blocked and still imported: []" in finished.stdout
    for written in ("imported.json", "plan.json", "trace.json", "plan.png", "plan.pippy.json", "plan.pippy.py",
                    "compare.png", "calibrated.json"):
        assert (tmp_path / written).stat().st_size > 0, written
