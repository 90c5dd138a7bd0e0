"""planner train's launcher: what can be checked in this process (here: that the model can be split) is one line
on stderr, exit 1, and no torchrun job starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from planner.files.cluster import make_cluster
from planner.files.plan import Plan
from planner.profiling.conditions import STEADY_MALLOC
from planner.profiling.model_file import load_model_file
from planner.planning.partition import partition
from planner.profiling.profiler import ProfileSettings, profile_model

REPO = Path(__file__).resolve().parents[2]
ROUTED = REPO / "tests" / "data" / "models" / "routed.py"


@pytest.mark.slow
def test_a_model_no_split_can_capture_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    profile = profile_model(load_model_file(ROUTED), ProfileSettings(batch_size=4, warmup=1, iters=1, threads=1,
                                                                     processes=1))
    profile_path = profile.save(tmp_path / "routed.json")
    plan = partition(profile, make_cluster(2), straight=True, schedule="1f1b", microbatches=2)
    assert len(plan.stages) == 2
    plan_path = plan.save(tmp_path / "routed-2.json")
    assert profile_path.exists()
    finished = subprocess.run([sys.executable, "-m", "planner", "train", str(ROUTED), "--plan", str(plan_path),
                               "--steps", "1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert finished.returncode == 1
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1, finished.stderr
    branch = 1 + next(number for number, line in enumerate(ROUTED.read_text().splitlines()) if "if x.abs()" in line)
    assert lines[0].startswith("error: cannot split Routed:") and f"routed.py:{branch}" in lines[0]
    assert "--split-points" in lines[0]
    assert "torch.distributed" not in finished.stderr  # torchrun never ran


def test_the_launcher_reads_the_profiles_conditions_and_says_what_differs(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch
    from runtime.launch import _plan_profile, _warn_differences

    monkeypatch.setattr(runtime.launch, "busy_cores", lambda: 0.0)  # a quiet machine (the next test: a busy one)

    profile = profile_model(load_model_file(REPO / "examples" / "mlp.py"),
                            ProfileSettings(batch_size=4, warmup=0, iters=1, threads=2))
    path = profile.save(tmp_path / "mlp.json")
    plan = partition(profile, make_cluster(2), straight=True, schedule="1f1b", microbatches=2, profile_path=str(path))
    profiled = _plan_profile(plan).settings.get("conditions")
    assert profiled is not None and profiled["threads"] == 2
    # as if measured on a quiet machine: the other pytest worker's load is its own warning (test_conditions.py)
    profiled = {**profiled, "others_busy_cores": 0.0}
    _warn_differences(profiled, {**profiled, "threads": 1}, str(path))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the profile was measured with 2 threads per process")
    _warn_differences(profiled, dict(profiled), str(path))
    assert capsys.readouterr().err == ""
    path.unlink()
    assert _plan_profile(plan) is None  # the profile is gone: nothing to compare
    _warn_differences(None, profiled, str(path))
    assert f"the plan's profile {path} is not there" in capsys.readouterr().err


def test_a_cpu_job_on_a_busy_machine_is_warned(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # two `planner train` jobs started at once on the 2-core machine took 13 s for a step of 77 ms, with nothing said
    import runtime.launch

    training = {"threads": 2, "processes": 1, "cores": 2}
    monkeypatch.setattr(runtime.launch, "busy_cores", lambda: 1.6)
    runtime.launch._warn_differences(dict(training), dict(training), "p.json")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("warning: 1.6 of this machine's ") and "cores were busy before the job started" in line
    assert "the job's 1 x 2 outnumber the cores" in line
    runtime.launch._warn_differences(dict(training), {**training, "processes": None}, "p.json")  # GPUs: no check
    assert capsys.readouterr().err == ""


def test_measuring_the_cluster_on_a_busy_machine_is_warned_before_the_processes_start(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # the probe's message and all-reduce times become the cluster file every plan is priced with
    import torch.distributed.run

    import runtime.launch
    from planner.profiling.conditions import STEADY_MALLOC

    for name, value in {"OMP_NUM_THREADS": "1", **STEADY_MALLOC}.items():  # what run_module sets, restored after
        monkeypatch.setenv(name, value)
    started: list[list[str]] = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: started.append(args.training_script_args))
    monkeypatch.setattr(runtime.launch, "busy_cores", lambda: 1.2)
    runtime.launch.measure_cluster("c.json")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("warning: 1.2 of this machine's ") and "the 2 measuring processes share them" in line
    assert started == [["--out", "c.json"]]
    monkeypatch.setattr(runtime.launch, "busy_cores", lambda: 0.1)
    runtime.launch.measure_cluster("c.json", quick=True)
    assert capsys.readouterr().err == "" and started[-1] == ["--out", "c.json", "--quick"]


@pytest.mark.parametrize("gpus, fix", [(1, "one GPU has no link to another to measure"), (2, "use --nproc 2")])
def test_measuring_the_cluster_on_fewer_gpus_than_processes_says_so_before_any_starts(
        monkeypatch: pytest.MonkeyPatch, gpus: int, fix: str) -> None:
    # NCCL takes one GPU per process: rank 1 of 2 on a one-GPU machine would fail in torch with a traceback
    import torch.distributed.run

    import runtime.launch
    from planner.errors import PlannerError

    monkeypatch.setattr(torch.distributed.run, "run", lambda args: pytest.fail("no process may start"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(PlannerError, match=rf"--nproc 3 needs 3 GPUs .* this machine has {gpus}: {fix}"):
        runtime.launch.measure_cluster("c.json", nproc=3)


@pytest.mark.parametrize("cpu, processes", [(True, 3), (False, None)])
def test_the_workers_conditions_count_processes_on_a_cpu_and_none_on_gpus(monkeypatch: pytest.MonkeyPatch, cpu: bool,
                                                                          processes: int | None) -> None:
    """As a profile records them: processes share a CPU's caches; on GPUs each rank computes on its own device."""
    import torch.distributed.run

    from runtime.launch import run_module

    launched: list[object] = []
    monkeypatch.setattr(torch.distributed.run, "run", launched.append)  # no job: the arguments only
    for name, value in {"OMP_NUM_THREADS": "1", **STEADY_MALLOC}.items():
        monkeypatch.setenv(name, value)  # what run_module sets where unset, undone after the test
    seen: list[dict] = []
    run_module("runtime.train", ["m.py"], 3, cpu=cpu, before=seen.append)
    assert [conditions["processes"] for conditions in seen] == [processes] and len(launched) == 1


def test_planner_train_says_what_the_plans_microbatches_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # a profile that found batch norm: a plan of 4 microbatches trains differently from plain PyTorch on its batch
    import dataclasses

    import runtime.launch
    from planner.files.profile import BatchCoupling, load_profile
    from runtime.launch import launch

    profile = dataclasses.replace(load_profile(REPO / "profiles" / "mlp.json"),
                                  batch_coupling=BatchCoupling(("2",), None))
    path = profile.save(tmp_path / "mlp.json")
    plan = partition(profile, make_cluster(2), straight=True, schedule="1f1b", microbatches=4, profile_path=str(path))
    note = ("note: batch norm (1 module: 2) normalises each microbatch of 8 samples with that microbatch's statistics, "
            "and moves running statistics once per microbatch: training differs from plain PyTorch on batches of 32")
    # `planner train` says it before the job starts (the job itself left out here)
    started: list[str] = []
    monkeypatch.setattr(runtime.launch, "run_module", lambda module, *args, **kwargs: started.append(module))

    def notes_of(trained: Plan) -> list[str]:
        launch([str(REPO / "examples" / "mlp.py"), "--plan", str(trained.save(tmp_path / "plan.json")), "--steps", "1"])
        return [line for line in capsys.readouterr().err.splitlines() if "batch norm" in line]

    assert notes_of(plan) == [note] and started == ["runtime.train"]
    whole = partition(profile, make_cluster(1), schedule="gpipe", microbatches=1, profile_path=str(path))
    assert notes_of(whole) == []  # the batch is not cut
    path.unlink()
    assert notes_of(plan) == []  # no profile to ask


@pytest.mark.parametrize("module, fails", [("platform", False), ("no_such_module_here", True)])
def test_a_job_leaves_nothing_in_the_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str,
                                                      fails: bool) -> None:
    """torchrun given no log folder makes /tmp/torchelastic_* on every run and never removes it (400 of them piled up
    on the test machine in a day); run_module gives it one that goes when the job ends, failed or not, and a failed
    rank's exit code still reaches the error."""
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from runtime.launch import run_module

    for name, value in {"OMP_NUM_THREADS": "1", **STEADY_MALLOC}.items():
        monkeypatch.setenv(name, value)  # what run_module sets where unset, undone after the test
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if fails:
        with pytest.raises(ChildFailedError) as failed:
            run_module(module, [], 1)
        assert [failure.exitcode for failure in failed.value.failures.values()] == [1]
    else:
        run_module(module, [], 1)  # `python -m platform` prints a line and exits 0
    assert list(tmp_path.iterdir()) == []
