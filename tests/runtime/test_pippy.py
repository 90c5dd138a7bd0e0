"""runtime.pippy under torchrun on 2 and 4 CPU processes (gloo): torch.distributed.pipelining on our split gives
the gradients and loss of our engine and of single-device training (mlp, gpt with tied weights, two replicas,
interleaved 1F1B and ZB-V on 2 and 4 ranks)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.files.cluster import make_cluster
from planner.profiling.model_file import default_loss
from planner.planning.partition import partition
from planner.files.plan import Plan
from planner.files.profile import load_profile
from runtime.pippy import PippyError, _TensorOutputs, build
from runtime_examples import model_file

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "pippy_worker.py"
BATCH = 8


def two_stage_plan(model: str, schedule: str) -> Plan:
    """The planner's straight 2-stage plan of the example on 2 devices, 4 microbatches."""
    return partition(load_profile(REPO / "profiles" / f"{model}.json"), make_cluster(2), straight=True,
                     schedule=schedule, microbatches=4)


def replicated_plan() -> Plan:
    """mlp as one stage on 2 replicas (ranks 0, 1), 1f1b with 4 microbatches: 2 per pipeline."""
    plan = two_stage_plan("mlp", "1f1b")
    first, last = plan.stages
    whole = dataclasses.replace(first, stop=last.stop, last_layer=last.last_layer, replicas=2, ranks=(0, 1))
    return dataclasses.replace(plan, stages=(whole,))


def four_rank_plan(schedule: str) -> Plan:
    """The planner's straight gpt plan of `schedule` on 4 GPUs, 8 microbatches of 1 (zbv: at least 2p - 1)."""
    return partition(load_profile(REPO / "profiles" / "gpt.json"), make_cluster(4), straight=True,
                     schedule=schedule, microbatches=8)


PLANS = {"mlp-1f1b": ("mlp", lambda: two_stage_plan("mlp", "1f1b")),
         "gpt-gpipe": ("gpt", lambda: two_stage_plan("gpt", "gpipe")),
         "gpt-zb-h1": ("gpt", lambda: two_stage_plan("gpt", "zb-h1")),
         "gpt-interleaved": ("gpt", lambda: two_stage_plan("gpt", "interleaved-1f1b")),  # 2 ranks x its chunks
         "gpt-zbv": ("gpt", lambda: two_stage_plan("gpt", "zbv")),  # 2 ranks x 2 chunks in a V
         "mlp-1x2-1f1b": ("mlp", replicated_plan),
         "gpt-4-interleaved": ("gpt", lambda: four_rank_plan("interleaved-1f1b")),  # 4 ranks x their chunks
         "gpt-4-zbv": ("gpt", lambda: four_rank_plan("zbv"))}
WORLD = {name: 4 if name.startswith("gpt-4-") else 2 for name in PLANS}  # processes of each case's job


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of PLANS run once under torchrun, one job per world size started together (most of a job is
    importing; the 4-process job writes to OUT/four)."""
    out = tmp_path_factory.mktemp("pippy")
    jobs = []
    for world, folder in ((2, out), (4, out / "four")):
        folder.mkdir(exist_ok=True)
        cases = []
        for name, (model, make) in PLANS.items():
            if WORLD[name] == world:
                path = make().save(folder / f"{name}.plan.json")
                cases.append({"name": name, "model": model, "plan": str(path), "batch": BATCH})
        spec = folder / "spec.json"
        spec.write_text(json.dumps({"cases": cases}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   str(WORKER), str(spec), str(folder)]
        jobs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        for job in jobs:
            stdout, stderr = job.communicate(timeout=300)
            assert job.returncode == 0, stdout[-3000:] + stderr[-5000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    return out


def single_device(model_name: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The mini-batch's mean loss and every parameter's gradient on one device, as the worker seeds them."""
    torch.manual_seed(0)
    model: nn.Module = model_file(model_name).build_model().eval()
    torch.manual_seed(1)
    inputs, target = model_file(model_name).example_batch(BATCH)
    loss = (model_file(model_name).loss_fn or default_loss)(model(inputs), target)
    loss.backward()
    return loss.item(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_pippy_gradients_equal_the_engines_and_single_device_training(results: Path, name: str) -> None:
    model_name = PLANS[name][0]
    expected_loss, expected = single_device(model_name)
    seen: set[str] = set()
    last_stage_ranks = set(PLANS[name][1]().stages[-1].ranks)
    folder = results if WORLD[name] == 2 else results / "four"
    for rank in range(WORLD[name]):
        found = torch.load(folder / f"{name}.rank{rank}.pt")
        engine, pippy = found["engine"], found["pippy"]
        assert pippy["grads"].keys() == engine["grads"].keys()
        assert pippy["outputs_kept"] == 0  # forward_backward returns no outputs: torch keeps none for it
        for parameter, grad in pippy["grads"].items():
            where = f"{name} rank {rank} {parameter}"
            torch.testing.assert_close(grad, engine["grads"][parameter], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, where=where: f"{where} vs engine: {m}")
            torch.testing.assert_close(grad, expected[parameter], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, where=where: f"{where} vs one device: {m}")
        if rank in last_stage_ranks:
            assert pippy["loss"] == pytest.approx(engine["loss"], rel=1e-6)
            assert pippy["loss"] == pytest.approx(expected_loss, rel=1e-5)
        else:
            assert pippy["loss"] is None and engine["loss"] is None
        seen |= pippy["grads"].keys()
    assert seen == set(expected)  # every parameter's gradient was checked on some rank


@pytest.mark.slow
def test_the_tied_weight_is_on_both_gpt_stages_with_the_summed_gradient(results: Path) -> None:
    """gpt's transformer.wte.weight is lm_head.weight: both ranks hold it, both with the whole gradient."""
    _, expected = single_device("gpt")
    for rank in range(2):
        grads = torch.load(results / f"gpt-gpipe.rank{rank}.pt")["pippy"]["grads"]
        assert "transformer.wte.weight" in grads
        torch.testing.assert_close(grads["transformer.wte.weight"], expected["transformer.wte.weight"],
                                   rtol=1e-4, atol=1e-6)


def test_build_needs_an_initialized_process_group() -> None:
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    with pytest.raises(PippyError, match="not initialized"):
        build(model_file("mlp").build_model(), two_stage_plan("mlp", "1f1b"), None)


@pytest.mark.slow
def test_a_plan_for_another_world_size_is_refused_with_the_launch_command(results: Path) -> None:
    for rank in range(2):
        message = (results / f"mismatch.rank{rank}.txt").read_text()
        assert message == ("the plan has 1 rank (1 stage x 1 replica) but the job has 2 processes: launch with "
                           "torchrun --nproc-per-node 1 (or make a plan for 2 GPUs)")


class _Named(nn.Module):
    """A last stage returning a dict (a transformers ModelOutput is one), which pipelining does not send as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(x), "hidden": x}


def test_the_last_stage_returns_tensors_and_the_loss_gets_the_output_rebuilt() -> None:
    stage = _TensorOutputs(_Named())
    x = torch.randn(4, 3)
    flat = stage(x)
    assert isinstance(flat, tuple) and all(isinstance(value, torch.Tensor) for value in flat)
    seen = []
    loss = stage.loss(lambda output, target: seen.append(output) or output["logits"].sum())
    loss(flat, None)
    assert seen[-1].keys() == {"logits", "hidden"} and torch.equal(seen[-1]["hidden"], x)
    one = _TensorOutputs(nn.Sequential(nn.Linear(3, 2)))  # a tensor: as it is, nothing to rebuild
    assert isinstance(one(x), torch.Tensor) and one.spec is None
    single = _TensorOutputs(type("One", (nn.Module,), {"forward": lambda self, x: {"only": x}})())
    only = single(x)
    assert only == (x,)
    loss = single.loss(lambda output, target: seen.append(output) or output["only"].sum())
    loss(x, None)  # torch's shape inference hands a tuple of one unpacked
    assert seen[-1].keys() == {"only"}
    assert [name for name, _ in stage.named_parameters()] == ["stage.head.weight", "stage.head.bias"]
