"""Runs engine cases under torchrun for tests/runtime/test_engine.py: `engine_worker.py SPEC.json OUT_DIR`.

SPEC: {"cases": [case, ...]}; a case: {"name", "model" (an example), "splits" (split points),
"stage_ranks", "schedule", "microbatches", "batch", "steps", "lr", "checkpoint" (bool or list),
"chunks" (stages per rank, default 1), "fail": null or {"rank", "microbatch", "in": "forward" |
"backward"}, "plan": optional plan file}. With "plan", the engine is `Engine.from_plan` (splits,
ranks, schedule, microbatches and checkpointing from the plan). Every rank builds the
seeded model in eval mode and its batch (seed 1), trains `steps` steps with SGD and writes
OUT_DIR/NAME.rank{R}.pt: {"losses": [...], "params": {model name: tensor}, "ops": [(op, microbatch,
start, end, stage), ...] of the last step} for the parameters of its stages. A failing case (its
rank's first stage fails) prints "rank R: EngineError: <message>" and the worker exits 3.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner.files.plan import load_plan  # noqa: E402
from runtime.engine import Engine, EngineError, init_distributed  # noqa: E402
from runtime.stages import split_model  # noqa: E402
from runtime.worker_exit import exit_worker  # noqa: E402
from runtime_examples import model_file  # noqa: E402


def deliberate_failure(module: nn.Module, microbatch: int, where: str) -> None:
    """Make the `microbatch`-th forward (or backward) of `module` on this rank raise ValueError."""
    calls = {"count": 0}

    def hook(*_: Any) -> None:
        calls["count"] += 1
        if calls["count"] == microbatch + 1:
            raise ValueError(f"deliberate failure in {where}")

    if where == "forward":
        module.register_forward_pre_hook(hook)
    else:
        module.register_full_backward_pre_hook(hook)


def run_case(case: dict[str, Any], rank: int, out: Path) -> None:
    example = model_file(case["model"])
    torch.manual_seed(0)
    model = example.build_model().eval()
    torch.manual_seed(1)
    inputs, target = example.example_batch(case["batch"])
    def sgd(parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=case["lr"])

    if case.get("plan"):
        engine = Engine.from_plan(model, load_plan(case["plan"]), optimizer=sgd, loss_fn=example.loss_fn)
    else:
        engine = Engine(split_model(model, case["splits"]), case["schedule"], case["stage_ranks"],
                        case["microbatches"], chunks=case.get("chunks", 1), checkpoint=case.get("checkpoint", False),
                        loss_fn=example.loss_fn, optimizer=sgd)
    fail = case.get("fail")
    if fail and fail["rank"] == rank:
        deliberate_failure(engine.modules[engine.stage], fail["microbatch"], fail["in"])
    losses = [engine.train_step(inputs, target) for _ in range(case["steps"])]
    ops = [(op.op, op.microbatch, op.start_s, op.end_s, op.stage) for op in engine.trace
           if op.step == case["steps"] - 1]
    engine.close()
    mine = {id(parameter) for module in engine.modules.values() for parameter in module.parameters()}
    params = {name: parameter.detach().clone() for name, parameter in model.named_parameters() if id(parameter) in mine}
    torch.save({"losses": losses, "params": params, "ops": ops}, out / f"{case['name']}.rank{rank}.pt")


def main() -> int:
    torch.set_num_threads(1)
    # torchrun stops every rank (SIGTERM) once one exits; a failed case's rank that has not printed its line yet
    # would be cut short. `planner train` ignores the signal while it composes its line too (runtime.train)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank, _, _ = init_distributed()
    for case in spec["cases"]:
        try:
            run_case(case, rank, out)
        except EngineError as exc:
            print(f"rank {rank}: EngineError: {exc}", flush=True)
            return 3
    return 0


if __name__ == "__main__":
    exit_worker(main())
