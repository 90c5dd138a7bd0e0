"""runtime.deepspeed: plans DeepSpeed cannot run as planned are refused in one line; the config matches the plan.

Training with DeepSpeed's pipeline engine under torchrun, against plain PyTorch, is in
test_real_models.py (the deepspeed cases: GPT-2 with its tied head, and Llama).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("deepspeed")

from planner.plan import Plan  # noqa: E402
from runtime.deepspeed import DeepSpeedPlanError, _StageLayer, deepspeed_config, pipeline_module  # noqa: E402
from test_stages import planned  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


def gpt_plan(**changes: object) -> Plan:
    """The planner's straight 2-stage plan of examples/gpt.py, made 1f1b, with `changes`."""
    return dataclasses.replace(planned("gpt", 2), **{"schedule": "1f1b", **changes})


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


def test_a_stage_layer_unpacks_tuples_and_sends_gradient_free_floats_as_leaves() -> None:
    class TwoOut(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return x * 2, y + 1, (y > 0)

    x = torch.ones(2, requires_grad=True)
    doubled, table, mask = _StageLayer(TwoOut())((x, torch.zeros(2)))
    assert doubled.grad_fn is not None  # still connected to x
    assert table.requires_grad and table.grad_fn is None  # a leaf: DeepSpeed may call backward on it
    assert mask.dtype == torch.bool and not mask.requires_grad
