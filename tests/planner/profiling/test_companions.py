"""Companion processes that train the model beside a CPU profile: started, ready, stopped, never left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner.errors import ProfileError
from planner.profiling.companions import companions
from tests.conftest import EXAMPLES

MLP = str(EXAMPLES / "mlp.py")
REPO = Path(__file__).resolve().parents[3]


def companion_pids(parent: int) -> list[int]:
    """Processes whose parent is `parent` and that run planner.profiling.companions (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and b"planner.profiling.companions" in command:
            found.append(int(entry.name))
    return found


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The `pids` still alive (not zombies) after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Whether `pid` still runs: it is there and not a zombie, or a zombie whose other threads are still ending. A
    process that exits shows its main thread as a zombie while the kernel still ends its other threads (torch's
    pool), and waitpid, and so `Popen.poll`, does not report it until they are gone: on a busy machine the
    companion's exit was seen here and then missed by the block's `poll` (3 runs in 7 beside three busy loops)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        threads = sum(1 for _ in Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    return state != "Z" or threads > 1


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_companions_train_while_the_block_runs_and_are_gone_after() -> None:
    with companions(MLP, 1, 2, 1, "float32") as ready:
        ready()  # it has taken its first steps
        pids = companion_pids(os.getpid())
        assert len(pids) == 1
        assert all(_running(pid) for pid in pids)
    assert wait_gone(pids, 0.0) == []  # stopped and reaped before the block's end returned
    with companions(MLP, 0, 2, 1, "float32") as ready:  # none: nothing starts
        ready()
        assert companion_pids(os.getpid()) == []


def test_a_companion_that_cannot_start_is_one_profile_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise OSError('dataset directory is missing')\n")
    with pytest.raises(ProfileError) as raised, companions(str(broken), 1, 2, 1, "float32") as ready:
        ready()
    message = str(raised.value)
    assert "companion" in message and "dataset directory is missing" in message and "--processes 1" in message
    assert "\n" not in message


def test_a_companion_that_does_not_start_in_time_is_stopped(tmp_path: Path) -> None:
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(60)\n")
    started = time.monotonic()
    with pytest.raises(ProfileError, match=r"did not start within 0.5 s"), \
            companions(str(slow), 1, 2, 1, "float32", timeout_s=0.5) as ready:
        ready()
    assert time.monotonic() - started < 20


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_companions_end_when_their_profiler_is_killed(tmp_path: Path) -> None:
    """A profiler killed outright (SIGKILL: no finally runs) leaves no companion training on: they exit when
    their standard input closes. (Its scratch folder stays, in the test's own temporary folder.)"""
    script = ("import sys, time\nfrom planner.profiling.companions import companions\n"
              f"with companions({MLP!r}, 1, 2, 1, 'float32') as ready:\n"
              "    ready(); print('up', flush=True); time.sleep(120)\n")
    profiler = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)})
    try:
        assert profiler.stdout is not None and profiler.stdout.readline().strip() == "up"
        pids = companion_pids(profiler.pid)
        assert len(pids) == 1
        profiler.send_signal(signal.SIGKILL)
        profiler.wait()
        assert wait_gone(pids, 15.0) == []
    finally:
        if profiler.poll() is None:
            profiler.kill()
            profiler.wait()


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks `pid` has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


HELPER_THAT_PRINTS = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
from mlp import build_model as _build, example_batch
print("a model file that talks while it loads", flush=True)
print("and one line without its end...", end="", flush=True)


def build_model():
    model = _build()
    model.register_forward_hook(lambda *_: print("x" * 4096, flush=True))  # 4 KB a step: a pipe fills in 16
    return model
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_companion_imports_with_the_profilers_sys_path_and_a_model_that_prints_does_not_stall_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model file imports a module only the profiler's sys.path finds (a script put its project folder
    there), and that module prints: at import (a whole line, a partial one), which must not delay the ready
    signal, and 4 KB every step, which must not fill a pipe that nobody reads and stall the companion."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "helper_for_companions.py").write_text(HELPER_THAT_PRINTS)
    model = tmp_path / "model.py"
    model.write_text("from helper_for_companions import build_model, example_batch\n")
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with companions(str(model), 1, 2, 1, "float32", timeout_s=60) as ready:
        ready()  # within the timeout: the signal was not left behind the model's output
        pid, = companion_pids(os.getpid())
        time.sleep(1.0)  # more than 16 steps of 4 KB
        before = cpu_ticks(pid)
        time.sleep(1.0)
        assert cpu_ticks(pid) - before >= 20  # still training: at least a fifth of a core over that second


def test_a_companion_that_stops_during_the_profile_fails_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the machine ran out of memory after the companion's first steps: the profile's times were not all
    taken beside it, so the block's normal end raises instead of recording a second process."""
    dies = tmp_path / "dies.py"
    dies.write_text(f"""
import os, sys
sys.path.insert(0, {str(EXAMPLES)!r})
from mlp import build_model as _build, example_batch
calls = []


def build_model():
    model = _build()
    def hook(*_):
        calls.append(1)
        if len(calls) == 4 and os.environ.get("DIE_IN_THE_COMPANION"):
            os._exit(137)
    model.register_forward_hook(hook)
    return model
""")
    monkeypatch.setenv("DIE_IN_THE_COMPANION", "1")  # the companion's environment: it dies, not this process
    with pytest.raises(ProfileError) as raised, companions(str(dies), 1, 2, 1, "float32") as ready:
        ready()
        assert wait_gone(companion_pids(os.getpid()), 60.0) == []  # it died on its fourth forward
    message = str(raised.value)
    assert "stopped before the profile was done" in message and "exit status 137" in message, message
    assert "\n" not in message
