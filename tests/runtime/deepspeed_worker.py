"""DeepSpeed's pipeline engine trains examples/gpt.py for test_deepspeed.py: `deepspeed_worker.py SPEC.json OUT_DIR`.

SPEC: {"plan": a plan file, "batch": samples per mini-batch, "steps", "lr"}. Every rank builds the
model (seed 0; every dropout probability 0, attention's too: DeepSpeed's train_batch puts the module
in training mode) and the mini-batch (seed 1), makes `runtime.deepspeed.pipeline_module` on the fx split of
the model, `deepspeed.initialize` with SGD and the plan's `deepspeed_config`, and runs
`engine.train_batch` over its pipeline's share of the mini-batch's microbatches (with two pipelines, every
other one) `steps` times. It writes
OUT_DIR/rank{R}.pt: {"losses": [loss per step, or None off the last stage], "params": {model
parameter name: tensor after the last step} for this rank's stage}, or OUT_DIR/rank{R}.error.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import deepspeed  # imported once, before any work: it takes a few seconds
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner.files.plan import load_plan  # noqa: E402
from runtime.deepspeed import deepspeed_config, pipeline_module  # noqa: E402
from runtime.nested import split_batch  # noqa: E402
from runtime.worker_exit import exit_worker  # noqa: E402
from runtime_examples import model_file  # noqa: E402

COLLECTIVE_TIMEOUT_S = 120


def without_dropout(model: nn.Module) -> nn.Module:
    """`model` with every nn.Dropout's probability 0 and examples/gpt.py's attention dropout (its module's DROPOUT,
    read in training mode) 0, so training mode computes what eval mode does. Changes the example's module for
    the whole process: for the worker only."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    sys.modules[type(model).__module__].DROPOUT = 0.0  # type: ignore[attr-defined]
    return model


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's losses and trained parameters (see the module docstring)."""
    example = model_file("gpt")
    plan = load_plan(spec["plan"])
    torch.manual_seed(0)
    model = without_dropout(example.build_model())
    torch.manual_seed(1)
    inputs, target = example.example_batch(spec["batch"])
    count = plan.microbatches or 1
    microbatches = list(zip(split_batch(inputs, count), split_batch(target, count)))
    module = pipeline_module(model, plan, loss_fn=example.loss_fn, example_inputs=microbatches[0][0])
    optimizer = torch.optim.SGD(module.parameters(), lr=spec["lr"])
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer,
                                      config={**deepspeed_config(plan), "steps_per_print": 10 ** 9})
    pipelines = module.topology().get_dim("data")
    mine = microbatches[module.topology().get_coord(dist.get_rank()).data::pipelines]
    losses = [float(engine.train_batch(iter(mine)).item()) for _ in range(spec["steps"])]
    mine = {id(parameter) for parameter in module.parameters()}
    params = {name: parameter.detach().clone() for name, parameter in model.named_parameters()
              if id(parameter) in mine}
    return {"losses": losses if engine.is_last_stage() else [None] * len(losses), "params": params}


def main() -> int:
    torch.set_num_threads(1)
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    # DeepSpeed's CPU backend JIT-compiles a shared-memory kernel (~30 s on 2 cores, again whenever the cached
    # build's command differs) that only inference_all_reduce uses: mark it unavailable, as on other platforms
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    try:
        torch.save(train(spec), out / f"rank{rank}.pt")
    except Exception as exc:  # the test shows it; a peer left waiting gives up after the timeout
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        return 1
    dist.barrier()  # no message still on its way when the ranks leave
    return 0


if __name__ == "__main__":
    exit_worker(main())
