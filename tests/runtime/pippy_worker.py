"""Runs pippy cases under torchrun for tests/runtime/test_pippy.py: `pippy_worker.py SPEC.json OUT_DIR`.

SPEC: {"cases": [{"name", "model" (an example), "plan" (a plan file), "batch"}, ...]}. Every rank
builds the seeded model in eval mode (seed 0) and its batch (seed 1), runs one mini-batch through
`runtime.engine.Engine.from_plan` (no optimizer: gradients stay in .grad) and through
`runtime.pippy.build(...).forward_backward` on a second copy of the model, and writes
OUT_DIR/NAME.rank{R}.pt: {"engine": {...}, "pippy": {...}}, each {"loss": float or None,
"grads": {model parameter name: gradient}} for the parameters of this rank's stage, and for pippy
"outputs_kept": the microbatch outputs torch's stages keep for `step` to return (`output_chunks`). Last, every
rank builds the first case's model with a one-rank plan and writes PippyError's message to
OUT_DIR/mismatch.rank{R}.txt.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner.files.plan import load_plan  # noqa: E402
from runtime.engine import Engine, init_distributed  # noqa: E402
from runtime.nested import split_batch  # noqa: E402
from runtime.pippy import PippyError, build  # noqa: E402
from runtime.worker_exit import exit_worker  # noqa: E402
from runtime_examples import model_file  # noqa: E402


def seeded_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return model_file(name).build_model().eval()


def stage_grads(model: nn.Module, modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Gradients of the rank's stages' parameters (one stage, or its chunks) under their names in the whole model."""
    mine = {id(parameter) for module in modules for parameter in module.parameters()}
    return {name: parameter.grad.detach().clone() for name, parameter in model.named_parameters()
            if id(parameter) in mine}


def run_case(case: dict[str, Any], rank: int, out: Path) -> None:
    example = model_file(case["model"])
    plan = load_plan(case["plan"])
    torch.manual_seed(1)
    inputs, target = example.example_batch(case["batch"])

    engine_model = seeded_model(case["model"])
    engine = Engine.from_plan(engine_model, plan, loss_fn=example.loss_fn)
    engine_loss = engine.train_step(inputs, target)
    engine.close()

    pippy_model = seeded_model(case["model"])
    microbatch = split_batch(inputs, plan.microbatches or 1)[0]  # the inputs of one microbatch
    built = build(pippy_model, plan, microbatch, loss_fn=example.loss_fn)
    stage, schedule = built  # the documented unpacking
    assert stage is built.stage and schedule is built.schedule
    pippy_loss = built.forward_backward(inputs, target)

    kept = sum(len(s.output_chunks) for s in built.stages)  # outputs torch keeps to return merged: none asked
    torch.save({"engine": {"loss": engine_loss, "grads": stage_grads(engine_model, list(engine.modules.values()))},
                "pippy": {"loss": pippy_loss, "grads": stage_grads(pippy_model, [s.submod for s in built.stages]),
                          "outputs_kept": kept}},
               out / f"{case['name']}.rank{rank}.pt")


def world_mismatch(case: dict[str, Any], rank: int, out: Path) -> None:
    """Build `case` as a one-stage plan on one rank: the PippyError message goes to OUT/mismatch.rankR.txt."""
    plan = load_plan(case["plan"])
    first = dataclasses.replace(plan.stages[0], stop=plan.stages[-1].stop, replicas=1, ranks=(0,))
    try:
        build(seeded_model(case["model"]), dataclasses.replace(plan, stages=(first,)), None)
    except PippyError as exc:
        (out / f"mismatch.rank{rank}.txt").write_text(str(exc))


def main() -> int:
    torch.set_num_threads(1)
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank, _, _ = init_distributed()
    for case in spec["cases"]:
        run_case(case, rank, out)
    world_mismatch(spec["cases"][0], rank, out)
    return 0


if __name__ == "__main__":
    exit_worker(main())
