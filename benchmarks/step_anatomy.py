"""Where a one-stage training step's time goes: plain PyTorch against the engine's stage runner, side by side.

    python benchmarks/step_anatomy.py [--models llama gpt2 resnet] [--device auto] [--steps 30]

A one-stage plan trains each step as `--microbatches` forwards and backwards of microbatches of
`--microbatch-size` samples (gradients accumulated; no optimizer step here). Per model, the median
ms of such a step, each way in turn (round-robin, so drift hits all alike), and its ratio to the first:

1. plain: `loss_fn(model(x), y) * share` then `.backward()`, microbatches already on the device
   (what the profile's plain step runs, once per microbatch);
2. host copies: the same, each microbatch's inputs and target copied from the CPU batch (as a data
   loader hands them to the engine), the loss read with `float()` after its forward;
3. runner: `runtime.stage_runner.StageRunner` (what the engine calls per action), one last stage,
   forward then backward per microbatch, from the CPU batch;
4. runner + clock: as 3, with a `runtime.trace.StepClock` mark around every action (the engine's timing);
5. engine: `runtime.engine.Engine.train_step` of the whole CPU batch, one stage, 1f1b, in a process group of
   this one process (NCCL on a GPU, gloo on CPU), without an optimizer: what `planner train` runs per step;
6. one by one: each microbatch as a step of its own (forward, loss, backward, gradients dropped, the device
   waited for), as the profiler times its plain step; by the host's clock, and (events) by CUDA events
   around each, summed, the profiler's clock;
7. plain, gc paused / engine, gc paused: 1 and 5 with Python's cyclic garbage collector off for the step, as the
   profiler's timed steps have it (`planner.profiling.timing._gc_paused`).

On a GPU a step ends with a synchronization; rows 2-4 against row 1 show what the engine adds to a
launch-bound step, which the profile (row 1) does not see.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.profiling.devices import resolve_device  # noqa: E402
from planner.profiling.model_file import checked_example_batch, default_loss, load_model_file  # noqa: E402
from runtime.engine import Engine, init_distributed  # noqa: E402
from runtime.nested import map_tensors  # noqa: E402
from runtime.stage_runner import StageRunner  # noqa: E402
from runtime.trace import StepClock  # noqa: E402
from model_files import MODEL_FILES  # noqa: E402 (beside this script)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2", "resnet"], choices=list(MODEL_FILES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=8)
    args = parser.parse_args()
    device = resolve_device(args.device)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    init_distributed("nccl" if device.type == "cuda" else "gloo", device=device)
    print(f"# one-stage step of {args.microbatches} microbatches of {args.microbatch_size} on {device}: median ms "
          f"over {args.steps} steps, and / plain")
    for name in args.models:
        ways, engine = build_ways(name, device, args.microbatches, args.microbatch_size)
        samples: dict[str, list[float]] = {way: [] for way in ways}
        for step in range(args.steps + 3):  # 3 warm-up rounds
            for way, run in ways.items():
                start = time.perf_counter()
                own_ms = run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if step >= 3:  # a way that times itself (CUDA events) says so
                    samples[way].append(own_ms if own_ms is not None else (time.perf_counter() - start) * 1e3)
        plain = statistics.median(samples["plain"])
        cells = "  ".join(f"{way} {statistics.median(found):7.2f} ms x{statistics.median(found) / plain:.2f}"
                          for way, found in samples.items())
        print(f"{name:7s} {cells}", flush=True)
        engine.close()  # (its threads, before the next model's engine)


def build_ways(name: str, device: torch.device, microbatches: int,
               size: int) -> tuple[dict[str, Callable[[], Any]], Engine]:
    """The ways of running one step of model `name` (functions that run one step and return None, timed by
    the harness's wall clock, or the ms their own clock read), and the engine they share, to close after."""
    model_file = load_model_file(MODEL_FILES[name])
    torch.manual_seed(0)
    model = model_file.build_model().to(device).train()
    loss_fn = model_file.loss_fn or default_loss
    batches = [checked_example_batch(model_file, size) for _ in range(microbatches)]  # (inputs: a tuple, target)

    def to(value: Any, where: torch.device) -> Any:
        return map_tensors(lambda tensor: tensor.to(where), value)

    on_device = [(to(inputs, device), to(target, device)) for inputs, target in batches]
    share = 1.0 / microbatches

    def plain() -> None:
        for inputs, target in on_device:
            (loss_fn(model(*inputs), target) * share).backward()
        model.zero_grad(set_to_none=True)

    def copies() -> None:
        for inputs, target in batches:
            loss = loss_fn(model(*to(inputs, device)), to(target, device)) * share
            float(loss.detach())
            loss.backward()
        model.zero_grad(set_to_none=True)

    def one_by_one(events: bool = False) -> float | None:
        timed = []
        for inputs, target in on_device:
            start = torch.cuda.Event(enable_timing=True) if events else None
            if start is not None:
                start.record()
            loss_fn(model(*inputs), target).backward()
            end = torch.cuda.Event(enable_timing=True) if events else None
            if end is not None:
                end.record()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if start is not None:
                timed.append(start.elapsed_time(end))
            model.zero_grad(set_to_none=True)
        return sum(timed) if events else None

    runner = StageRunner(model, device, last=True, loss_fn=loss_fn)

    def through_runner(clock: bool = False) -> None:
        runner.reset(0)
        marks: list[Any] = []
        timer = StepClock(device) if clock else None
        for key, (inputs, target) in enumerate(batches):
            for action in ("forward", "backward"):
                if timer is not None:
                    marks.append(timer.mark())
                if action == "forward":
                    runner.forward(key, inputs, target, share)
                else:
                    runner.backward(key)
                if timer is not None:
                    marks.append(timer.mark())
        if timer is not None:
            timer.seconds(marks)
        model.zero_grad(set_to_none=True)

    engine = Engine([model], "1f1b", microbatches=microbatches, loss_fn=loss_fn, device=device)
    # every argument's microbatches joined (BERT and T5 take several); the engine splits them again
    whole = (tuple(torch.cat(parts) for parts in zip(*(inputs for inputs, _ in batches))),
             torch.cat([target for _, target in batches]))

    def through_engine() -> None:
        engine.train_step(whole[0], whole[1])
        model.zero_grad(set_to_none=True)

    return {"plain": plain, "copies": copies, "runner": through_runner, "clock": lambda: through_runner(True),
            "engine": through_engine, "one-by-one": one_by_one,
            **({"events": lambda: one_by_one(True)} if device.type == "cuda" else {}),
            "plain-nogc": lambda: without_gc(plain), "engine-nogc": lambda: without_gc(through_engine)}, engine


def without_gc(run: Callable[[], None]) -> None:
    """`run()` with the cyclic garbage collector off."""
    gc.disable()
    try:
        run()
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
