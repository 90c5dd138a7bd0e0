"""Trains transformers models under torchrun for tests/runtime/test_real_models.py.

Usage: `real_model_worker.py SPEC.json OUT_DIR`.

SPEC: {"cases": [case, ...]}; a case: {"name", "model" (a model file of tests/data/models, without .py),
"plan" (a plan file), "runtime" ("engine" or "pippy"), "batch", "steps", "lr"}. Every rank builds the
model as `seeded_model` does (seed 0, dropout off, training mode) and its batch as `seeded_batch`
does (seed 1), splits it for the plan with an example microbatch (torch.export: torch.fx cannot
trace transformers models) and trains `steps` SGD steps on the same mini-batch:
- engine: `runtime.engine.Engine.from_plan(..., example_inputs=...)`, `train_step`;
- pippy: `runtime.pippy.build(...)`, then per step `forward_backward` (`schedule.step` as the rank's stages
  ask, then `finish_gradients()`) and `optimizer.step()`, as runtime.pippy's docstring says;
- deepspeed: `runtime.deepspeed.pipeline_module(...)` under `deepspeed.initialize` with the plan's
  `deepspeed_config`, `engine.train_batch` over the mini-batch's microbatches.
It writes OUT_DIR/NAME.rank{R}.pt: {"losses": [loss or None per step], "params": {model parameter
name: tensor}} for the parameters of this rank's stage, or, if the case raised, OUT_DIR/NAME.rank{R}.error
(the exception, then its traceback) and goes on with the next case (exit status 1 at the end).
A rank left waiting by a peer's failure gives up after COLLECTIVE_TIMEOUT_S. Transformers is imported
once per process.
"""

from __future__ import annotations

import json
import sys
import traceback
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.profiling.model_file import ModelFile, default_loss, load_model_file
from planner.files.plan import load_plan
from runtime.engine import Engine, init_distributed
from runtime.nested import split_batch
from runtime.pippy import build
from runtime.worker_exit import exit_worker

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "data" / "models"
# config fields of GPT-2 and Llama that set a dropout probability
COLLECTIVE_TIMEOUT_S = 120.0
DROPOUT_FIELDS = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "summary_first_dropout", "attention_dropout")


@lru_cache(maxsize=None)
def model_file(name: str) -> ModelFile:
    """The tiny model file tests/data/models/NAME.py, imported once."""
    return load_model_file(MODELS / f"{name}.py")


def loss_of(name: str) -> Any:
    return model_file(name).loss_fn or default_loss


def without_dropout(model: nn.Module) -> nn.Module:
    """`model` with every dropout probability 0 (in place), so that a pipeline draws no masks.

    The pipeline's stages draw dropout masks from their own RNG streams, so with dropout on its
    parameters could not equal single-process training. Zeroed here: every nn.Dropout's `p`
    (GPT-2's embedding, residual and MLP dropouts, and its attention dropout, whose
    `attn_dropout.p` GPT2Attention passes as `dropout` to scaled_dot_product_attention in
    training mode); every float `attention_dropout` attribute of a module (LlamaAttention passes
    it as `dropout`; 0.0 by default); and the config fields DROPOUT_FIELDS, for code reading the
    config later. Done before the split: torch.export writes the probabilities into the graph.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
        config = getattr(module, "config", None)
        for field in DROPOUT_FIELDS:
            if isinstance(getattr(config, field, None), float):
                setattr(config, field, 0.0)
    return model


def seeded_model(name: str) -> nn.Module:
    """The model of NAME (seed 0), dropout off (`without_dropout`), in training mode."""
    torch.manual_seed(0)
    return without_dropout(model_file(name).build_model()).train()


def seeded_batch(name: str, batch: int) -> tuple[Any, Any]:
    """(inputs, target) of `batch` samples (seed 1)."""
    torch.manual_seed(1)
    return model_file(name).example_batch(batch)


def stage_params(model: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's parameters under their names in the whole model."""
    mine = {id(parameter) for parameter in module.parameters()}
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters() if id(parameter) in mine}


def run_engine(case: dict[str, Any], model: nn.Module, inputs: Any, target: Any) -> tuple[list[Any], nn.Module]:
    plan = load_plan(case["plan"])
    microbatch = split_batch(inputs, plan.microbatches or 1)[0]
    engine = Engine.from_plan(model, plan, loss_fn=loss_of(case["model"]), example_inputs=microbatch,
                              optimizer=lambda parameters: torch.optim.SGD(parameters, lr=case["lr"]),
                              timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        losses = [engine.train_step(inputs, target) for _ in range(case["steps"])]
    finally:
        engine.close()
    return losses, engine.module


def run_pippy(case: dict[str, Any], model: nn.Module, inputs: Any, target: Any) -> tuple[list[Any], nn.Module]:
    plan = load_plan(case["plan"])
    microbatch = split_batch(inputs, plan.microbatches or 1)[0]
    built = build(model, plan, microbatch, loss_fn=loss_of(case["model"]))
    parameters = {id(p): p for stage in built.stages for p in stage.submod.parameters()}  # zbv: two chunks a rank
    optimizer = torch.optim.SGD(list(parameters.values()), lr=case["lr"])
    losses: list[Any] = []
    for _ in range(case["steps"]):
        losses.append(built.forward_backward(inputs, target))  # schedule.step as the rank's stages ask, gradients
        optimizer.step()
        optimizer.zero_grad()
    return losses, nn.ModuleList([stage.submod for stage in built.stages])


def run_deepspeed(case: dict[str, Any], model: nn.Module, inputs: Any, target: Any) -> tuple[list[Any], nn.Module]:
    import deepspeed  # only the deepspeed cases need it (it takes a few seconds to import)

    from runtime.deepspeed import deepspeed_config, pipeline_module

    # DeepSpeed's CPU backend JIT-compiles a shared-memory kernel (~30 s on 2 cores) that only its inference
    # all-reduce uses: mark it unavailable, as on platforms without it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # joins the process group init_distributed made
    plan = load_plan(case["plan"])
    microbatches = list(zip(split_batch(inputs, plan.microbatches or 1), split_batch(target, plan.microbatches or 1)))
    module = pipeline_module(model, plan, loss_fn=loss_of(case["model"]), example_inputs=microbatches[0][0])
    optimizer = torch.optim.SGD(module.parameters(), lr=case["lr"])
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer,
                                      config={**deepspeed_config(plan), "steps_per_print": 10 ** 9})
    replicas = module.topology().get_dim("data")
    mine = microbatches[module.topology().get_coord(dist.get_rank()).data::replicas]  # this pipeline's share
    losses = [engine.train_batch(iter(mine)).item() for _ in range(case["steps"])]
    return [loss if engine.is_last_stage() else None for loss in losses], module


RUNTIMES = {"engine": run_engine, "pippy": run_pippy, "deepspeed": run_deepspeed}


def run_case(case: dict[str, Any], rank: int, out: Path) -> None:
    model = seeded_model(case["model"])
    inputs, target = seeded_batch(case["model"], case["batch"])
    losses, module = RUNTIMES[case["runtime"]](case, model, inputs, target)
    torch.save({"losses": losses, "params": stage_params(model, module)}, out / f"{case['name']}.rank{rank}.pt")


def main() -> int:
    torch.set_num_threads(1)
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank, _, _ = init_distributed(timeout_s=COLLECTIVE_TIMEOUT_S)
    failed = False
    for case in spec["cases"]:
        try:
            run_case(case, rank, out)
        except Exception as exc:  # the next cases still run; the test of this one reports it
            failed = True
            (out / f"{case['name']}.rank{rank}.error").write_text(
                f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
    try:
        dist.barrier()  # every rank is done with every case (no message still on its way)
    except RuntimeError as exc:
        print(f"rank {rank}: the final barrier failed: {exc}", flush=True)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    exit_worker(main())
