"""`python -m runtime.train` under torchrun on CPU: checks before work, checkpoints and resume, exported weights
equal to single-device training, re-partitioned resume (also to and from interleaved-1f1b, whose ranks run several
stages, and from it to zbv on 4 ranks), and ranks that die or freeze."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.errors import ModelFileError
from planner.files.cluster import make_cluster
from planner.profiling.model_file import default_loss
from planner.planning.partition import partition
from planner.files.plan import Plan, load_plan
from planner.files.profile import Profile, load_profile
from planner.files.run_report import load_run_report
from runtime.checkpoint import export_checkpoint, latest_complete, load_stages
from runtime.train import (
    Setup, TrainingError, TrainOptionError, TrainOptions, UnknownTrainOptionError, _batches, check_loader, check_setup,
    example_microbatch, parse_args, rank_count, signals_deferred, warmup_steps,
)
from runtime.train import main as train_main  # (its checks, in this process)
import runtime.train
from runtime_examples import model_file
from tests.conftest import gpu_only

REPO = Path(__file__).resolve().parents[2]
MICROBATCH = 64  # samples: mlp steps of about 0.2 s, slow enough to kill a job between two checkpoints


def mlp_plan(replicas: tuple[int, ...] = (1, 1), split: int | None = None) -> Plan:
    """The planner's straight 2-stage mlp plan with 1f1b and 4 microbatches, replicated as asked,
    optionally cut before layer `split` instead."""
    plan = partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(2), straight=True,
                     schedule="1f1b", microbatches=4)
    first, second = plan.stages
    if split is not None:
        names = [layer.name for layer in load_profile(REPO / "profiles" / "mlp.json").layers]
        first = dataclasses.replace(first, stop=split, last_layer=names[split - 1])
        second = dataclasses.replace(second, start=split, first_layer=names[split])
    first = dataclasses.replace(first, replicas=replicas[0], ranks=tuple(range(replicas[0])))
    second = dataclasses.replace(second, replicas=replicas[1],
                                 ranks=tuple(range(replicas[0], replicas[0] + replicas[1])))
    return dataclasses.replace(plan, stages=(first, second))


def interleaved_plan() -> Plan:
    """The planner's interleaved-1f1b mlp plan for 2 ranks with 4 microbatches: 3 stages on each rank."""
    return partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(2), schedule="interleaved-1f1b",
                     microbatches=4)


def command(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "runtime.train", *args]


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run(nproc: int, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(command(nproc, *args), capture_output=True, text=True, timeout=timeout_s,
                          env=environment(), cwd=REPO)


def start(nproc: int, *args: str) -> subprocess.Popen:
    """The job in its own session (so the test can kill all of it); output in files next to the checkpoints."""
    return subprocess.Popen(command(nproc, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment(), cwd=REPO, start_new_session=True)


def losses(report: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads(report.read_text())["losses"]}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: rank")]


def worker_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker process of `rank` (from /proc: its parent and RANK variable)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            variables = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and f"RANK={rank}".encode() in variables:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and every worker (torchrun starts each worker in a session of its own)."""
    workers = []
    for rank in range(8):
        try:
            workers.append(worker_pid(job.pid, rank))
        except AssertionError:
            pass
    for pid in (job.pid, *workers):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.communicate()


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("plans")
    # the 2-1 plan runs zb-h1: a resumed job under another plan and another schedule (B and W apart) follows the
    # uninterrupted 1f1b run's losses
    made = {"mlp-1-1": mlp_plan(), "mlp-2-1": dataclasses.replace(mlp_plan((2, 1), split=4), schedule="zb-h1"),
            "gpt-1-1": partition(load_profile(REPO / "profiles" / "gpt.json"), make_cluster(2), straight=True,
                                 schedule="1f1b"),
            "mlp-interleaved": interleaved_plan(),
            "mlp-zbv-4": partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(4), schedule="zbv",
                                   microbatches=4)}
    return {name: plan.save(folder / f"{name}.json") for name, plan in made.items()}


def checkpointed_run(plan: Path, folder: Path, steps: int) -> Path:
    """`steps` SGD steps of the mlp under `plan` on its ranks, a checkpoint every 2 steps (kept: all) and a
    report in `folder`; returns `folder`."""
    finished = run(rank_count(load_plan(plan)), "examples/mlp.py", "--plan", str(plan), "--steps", str(steps),
                   "--microbatch-size", str(MICROBATCH), "--optimizer", "sgd", "--checkpoint-dir",
                   str(folder / "checkpoints"), "--checkpoint-every", "2", "--keep", "10", "--report",
                   str(folder / "report.json"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def uninterrupted(plans: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 steps of the 2-rank mlp plan; returns its folder (`checkpointed_run`)."""
    return checkpointed_run(plans["mlp-1-1"], tmp_path_factory.mktemp("uninterrupted"), 10)


@pytest.fixture(scope="module")
def interleaved(plans: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps of the interleaved mlp plan on 2 ranks (3 stages each), as `uninterrupted`'s first 4 (same
    batches of 4 x MICROBATCH samples, SGD); returns its folder (`checkpointed_run`)."""
    return checkpointed_run(plans["mlp-interleaved"], tmp_path_factory.mktemp("interleaved"), 4)


def resumed_run(source: Path, step: int, plan: Path, nproc: int, steps: int,
                tmp_path: Path) -> subprocess.CompletedProcess:
    """The step-`step` checkpoint of the run in `source`, copied to tmp_path/checkpoints, continued to `steps`
    under `plan` on `nproc` ranks (SGD, a report in tmp_path); asserts it finished."""
    name = f"step-{step:08d}"
    shutil.copytree(source / "checkpoints" / name, tmp_path / "checkpoints" / name)
    resumed = run(nproc, "examples/mlp.py", "--plan", str(plan), "--steps", str(steps), "--microbatch-size",
                  str(MICROBATCH), "--optimizer", "sgd", "--checkpoint-dir", str(tmp_path / "checkpoints"),
                  "--resume", "--report", str(tmp_path / "report.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed


def single_device_training(steps: int, device: str = "cpu") -> tuple[dict[str, torch.Tensor], list[float]]:
    """The mlp's state_dict (on the CPU) and losses after `steps` SGD steps (lr 0.01, momentum 0.9: runtime.train's)
    on one `device`, on the model file's data_loader batches of 4 x MICROBATCH (8 an epoch: the second is
    reshuffled); the model is built on the CPU after seeding, as runtime.train builds it."""
    source = model_file("mlp")
    torch.manual_seed(0)
    model = source.build_model().to(device)
    loader = source.data_loader(4 * MICROBATCH)
    batches = [*loader, *loader][:steps]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    expected_losses = []
    for inputs, target in batches:
        loss = default_loss(model(inputs.to(device)), target.to(device))
        expected_losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}, expected_losses


def assert_trained_as_on_one_device(run_folder: Path, steps: int, device: str = "cpu") -> None:
    """The run's newest checkpoint, exported to one state_dict, and its losses equal `steps` steps on one `device`."""
    expected_state, expected_losses = single_device_training(steps, device)
    exported = export_checkpoint(run_folder / "checkpoints")
    fresh = model_file("mlp").build_model()
    fresh.load_state_dict(exported)  # strict: every name of the model, nothing else
    for name, tensor in expected_state.items():
        torch.testing.assert_close(fresh.state_dict()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    measured = losses(run_folder / "report.json")
    assert list(measured) == list(range(1, steps + 1))
    torch.testing.assert_close(list(measured.values()), expected_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_a_checkpoint_file_is_written_waits_for_the_write_then_reaches_its_handler(
        signum: signal.Signals) -> None:
    """SIGTERM (torchrun's stop) raised its Stopped inside torch.save, whose zip writer then failed on the half-written
    file with a RuntimeError: a traceback instead of the rank's line. Within `signals_deferred` the block runs to its
    end, then the handler that was there gets the signal; the handlers are as they were."""

    class Raised(Exception):
        pass

    def handler(number: int, frame: Any) -> None:
        raise Raised(number)

    previous = {stop: signal.signal(stop, handler) for stop in (signal.SIGTERM, signal.SIGINT)}
    written: list[bool] = []
    try:
        with pytest.raises(Raised) as raised:
            with signals_deferred():
                os.kill(os.getpid(), signum)
                time.sleep(0.05)  # (a handler runs between bytecodes: here, had it not been deferred)
                written.append(True)
        assert written == [True] and raised.value.args == (signum,)
        assert all(signal.getsignal(stop) is handler for stop in previous)
    finally:
        for stop, before in previous.items():
            signal.signal(stop, before)


def test_exported_weights_equal_single_device_training(uninterrupted: Path) -> None:
    """The checkpoint of step 10, exported to one state_dict, equals 10 SGD steps on one device."""
    assert_trained_as_on_one_device(uninterrupted, 10)


@gpu_only
def test_a_one_gpu_plan_trains_on_the_gpu_as_plain_pytorch_there(tmp_path: Path) -> None:
    """`--device auto` on a machine with a GPU: NCCL, the GPU, gradients of 4 microbatches accumulated; the
    weights and losses of plain PyTorch on that GPU, and the peak memory read from CUDA's allocator."""
    plan = partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(1), schedule="1f1b",
                     microbatches=4).save(tmp_path / "plan.json")
    checkpointed_run(plan, tmp_path, 4)
    assert_trained_as_on_one_device(tmp_path, 4, device="cuda")
    report = load_run_report(tmp_path / "report.json")
    assert report.memory_method == "cuda-allocator"
    assert report.measured[0].peak_memory_bytes > 0 and report.predicted[0].peak_memory_bytes > 0


@pytest.mark.slow
def test_an_interleaved_plan_trains_as_on_one_device_and_checkpoints_each_stage(interleaved: Path) -> None:
    """Each rank runs 3 stages of the mlp and steps one optimizer over them; its checkpoint is one file per stage,
    each holding its weights and the momentum of those weights, by name, and nothing of another stage's."""
    assert_trained_as_on_one_device(interleaved, 4)
    newest = latest_complete(interleaved / "checkpoints")
    assert newest is not None and newest.num_stages == 6
    stages = load_stages(newest)
    owned = [set(stage["optimizer_state"]["state"]) for stage in stages]
    assert [stage["meta"]["rank"] for stage in stages] == [0, 1, 0, 1, 0, 1]
    for stage, names in zip(stages, owned):
        assert names and names == set(stage["optimizer_state"]["shapes"]) <= set(stage["model_state"])
        assert names == set(stage["optimizer_state"]["param_groups"][0]["params"])
    assert sum(map(len, owned)) == len(set().union(*owned)) == len(list(model_file("mlp").build_model().parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("plan_name, nproc, exact", [("mlp-interleaved", 2, True), ("mlp-zbv-4", 4, False)])
def test_an_interleaved_checkpoint_resumes(plans: dict[str, Path], interleaved: Path, tmp_path: Path, plan_name: str,
                                           nproc: int, exact: bool) -> None:
    """The interleaved run's step-2 checkpoint continues to step 4 under the same plan, bit for bit as the run
    itself went on (weights, momentum, random state), or under a zbv plan on 4 processes (2 stages per rank in
    a V, rank r holding stages r and 7 - r, B and W apart), re-split by name: the same losses and weights to
    1e-5, and a checkpoint file per stage on its rank."""
    folder = tmp_path / "checkpoints"
    resumed = resumed_run(interleaved, 2, plans[plan_name], nproc, 4, tmp_path)
    assert ("made with another plan" in resumed.stdout) != exact
    after, reference = losses(tmp_path / "report.json"), losses(interleaved / "report.json")
    assert list(after) == [3, 4]
    weights, expected = export_checkpoint(folder), export_checkpoint(interleaved / "checkpoints")
    if exact:
        assert after == {step: reference[step] for step in after}
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    else:
        torch.testing.assert_close([after[3], after[4]], [reference[3], reference[4]], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)
        newest = latest_complete(folder)
        assert newest is not None and newest.step == 4
        assert [stage["meta"]["rank"] for stage in load_stages(newest)] == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.slow
def test_resume_with_another_plan(plans: dict[str, Path], uninterrupted: Path, tmp_path: Path) -> None:
    """The step-6 checkpoint of the 1-1 plan continues on 3 ranks with a 2-1 zb-h1 plan cut elsewhere (through
    `runtime.train`, as `planner train` runs it): the weights and SGD momentum are re-split by name, so the losses
    follow the uninterrupted 1f1b run. (Into stages of several per rank: the zbv case of
    test_an_interleaved_checkpoint_resumes.)"""
    folder = tmp_path / "checkpoints"
    resumed = resumed_run(uninterrupted, 6, plans["mlp-2-1"], 3, 8, tmp_path)
    assert "made with another plan" in resumed.stdout
    after = losses(tmp_path / "report.json")
    reference = losses(uninterrupted / "report.json")
    assert list(after) == [7, 8]
    torch.testing.assert_close([after[7], after[8]], [reference[7], reference[8]], rtol=1e-5, atol=1e-6)
    assert latest_complete(folder).step == 8


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_naming_the_checkpoint_that_resumes_it(plans: dict[str, Path], uninterrupted: Path,
                                                                         tmp_path: Path) -> None:
    """SIGKILL rank 1 after the first checkpoint: rank 0 ends the job at once with one line naming the rank and
    the newest complete checkpoint (the step in progress may have left part of one); --resume continues from
    it, and every later step's loss equals the uninterrupted run's (same seed, deterministic CPU ops)."""
    folder = tmp_path / "checkpoints"
    job = start(2, "examples/mlp.py", "--plan", str(plans["mlp-1-1"]), "--steps", "1000", "--microbatch-size",
                str(MICROBATCH), "--optimizer", "sgd", "--checkpoint-dir", str(folder), "--checkpoint-every", "2",
                "--timeout", "30")
    try:
        wait_for(lambda: latest_complete(folder) is not None or job.poll() is not None, 120, "a checkpoint")
        os.kill(worker_pid(job.pid, 1), signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = job.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            kill_job(job)
    assert job.returncode != 0
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: training stopped after step "), stderr[-3000:]
    assert "rank 1 exited" in lines[0], lines[0]
    newest = latest_complete(folder)
    assert newest is not None and f"the last complete checkpoint is {newest.path}" in lines[0], lines[0]
    assert elapsed < 30, elapsed  # well within --timeout: a dead process is seen at once
    assert newest.step <= 8, newest
    resumed = run(2, "examples/mlp.py", "--plan", str(plans["mlp-1-1"]), "--steps", str(newest.step + 2),
                  "--microbatch-size", str(MICROBATCH), "--optimizer", "sgd", "--checkpoint-dir", str(folder),
                  "--resume", "--report", str(tmp_path / "report.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {newest.path} (step {newest.step})" in resumed.stdout
    after = losses(tmp_path / "report.json")
    reference = losses(uninterrupted / "report.json")
    assert list(after) == [newest.step + 1, newest.step + 2]
    assert after == {step: reference[step] for step in after}  # bit for bit


@pytest.mark.slow
def test_a_frozen_rank_is_named_after_the_timeout(plans: dict[str, Path], tmp_path: Path) -> None:
    """A rank that stops (SIGSTOP) neither exits nor answers: the heartbeat names it after --timeout."""
    job = start(2, "examples/mlp.py", "--plan", str(plans["mlp-1-1"]), "--steps", "1000", "--microbatch-size",
                str(MICROBATCH), "--timeout", "4", "--log-every", "1")
    frozen = None
    try:
        assert job.stdout is not None
        assert job.stdout.readline().startswith("step 1/1000"), "the job did not start"
        frozen = worker_pid(job.pid, 1)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: job.poll() is not None or not _running(job.pid, 0), 60, "rank 0 to give up")
        elapsed = time.monotonic() - stopped_at
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGKILL)
        os.kill(job.pid, signal.SIGKILL)
        _, stderr = job.communicate()
    lines = error_lines(stderr)
    assert lines and lines[0].startswith("error: rank 0: training stopped after step "), stderr[-3000:]
    assert "rank 1 stopped answering" in lines[0] and "no checkpoint was written" in lines[0], lines[0]
    assert 4 <= elapsed < 30, elapsed


def _running(launcher: int, rank: int) -> bool:
    try:
        worker_pid(launcher, rank)
    except AssertionError:
        return False
    return True


@pytest.mark.slow
def test_a_failed_checkpoint_stops_every_rank_and_keeps_the_previous(plans: dict[str, Path], tmp_path: Path) -> None:
    """The folder of step 4 cannot be made (a file is in its way): both ranks stop with one line, and
    the step-2 checkpoint stays complete."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "step-00000004").write_text("in the way")
    finished = run(2, "examples/mlp.py", "--plan", str(plans["mlp-1-1"]), "--steps", "6",
                   "--checkpoint-dir", str(folder), "--checkpoint-every", "2")
    assert finished.returncode != 0
    lines = error_lines(finished.stderr)
    assert len(lines) == 2, finished.stderr[-3000:]
    assert all("checkpoint of step 4 failed" in line and "step-00000002 (step 2) is intact" in line
               for line in lines), lines
    assert latest_complete(folder).step == 2


def single_rank(args: list[str], **variables: str) -> subprocess.CompletedProcess:
    """runtime.train in one process with torchrun's variables set by hand (its checks run before any
    process group is made)."""
    env = {**environment(), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1", **variables}
    return subprocess.run([sys.executable, "-m", "runtime.train", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)


BAD_SETUPS = [
    (["examples/gpt.py"], "does not match the plan"),
    (["examples/mlp.py", "--backend", "nccl"], "--backend nccl needs CUDA devices"),
    (["examples/mlp.py", "--resume"], "--resume needs --checkpoint-dir DIR"),
    (["examples/gpt.py", "--data", "loader", "--plan", "{gpt}"], "has no data_loader(batch_size)"),
    (["examples/mlp.py", "--checkpoint-dir", "{plan}/sub"], "cannot be written"),
    (["examples/mlp.py", "--plan", "{two_one}"], "has 3 ranks (2 stages) but the job has 2 processes: start 3 "
                                                 "(`planner train` does by default, or --nproc 3; torchrun "
                                                 "--nproc-per-node 3)"),
]


def bad_setup_arguments(plans: dict[str, Path], args: list[str]) -> list[str]:
    plan = str(plans["mlp-1-1"])
    return ["--plan", plan] + [arg.format(plan=plan, gpt=plans["gpt-1-1"], two_one=plans["mlp-2-1"]) for arg in args]


def test_a_bad_setup_is_one_line_from_a_real_process(plans: dict[str, Path]) -> None:
    args, expected = BAD_SETUPS[0]
    finished = single_rank(bad_setup_arguments(plans, args))
    assert finished.returncode == 1
    assert finished.stderr.count("\n") == 1 and finished.stderr.startswith("error: rank 0: "), finished.stderr
    assert expected in finished.stderr


def main_in_this_process(args: list[str], monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> int:
    """runtime.train's main here with torchrun's `variables` (the others unset), from the repository; its
    SIGTERM and SIGINT handlers (and that it was interrupted) and torch's generator (its checks seed it) restored
    after. A real process's exit and stderr: test_a_bad_setup_is_one_line_from_a_real_process."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(REPO)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        with torch.random.fork_rng(devices=[]):
            return train_main(args)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        runtime.train._INTERRUPT.clear()


@pytest.mark.parametrize("args, expected", BAD_SETUPS)
def test_bad_setups_are_one_line(plans: dict[str, Path], args: list[str], expected: str,
                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # torchrun's variables as `single_rank` sets them: the checks run before any process group
    if "nccl" in args and torch.cuda.is_available():
        pytest.skip("with CUDA devices --backend nccl passes its checks and would start a process group here")
    code = main_in_this_process(bad_setup_arguments(plans, args), monkeypatch, {
        "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("error: rank 0: "), err
    assert expected in err


def test_outside_torchrun_says_how_to_launch(plans: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main_in_this_process(["examples/mlp.py", "--plan", str(plans["mlp-1-1"])], monkeypatch, {}) == 1
    err = capsys.readouterr().err
    assert "not started by torchrun" in err and "planner train" in err


SIGNALLED = """
import os
import signal
import time

from torch import nn


def build_model() -> nn.Module:
    os.kill(os.getpid(), signal.{name})  # while the rank builds the model (as while it imports it, or splits it)
    time.sleep(10)
    raise AssertionError("the signal did not end the checks")


def example_batch(batch_size: int):
    raise AssertionError("never asked")
"""


@pytest.mark.parametrize("name, interrupted", [("SIGINT", True), ("SIGTERM", True), ("SIGTERM", False)])
def test_ctrl_c_ends_a_rank_without_a_word(plans: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str], name: str, interrupted: bool) -> None:
    """SIGINT (torchrun passes Ctrl-C on), or SIGTERM once `planner train` made its INTERRUPTED_FILE (it has the
    workers stopped with SIGTERM on Ctrl-C), ends the rank quietly with 130; the launcher says what stopped. A SIGTERM
    without the file is torchrun's stop after another rank failed: this rank's one line says so."""
    model = tmp_path / "signalled.py"
    model.write_text(SIGNALLED.format(name=name))
    noted = tmp_path / "interrupted"
    if interrupted and name == "SIGTERM":
        noted.touch()
    code = main_in_this_process([str(model), "--plan", str(plans["mlp-1-1"])], monkeypatch, {
        "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
        runtime.train.INTERRUPTED_FILE: str(noted)})
    err = capsys.readouterr().err
    if interrupted:
        assert (code, err) == (130, "")
        assert not noted.exists() or noted.read_text() == ""  # rank 0 writes a step only once training began
    else:  # (here: the one line of a model file whose build_model() was stopped)
        assert code == 1 and err.startswith("error: rank 0: ") and err.count("\n") == 1, err


def test_a_model_built_wider_than_its_profile_is_refused(tmp_path: Path) -> None:
    """The same layer names but another configuration (here: the mlp at HIDDEN 1032, not 1024): the plan's memory
    would be wrong, so training refuses it, naming both parameter totals."""
    source = (REPO / "examples" / "mlp.py").read_text()
    assert "HIDDEN = 1024\n" in source
    wider = tmp_path / "mlp.py"
    wider.write_text(source.replace("HIDDEN = 1024\n", "HIDDEN = 1032\n"))
    profile = REPO / "profiles" / "mlp.json"
    plan = partition(load_profile(profile), make_cluster(2), straight=True, schedule="1f1b", microbatches=4,
                     profile_path=str(profile)).save(tmp_path / "plan.json")
    profiled = load_profile(profile).total_param_bytes
    with pytest.raises(TrainingError, match=rf"{wider} does not match the profile .*profiles/mlp.json: the model has "
                                            rf"[0-9,]+ bytes of parameters, the profile {profiled:,} .*planner profile"):
        check_setup(parse_args([str(wider), "--plan", str(plan)]), 0, 2, 0)
    check_setup(parse_args(["examples/mlp.py", "--plan", str(plan)]), 0, 2, 0)  # the profiled model passes


def profiled_plan(tmp_path: Path, profile: Profile) -> Path:
    """A straight 2-stage 1f1b plan of `profile`, saved with it in tmp_path."""
    path = profile.save(tmp_path / "profile.json")
    return partition(profile, make_cluster(2), straight=True, schedule="1f1b", microbatches=4,
                     profile_path=str(path)).save(tmp_path / "plan.json")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_model_trains_in_the_profiles_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    """A model built in float64 and profiled at the default float32 was refused for its parameter bytes, and a
    bfloat16 profile could never train: the model, its example inputs and its batches take the profile's dtype."""
    source = (REPO / "examples" / "mlp.py").read_text()
    doubled = tmp_path / "mlp64.py"
    doubled.write_text(source.replace("    return nn.Sequential(*layers)\n", "    return nn.Sequential(*layers).double()\n"))
    assert doubled.read_text() != source
    profile = load_profile(REPO / "profiles" / "mlp.json")
    if dtype != torch.float32:  # as `planner profile --dtype` records it: half or twice the bytes
        factor = torch.empty(0, dtype=dtype).element_size() / 4
        profile = dataclasses.replace(profile, dtype=str(dtype).removeprefix("torch."), input_bytes=int(
            profile.input_bytes * factor), layers=tuple(dataclasses.replace(layer, param_bytes=int(
                layer.param_bytes * factor)) for layer in profile.layers))
    plan = profiled_plan(tmp_path, profile)
    setup = check_setup(parse_args([str(doubled), "--plan", str(plan)]), 0, 2, 0)
    assert setup.dtype == dtype and {p.dtype for p in setup.model.parameters()} == {dtype}
    assert setup.cast_from == (None if dtype == torch.float64 else torch.float64)
    assert example_microbatch(setup).dtype == dtype
    inputs, target = next(_batches(parse_args([str(doubled), "--plan", str(plan)]), setup, 0))
    assert inputs.dtype == dtype and target.dtype == torch.int64  # class labels stay integers


def test_example_inputs_changed_since_the_profile_are_refused(tmp_path: Path) -> None:
    """A sequence length changed after profiling kept the parameters and moved every activation (peak memory
    1.23-1.28x the plan): the profile's input bytes are checked too."""
    profile = load_profile(REPO / "profiles" / "mlp.json")
    plan = profiled_plan(tmp_path, dataclasses.replace(profile, input_bytes=profile.input_bytes * 2))
    with pytest.raises(TrainingError, match=rf"example_batch\({profile.batch_size}\)'s inputs have "
                                            rf"{profile.input_bytes:,} bytes, the profile's {2 * profile.input_bytes:,}"):
        check_setup(parse_args(["examples/mlp.py", "--plan", str(plan)]), 0, 2, 0)


SHORT_LAST_BATCH = """

def data_loader(batch_size):
    \"\"\"Two full batches, then the short one a loader without drop_last gives.\"\"\"
    torch.manual_seed(5)
    return [example_batch(batch_size), example_batch(batch_size), example_batch(batch_size - 3)]
"""


def mlp_with_loader(tmp_path: Path, loader_source: str) -> tuple[str, Path, TrainOptions, Setup]:
    """The mlp example with `loader_source` for its data_loader, in tmp_path; (the example's source, that file,
    the options of training it with a 2-stage 1f1b plan of the shipped profile, rank 0's setup)."""
    source = (REPO / "examples" / "mlp.py").read_text()
    loader = tmp_path / "mlp.py"
    loader.write_text(source.split("\ndef data_loader")[0] + loader_source)
    plan = REPO / "profiles" / "mlp.json"
    plan = partition(load_profile(plan), make_cluster(2), straight=True, schedule="1f1b", microbatches=4,
                     profile_path=str(plan)).save(tmp_path / "plan.json")
    options = parse_args([str(loader), "--plan", str(plan)])
    return source, loader, options, check_setup(options, 0, 2, 0)


def test_a_loaders_short_batches_are_skipped_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A loader's last, short batch was trained as uneven microbatches (5 samples as 2, 1, 1, 1), or stopped the
    job (3 samples into 4 microbatches): every step trains the plan's batch, and the note says what was skipped."""
    source, loader, options, setup = mlp_with_loader(tmp_path, SHORT_LAST_BATCH)
    batches = _batches(options, setup, 0)
    sizes = [next(batches)[0].shape[0] for _ in range(5)]
    assert sizes == [setup.batch_size] * 5  # two epochs and more: only full batches
    out = capsys.readouterr().out
    assert out.count("note:") == 1 and f"yielded a batch of {setup.batch_size - 3} samples" in out
    loader.write_text(source.split("\ndef data_loader")[0] + SHORT_LAST_BATCH.replace(
        "[example_batch(batch_size), example_batch(batch_size), ", "["))
    with pytest.raises(TrainingError, match=rf"yielded no batch of {setup.batch_size} samples"):
        next(_batches(options, check_setup(options, 0, 2, 0), 0))


WIDER_BATCHES = """

def data_loader(batch_size):
    \"\"\"A batch as the example's, then one of twice the features (a longer sequence, a larger image).\"\"\"
    features, labels = example_batch(batch_size)
    return [(features, labels), (torch.cat([features, features], dim=1), labels)] * 2
"""


def test_a_loaders_inputs_unlike_the_examples_are_one_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The profile measured example_batch()'s shapes: a loader whose inputs differ (another sequence length, image
    size) trains other times and memory than the plan's. One warning on rank 0, at the first batch that differs."""
    _, loader, options, setup = mlp_with_loader(tmp_path, WIDER_BATCHES)
    size, width = setup.batch_size, setup.model_file.example_batch(1)[0].shape[1]
    batches = _batches(options, setup, 0, example_microbatch(setup))
    next(batches)
    assert capsys.readouterr().err == ""  # as the example's
    for _ in range(3):
        next(batches)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"warning: {loader}: data_loader({size}) yielded inputs of shapes ({size}, {2 * width}) where "
                     f"example_batch({size})'s are ({size}, {width}), the shapes the profile measured: the plan's "
                     "times and memory hold for those (make example_batch() like the loader's batches, then profile "
                     "and partition again)"]
    rank_1 = check_setup(options, 1, 2, 1)
    quiet = _batches(options, rank_1, 0, example_microbatch(rank_1))  # rank 1: says nothing
    for _ in range(2):
        next(quiet)
    assert capsys.readouterr().err == ""


DICT_BATCHES = """

def data_loader(batch_size):
    \"\"\"A Hugging Face collator's kind of batch: the inputs by name.\"\"\"
    features, labels = example_batch(batch_size)
    return [({"features": features}, labels)]
"""


SEQUENCE_FIRST = """

def data_loader(batch_size):
    \"\"\"Batches laid out with another dimension first, longer than the batch.\"\"\"
    features, labels = example_batch(batch_size + 1)
    return [(features, labels)]
"""


def test_a_loader_that_breaks_the_model_files_contract_is_one_line_before_any_worker_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs as a dict (what a Hugging Face collator yields) where example_batch gives them by position failed on
    every rank inside the first stage's first op ("linear(): argument 'input' must be Tensor, not dict");
    `planner train` now checks the loader's first batch before it starts torchrun, as it checks example_batch(). A
    loader that raises is one line too."""
    from runtime import launch as launch_module

    _, loader, options, setup = mlp_with_loader(tmp_path, DICT_BATCHES)
    with pytest.raises(ModelFileError) as raised:
        check_loader(options, setup)
    assert str(raised.value) == (f"{loader}: data_loader({setup.batch_size}) raised ValueError: inputs named features, "
                                 "where example_batch gives them by position: give them one way; fix data_loader()")
    check_loader(parse_args([str(loader), "--plan", options.plan, "--data", "example"]), setup)  # not read: fine
    started: list[object] = []
    monkeypatch.setattr(launch_module, "run_module", lambda *args, **kwargs: started.append(args))
    with pytest.raises(ModelFileError):
        launch_module.launch([str(loader), "--plan", options.plan])
    assert started == []
    _, _, options, setup = mlp_with_loader(tmp_path, "\ndef data_loader(batch_size):\n    raise OSError('no data')\n")
    with pytest.raises(ModelFileError, match=rf"data_loader\({setup.batch_size}\) raised OSError: no data; fix "):
        check_loader(options, setup)
    _, _, options, setup = mlp_with_loader(tmp_path, WIDER_BATCHES)  # the contract kept (shapes only warned of)
    check_loader(options, setup)
    _, _, options, setup = mlp_with_loader(tmp_path, SEQUENCE_FIRST)  # each of its batches would be skipped
    with pytest.raises(ModelFileError, match=rf"yielded input 0 of shape \({setup.batch_size + 1}, "):
        check_loader(options, setup)
    _, _, options, setup = mlp_with_loader(tmp_path, SHORT_LAST_BATCH.replace(  # only a short one: training's to say
        "[example_batch(batch_size), example_batch(batch_size), ", "["))
    check_loader(options, setup)
    _, _, options, setup = mlp_with_loader(tmp_path, "\ndef data_loader(batch_size):\n    return [None]\n")
    with pytest.raises(ModelFileError, match=rf"data_loader\({setup.batch_size}\) yielded type NoneType; expected a "):
        check_loader(options, setup)


def test_an_interleaved_plan_needs_a_process_per_rank_not_per_stage(plans: dict[str, Path]) -> None:
    plan = plans["mlp-interleaved"]
    assert rank_count(load_plan(plan)) == 2
    with pytest.raises(TrainingError, match=r"has 2 ranks \(6 stages\) but the job has 6 processes: start 2 "
                                            r"\(`planner train` does by default, or --nproc 2; torchrun "
                                            r"--nproc-per-node 2\), .*--gpus 6`"):
        check_setup(parse_args(["examples/mlp.py", "--plan", str(plan)]), 0, 6, 0)


def test_one_process_for_a_plan_of_more_reads_in_the_singular(plans: dict[str, Path]) -> None:
    with pytest.raises(TrainingError) as raised:
        check_setup(parse_args(["examples/mlp.py", "--plan", str(plans["mlp-2-1"])]), 0, 1, 0)
    message = str(raised.value)
    assert "has 3 ranks (2 stages) but the job has 1 process: start 3 (" in message and "--nproc 3;" in message
    assert "or make a plan for 1 GPU with `planner partition PROFILE --gpus 1`" in message
    assert "1 processes" not in message and "1 GPUs" not in message


def test_a_mistyped_option_is_one_line_naming_the_closest() -> None:
    """(`planner train m.py --plan p.json --stepz 3` printed argparse's usage as `python -m runtime.train`.)"""
    with pytest.raises(UnknownTrainOptionError) as raised:
        parse_args(["m.py", "--plan", "p.json", "--stepz", "3"])
    assert str(raised.value) == "planner train: unknown option --stepz; did you mean --steps?"
    assert (raised.value.option, raised.value.closest) == ("--stepz", "--steps")
    with pytest.raises(UnknownTrainOptionError, match=r"unknown option --nprocs; did you mean --nproc\?"):
        parse_args(["m.py", "--plan", "p.json", "--nprocs=2"])  # `planner train`'s own option is known too


def test_an_unknown_option_with_no_near_one_lists_the_options() -> None:
    with pytest.raises(UnknownTrainOptionError) as raised:
        parse_args(["m.py", "--plan", "p.json", "--zzz"])
    message = str(raised.value)
    assert message.startswith("planner train: unknown option --zzz; the options are --nproc, --debug, --plan, ")
    assert "--steps" in message and "--log-every" in message and "--help" not in message and "\n" not in message
    assert raised.value.options == tuple(option.strip() for option in message.split("the options are ")[1].split(","))


@pytest.mark.parametrize("args, expected", [
    (["--steps", "many"], "planner train: argument --steps: invalid int value: 'many'"),
    (["--optimizer", "adamw"], "planner train: argument --optimizer: invalid choice: 'adamw'"),
    (["extra"], "planner train: unexpected argument 'extra'"),
])
def test_other_bad_command_lines_are_one_line(args: list[str], expected: str) -> None:
    with pytest.raises(TrainOptionError) as raised:
        parse_args(["m.py", "--plan", "p.json", *args])
    assert str(raised.value).startswith(expected) and "\n" not in str(raised.value)


def test_a_bad_option_under_torchrun_is_one_line_naming_the_module(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main_in_this_process(["m.py", "--plan", "p.json", "--stepz", "3"], monkeypatch, {"RANK": "1"}) == 1
    err = capsys.readouterr().err
    assert err == "error: rank 1: python -m runtime.train: unknown option --stepz; did you mean --steps?\n"


def test_options() -> None:
    options = parse_args(["m.py", "--plan", "p.json", "--steps", "5", "--timeout", "60", "--checkpoint-dir", "c",
                          "--resume"])
    assert (options.steps, options.timeout_s, options.checkpoint_dir, options.resume) == (5, 60.0, "c", True)


def test_the_reports_warmup_reaches_to_the_step_whose_memory_was_measured_while_a_step_is_left() -> None:
    assert warmup_steps(12, memory_step=1) == 2  # the first allocates the optimizer's state, the second is measured
    assert warmup_steps(12, memory_step=0) == 1
    assert warmup_steps(2, memory_step=1) == 1  # one step must remain to be measured
    assert warmup_steps(1, memory_step=1) == 0


def test_sigterm_while_the_model_builds_is_not_blamed_on_the_model_file(tmp_path: Path) -> None:
    """torchrun's SIGTERM (another rank failed) arriving in build_model() read "build_model() raised Stopped"."""
    from planner.profiling.model_file import build_checked_model, load_model_file
    from runtime.train import Stopped

    model = tmp_path / "slow_to_build.py"
    model.write_text("from runtime.train import Stopped\n\n\ndef build_model():\n    raise Stopped()\n\n\n"
                     "def example_batch(batch_size):\n    raise Stopped()\n")
    with pytest.raises(Stopped):
        build_checked_model(load_model_file(model))


def test_a_rank_stopped_by_sigterm_blames_the_launcher_only_once_another_rank_exited() -> None:
    """Stopped by SIGTERM with a rank of this machine gone when the engine caught it, torchrun's launcher sent it (it
    stops every rank when one exits); with none gone then, the job was cancelled or someone signalled this rank
    (`kill PID`), not said to be the launcher's doing, even where a rank exited after hearing of this one's stop."""

    class Engine:  # what `_stop_message` asks of the engine
        def __init__(self, at_failure: list[int] | None, now: list[int]) -> None:
            self.gone_at_failure, self.now = at_failure, now

        def gone(self, wait_s: float) -> list[int]:
            return self.now

    after_exit = runtime.train._stop_message("", 4, None, True, Engine([1], [1]))  # type: ignore[arg-type]
    assert after_exit.startswith("training stopped after step 4: stopped by SIGTERM from the launcher ")
    assert "rank 1 exited first" in after_exit and after_exit.endswith("no checkpoint was written (use "
                                                                       "--checkpoint-dir DIR --checkpoint-every K "
                                                                       "to keep progress)")
    for engine in (Engine([], [0]), Engine(None, [])):  # rank 0 exited once told; stopped outside a step
        alone = runtime.train._stop_message("", 4, None, True, engine)  # type: ignore[arg-type]
        assert "launcher" not in alone and "no rank of this machine had exited" in alone
        assert "the signal was sent to this rank alone" in alone
    assert "rank 0 exited first" in runtime.train._stop_message("", 4, None, True,
                                                                Engine(None, [0]))  # type: ignore[arg-type]
