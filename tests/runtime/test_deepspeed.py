"""runtime.deepspeed: DeepSpeed's pipeline engine trains a plan's stages to the weights of single-process training;
plans DeepSpeed cannot run as planned are refused in one line; the config matches the plan.

Here: examples/gpt.py (split by torch.fx, tied embedding and head) as two pipelines of 2 stages on 4
processes under torchrun: the tied weight is summed within each pipeline, and DeepSpeed averages the
gradients across them. test_real_models.py trains transformers models (GPT-2, Llama: the torch.export
split) in one pipeline on 2 processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from planner.files.plan import Plan  # noqa: E402
from runtime.deepspeed import DeepSpeedPlanError, _StageLayer, deepspeed_config, pipeline_module  # noqa: E402
from runtime.stages import build_stages  # noqa: E402
from runtime_examples import model_file  # noqa: E402
from test_stages import planned  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "deepspeed_worker.py"
MICROBATCHES = 4
STEPS = 3
LR = 0.1
RANKS = 4  # two pipelines of two stages
TIED = "transformer.wte.weight"  # also lm_head.weight


def gpt_plan(**changes: object) -> Plan:
    """The planner's straight 2-stage plan of examples/gpt.py, made 1f1b, with `changes`."""
    return dataclasses.replace(planned("gpt", 2), **{"schedule": "1f1b", **changes})


def two_pipelines(plan: Plan) -> Plan:
    """A 2-stage `plan` made 2x2 on 4 ranks: every stage on 2 ranks (DeepSpeed's data-parallel degree 2)."""
    first, second = plan.stages
    return dataclasses.replace(plan, stages=(dataclasses.replace(first, replicas=2, ranks=(0, 1)),
                                             dataclasses.replace(second, replicas=2, ranks=(2, 3))))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Plan, Path]:
    """The 2-stage gpt plan as two pipelines (4 microbatches, 2 each) trained STEPS steps by deepspeed_worker.py
    under torchrun, 4 processes."""
    out = tmp_path_factory.mktemp("deepspeed")
    plan = two_pipelines(gpt_plan(microbatches=MICROBATCHES))
    spec = out / "spec.json"
    spec.write_text(json.dumps({"plan": str(plan.save(out / "plan.json")), "steps": STEPS, "lr": LR,
                                "batch": plan.microbatch_size * MICROBATCHES}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
               str(WORKER), str(spec), str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    errors = "".join(path.read_text() for path in sorted(out.glob("rank*.error")))
    assert finished.returncode == 0, errors + finished.stdout[-3000:] + finished.stderr[-5000:]
    return plan, out


@lru_cache(maxsize=None)
def single_process(batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch SGD on the whole mini-batch (mean loss), seeded as the worker: losses and final parameters
    (computed once). In eval mode: no dropout, as in the worker's training-mode model with every probability 0."""
    example = model_file("gpt")
    torch.manual_seed(0)
    model = example.build_model().eval()
    torch.manual_seed(1)
    inputs, target = example.example_batch(batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = example.loss_fn(model(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


@pytest.mark.slow
def test_deepspeed_trains_the_plans_stages_to_the_weights_of_single_process_sgd(
        trained: tuple[Plan, Path]) -> None:
    plan, out = trained
    expected_losses, expected = single_process(plan.microbatch_size * MICROBATCHES)
    ranks = [torch.load(out / f"rank{rank}.pt") for rank in range(RANKS)]
    for rank, found in enumerate(ranks):
        for name, parameter in found["params"].items():
            torch.testing.assert_close(parameter, expected[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, where=f"rank {rank} {name}": f"{where}: {m}")
    assert set(ranks[0]["params"]) | set(ranks[2]["params"]) == set(expected)  # every parameter, somewhere
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()  # a stage's replicas hold the same weights
    assert ranks[2]["params"].keys() == ranks[3]["params"].keys()
    for rank in (0, 1):
        assert ranks[rank]["losses"] == [None] * STEPS
    for rank in (2, 3):  # each pipeline's last stage: the mini-batch's mean loss, averaged across the pipelines
        assert ranks[rank]["losses"] == pytest.approx(expected_losses, rel=1e-6)


@pytest.mark.slow
def test_the_tied_weight_is_on_both_stages_and_trained_with_the_summed_gradient(trained: tuple[Plan, Path]) -> None:
    """examples/gpt.py's embedding is its head: both stages of each pipeline hold it (stages.shared), DeepSpeed
    declares no tie, and all four copies equal single-process training (each stage's own gradient alone would
    not, nor one pipeline's sum without the other's)."""
    plan, out = trained
    torch.manual_seed(0)
    stages = build_stages(model_file("gpt").build_model(), plan)
    assert [(shared.names, shared.stages) for shared in stages.shared] == [((TIED, "lm_head.weight"), (0, 1))]
    _, expected = single_process(plan.microbatch_size * MICROBATCHES)
    for rank in range(RANKS):
        torch.testing.assert_close(torch.load(out / f"rank{rank}.pt")["params"][TIED], expected[TIED],
                                   rtol=1e-5, atol=1e-7)


def test_the_config_trains_the_plans_mini_batch_without_clipping() -> None:
    plan = gpt_plan(microbatches=4)
    assert deepspeed_config(plan) == {"train_micro_batch_size_per_gpu": plan.microbatch_size,
                                      "gradient_accumulation_steps": 4,
                                      "train_batch_size": 4 * plan.microbatch_size, "gradient_clipping": 0.0}


def test_replicas_share_the_microbatches() -> None:
    base = gpt_plan(microbatches=4)
    plan = dataclasses.replace(base, stages=tuple(dataclasses.replace(stage, replicas=2, ranks=(2 * i, 2 * i + 1))
                                                  for i, stage in enumerate(base.stages)))
    config = deepspeed_config(plan)
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 4 * plan.microbatch_size


def test_unequal_replicas_are_refused_in_one_line() -> None:
    base = gpt_plan(microbatches=4)
    first, second = base.stages
    plan = dataclasses.replace(base, stages=(dataclasses.replace(first, replicas=2, ranks=(0, 1)),
                                             dataclasses.replace(second, ranks=(2,))))
    with pytest.raises(DeepSpeedPlanError) as raised:
        pipeline_module(nn.Linear(2, 2), plan, loss_fn=nn.functional.mse_loss)
    message = str(raised.value)
    assert "\n" not in message and "[2, 1] replicas" in message and "--straight" in message


def test_the_asynchronous_schedule_is_refused_in_one_line() -> None:
    with pytest.raises(DeepSpeedPlanError) as raised:
        deepspeed_config(gpt_plan(schedule="pipedream"))
    message = str(raised.value)
    assert "\n" not in message and "'pipedream'" in message and "--schedule 1f1b" in message


def test_a_plan_deepspeed_can_run_needs_an_initialized_process_group() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(DeepSpeedPlanError, match=r"^torch.distributed is not initialized: call deepspeed.init_distri"):
        pipeline_module(nn.Linear(2, 2), gpt_plan(microbatches=4), loss_fn=nn.functional.mse_loss)


def test_a_stage_layer_unpacks_tuples_and_sends_gradient_free_floats_as_leaves() -> None:
    class TwoOut(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return x * 2, y + 1, (y > 0)

    x = torch.ones(2, requires_grad=True)
    doubled, table, mask = _StageLayer(TwoOut())((x, torch.zeros(2)))
    assert doubled.grad_fn is not None  # still connected to x
    assert table.requires_grad and table.grad_fn is None  # a leaf: DeepSpeed may call backward on it
    assert mask.dtype == torch.bool and not mask.requires_grad
