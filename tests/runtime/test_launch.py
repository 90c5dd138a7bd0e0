"""planner train's launcher: what can be checked in this process (here: that the model can be split) is one line
on stderr, exit 1, and no torchrun job starts; Ctrl-C is one line too, exit 130, with nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

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
    from runtime.launch import _warn_differences
    from runtime.train import _plan_profile

    monkeypatch.setattr(runtime.launch, "busy_cores", lambda: 0.0)  # a quiet machine (the next test: a busy one)

    # (one thread: two threads' profile took 3.5 s alone and 30 s beside the other pytest worker's torchrun jobs)
    profile = profile_model(load_model_file(REPO / "examples" / "mlp.py"),
                            ProfileSettings(batch_size=4, warmup=0, iters=1, threads=1))
    path = profile.save(tmp_path / "mlp.json")
    plan = partition(profile, make_cluster(2), straight=True, schedule="1f1b", microbatches=2, profile_path=str(path))
    profiled = _plan_profile(plan, "p.json").settings.get("conditions")
    assert profiled is not None and profiled["threads"] == 1
    # as if measured on a quiet machine: the other pytest worker's load is its own warning (test_conditions.py)
    profiled = {**profiled, "others_busy_cores": 0.0, "cores": 2}
    _warn_differences(profiled, {**profiled, "threads": 2}, str(path))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the profile was measured with 1 thread per process")
    _warn_differences(profiled, dict(profiled), str(path))
    assert capsys.readouterr().err == ""
    path.unlink()
    assert _plan_profile(plan, "p.json") is None  # the profile is gone: nothing to compare
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


# --- Ctrl-C ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_under_torchruns_launcher_is_a_keyboard_interrupt_and_leaves_the_process_as_it_was(
        monkeypatch: pytest.MonkeyPatch, signum: signal.Signals) -> None:
    """torchrun's launcher would raise SignalException (a traceback, after its warnings); run_module handles SIGINT
    and SIGTERM itself while the job runs (torchrun is told to leave them alone), calls on_interrupt, raises JobStopped
    (a KeyboardInterrupt with the exit code a shell gives that signal), and puts back the handlers and the
    environment; the workers get the variables asked for."""
    import torch.distributed.run

    from runtime.launch import JobStopped, run_module

    for name, value in {"OMP_NUM_THREADS": "1", **STEADY_MALLOC}.items():
        monkeypatch.setenv(name, value)  # what run_module sets where unset, undone after the test
    seen: dict[str, str | None] = {}

    def interrupted(args: object) -> None:  # the job: the signal while it runs
        seen.update({name: os.environ.get(name) for name in ("PLANNER_TEST", "PET_SIGNALS_TO_HANDLE")})
        os.kill(os.getpid(), signum)
        time.sleep(10)
        pytest.fail(f"{signum.name} did not end the job")

    monkeypatch.setattr(torch.distributed.run, "run", interrupted)
    handlers, environment = [signal.getsignal(each) for each in (signal.SIGINT, signal.SIGTERM)], dict(os.environ)
    told: list[bool] = []
    with pytest.raises(JobStopped) as stopped:
        run_module("runtime.train", ["m.py"], 2, variables={"PLANNER_TEST": "1"}, on_interrupt=lambda: told.append(True))
    assert isinstance(stopped.value, KeyboardInterrupt) and stopped.value.exit_code == 128 + signum
    assert str(stopped.value) == {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}[signum]
    assert seen == {"PLANNER_TEST": "1", "PET_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT"} and told == [True]
    assert [signal.getsignal(each) for each in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert dict(os.environ) == environment


def test_the_line_of_an_interrupted_job_says_where_it_stopped_and_what_resumes_it(tmp_path: Path) -> None:
    from runtime.checkpoint import save_stage, write_manifest
    from runtime.launch import _interruption

    noted, folder = tmp_path / "interrupted", tmp_path / "checkpoints"
    assert _interruption(noted, str(folder)) == "interrupted before training started"  # before the workers started
    noted.touch()
    assert _interruption(noted, str(folder)) == "interrupted before training started"  # rank 0 wrote no step
    noted.write_text("7")
    assert _interruption(noted, None) == ("interrupted: training stopped after step 7; no checkpoint was written "
                                          "(use --checkpoint-dir DIR --checkpoint-every K to keep progress)")
    save_stage(folder, 6, 0, model_state={}, optimizer_state=None, rng_state={}, plan_digest="d")
    write_manifest(folder, 6, num_stages=1, plan_digest="d")
    assert _interruption(noted, str(folder)) == (f"interrupted: training stopped after step 7; the last complete "
                                                 f"checkpoint is {folder / 'step-00000006'}: continue with --resume")
    assert _interruption(noted, str(folder), "terminated").startswith("terminated: training stopped after step 7; ")


def mlp_plan_file(tmp_path: Path) -> Path:
    """The straight 2-stage mlp plan of profiles/mlp.json (1f1b, 4 microbatches)."""
    from planner.files.profile import load_profile

    plan = partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(2), straight=True, schedule="1f1b",
                     microbatches=4, profile_path=str(REPO / "profiles" / "mlp.json"))
    return plan.save(tmp_path / "mlp-2.json")


def test_sigterm_while_the_model_is_built_is_one_line_too(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Before torchrun's launcher runs (the model built and split here, a while for a big one), SIGTERM ended the
    launcher without a word: now JobStopped, "terminated", exit 143, and the handler is put back after."""
    import runtime.launch as launch_module

    def building(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        pytest.fail("SIGTERM did not stop the launcher")

    monkeypatch.setattr(launch_module, "check_setup", building)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(launch_module.JobStopped) as stopped:
        launch_module.launch([str(REPO / "examples" / "mlp.py"), "--plan", str(mlp_plan_file(tmp_path))])
    assert str(stopped.value) == "terminated" and stopped.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is handler


def test_ctrl_c_before_torchrun_took_over_still_says_training_had_not_started(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A plain KeyboardInterrupt out of run_module (Ctrl-C before its own handler is in place) is the same line as
    one after: "interrupted before training started", exit 130."""
    import runtime.launch as launch_module

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_module, "run_module", interrupted)
    with pytest.raises(launch_module.JobStopped) as stopped:
        launch_module.launch([str(REPO / "examples" / "mlp.py"), "--plan", str(mlp_plan_file(tmp_path))])
    assert str(stopped.value) == "interrupted before training started" and stopped.value.exit_code == 130


def interrupted_training(tmp_path: Path, ready: Callable[[subprocess.Popen], bool],
                         signum: signal.Signals = signal.SIGINT) -> tuple[int, list[str]]:
    """`planner train` of the mlp plan (checkpoints every 2 steps into tmp_path/checkpoints), sent SIGINT as a
    terminal's Ctrl-C is (to its process group; torchrun starts each worker in a session of its own) once `ready`,
    or SIGTERM as `kill` or `timeout` send it (to the launcher's process alone); its exit code and its lines on
    stderr but the warnings and notes, once no worker of it is left."""
    from test_train import environment, kill_job, wait_for, worker_pid

    job = subprocess.Popen([sys.executable, "-m", "planner", "train", "examples/mlp.py", "--plan",
                            str(mlp_plan_file(tmp_path)), "--steps", "1000", "--microbatch-size", "64",
                            "--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(), cwd=REPO,
                           start_new_session=True)
    try:
        wait_for(lambda: ready(job) or job.poll() is not None, 120, "the job to get there")
        workers = [worker_pid(job.pid, rank) for rank in range(2)]
        (os.killpg if signum == signal.SIGINT else os.kill)(job.pid, signum)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            kill_job(job)
    assert "Traceback" not in stderr, stderr[-3000:]
    for pid in workers:  # torchrun waited for them: gone, not left running on their own
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} still runs"
    return job.returncode, [line for line in stderr.splitlines() if not line.startswith(("warning: ", "note: "))]


@pytest.mark.slow
def test_ctrl_c_while_training_is_one_line_naming_the_step_and_the_checkpoint(tmp_path: Path) -> None:
    """Interrupted mid-training, each rank used to print the engine's failure ("rank 1 (stage 1, microbatch 2)
    failed: KeyboardInterrupt") and torchrun a 60-line traceback: now the launcher's one line, exit 130."""
    from runtime.checkpoint import latest_complete, load_stages

    folder = tmp_path / "checkpoints"
    code, lines = interrupted_training(tmp_path, lambda job: latest_complete(folder) is not None)
    newest = latest_complete(folder)
    assert code == 130 and len(lines) == 1, lines
    assert lines[0].startswith("interrupted: training stopped after step "), lines
    step = int(lines[0].split("after step ")[1].split(";")[0])
    assert newest is not None and step >= newest.step >= 2
    assert lines[0].endswith(f"; the last complete checkpoint is {newest.path}: continue with --resume"), lines
    assert len(load_stages(newest)) == 2  # whole


@pytest.mark.slow
def test_sigterm_to_the_launcher_while_training_is_one_line_naming_the_step_and_exit_143(tmp_path: Path) -> None:
    """A scheduler's preemption or `kill`: SIGTERM to `planner train` alone used to end in torchrun's traceback of its
    SignalException; now it stops the workers as Ctrl-C does, with the same line, "terminated", exit 128 + 15."""
    from runtime.checkpoint import latest_complete

    folder = tmp_path / "checkpoints"
    code, lines = interrupted_training(tmp_path, lambda job: latest_complete(folder) is not None, signal.SIGTERM)
    assert code == 143 and len(lines) == 1, lines
    assert lines[0].startswith("terminated: training stopped after step "), lines
    assert lines[0].endswith(": continue with --resume"), lines


@pytest.mark.slow
def test_ctrl_c_while_the_workers_start_is_one_line(tmp_path: Path) -> None:
    """Interrupted as the workers start (Python's own start-up, then importing torch): no traceback of theirs (SIGINT
    would print one, so the launcher stops them with SIGTERM), one line, exit 130."""
    from test_train import worker_pid

    def started(job: subprocess.Popen) -> bool:
        try:
            worker_pid(job.pid, 1)
        except AssertionError:
            return False
        return True

    code, lines = interrupted_training(tmp_path, started)
    assert code == 130 and lines == ["interrupted before training started"]
