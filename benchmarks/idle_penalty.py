"""How much longer a pipeline stage's forward and backward take when they start after the rank has waited.

    python benchmarks/idle_penalty.py [--models whisper mlp resnet gpt] [--pauses 0 1 2 5 10] [--repeats 40]

A pipeline rank waits for messages between its operations; a profile times steps back to back. On a machine
whose caches others use while a rank waits (a shared host: other tenants' virtual CPUs on the same cores and
last-level cache), the rank comes back to caches that no longer hold its code and weights. This measures that,
in one process and one torch thread: per model, a straight 2-stage plan of a quick profile
(`planner.planning.partition`, 1f1b, 4 microbatches), its stages built as the runtime builds them
(`runtime.stages.build_stages`); then each stage's forward, and its backward, are timed as separate operations,
as the engine runs them, each after a pause of P ms (`time.sleep`: the thread blocks as a rank waiting for a
message does). Printed: the median time per pause, and its ratio to back to back (P = 0). A pure-Python loop of
about the same length is the control: it keeps its few cache lines, so a penalty there would be the clock's or
the sleep's.

Rounds repeat the pauses in turn (the machine drifts); medians are over the rounds' samples. No process waits for
another here: the effect is the pause alone.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model_files import MODEL_FILES  # noqa: E402  (beside this script)
from planner.files.cluster import make_cluster  # noqa: E402
from planner.planning.partition import partition  # noqa: E402
from planner.profiling.model_file import ModelFile, default_loss, load_model_file  # noqa: E402
from planner.profiling.profiler import ProfileSettings, profile_model  # noqa: E402
from runtime.nested import tensors  # noqa: E402
from runtime.stages import build_stages  # noqa: E402

BATCH = 8  # the microbatch: the profile's batch, as `planner partition` keeps it
MICROBATCHES = 4
ROUNDS = 3


def stage_ops(model_file: ModelFile) -> list[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """Per stage of a straight 2-stage plan: (name, forward, backward of what that forward returned)."""
    settings = ProfileSettings(batch_size=BATCH, device="cpu", warmup=1, iters=3, threads=1, processes=1)
    profile = profile_model(model_file, settings)
    plan = partition(profile, make_cluster(2), straight=True, schedule="1f1b", microbatches=MICROBATCHES)
    torch.manual_seed(0)
    model = model_file.build_model().train()
    inputs, target = model_file.example_batch(BATCH)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    stages = build_stages(model, plan, inputs)
    loss_fn = model_file.loss_fn or default_loss
    with torch.no_grad():  # the input of stage 1: what stage 0 sends (a leaf that requires grad, as received)
        sent = stages[0](*inputs)
    received = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in tensors(sent))

    def first_forward() -> Any:
        return stages[0](*inputs)

    def first_backward(out: Any) -> None:
        outs = [t for t in tensors(out) if t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    def last_forward() -> Any:
        return loss_fn(stages[1](*received), target)

    def last_backward(loss: Any) -> None:
        loss.backward()

    print(f"{Path(model_file.path).name}: stage 1 begins at {plan.stages[1].first_layer}", flush=True)
    return [("stage 0", first_forward, first_backward), ("stage 1", last_forward, last_backward)]


def timed_ops(forward: Callable[[], Any], backward: Callable[[Any], None], pause_s: float,
              repeats: int) -> tuple[list[float], list[float]]:
    """Forward and backward times (s), each op after a pause of `pause_s`."""
    forwards, backwards = [], []
    for _ in range(repeats):
        if pause_s:
            time.sleep(pause_s)
        start = time.perf_counter()
        out = forward()
        forwards.append(time.perf_counter() - start)
        if pause_s:
            time.sleep(pause_s)
        start = time.perf_counter()
        backward(out)
        backwards.append(time.perf_counter() - start)
    return forwards, backwards


def python_loop() -> None:
    total = 0
    for i in range(20_000):
        total += i * i


def row(label: str, medians: dict[float, float]) -> str:
    base = medians[0.0]
    return f"{label:28s}" + "".join(f"{medians[p] * 1e3:8.3f} x{medians[p] / base:4.2f}" for p in medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["whisper", "mlp", "resnet", "gpt"], choices=list(MODEL_FILES))
    parser.add_argument("--pauses", nargs="+", type=float, default=[0, 1, 2, 5, 10], help="milliseconds")
    parser.add_argument("--repeats", type=int, default=40, help="ops per pause and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pauses = sorted({p / 1e3 for p in [0.0, *args.pauses]})
    print(f"# {datetime.date.today()}: op ms after a pause (median of {ROUNDS} rounds x {args.repeats}), and its "
          f"ratio to back to back; one process, one torch thread")
    print(f"{'':28s}" + "".join(f"{f'{p * 1e3:g} ms':>14s}" for p in pauses))
    control: dict[float, list[float]] = {p: [] for p in pauses}
    for _ in range(ROUNDS):
        for p in pauses:
            control[p] += timed_ops(python_loop, lambda _: None, p, args.repeats)[0]
    print(row("pure-Python loop (control)", {p: statistics.median(v) for p, v in control.items()}), flush=True)
    for name in args.models:
        model_file = load_model_file(MODEL_FILES[name])
        for stage, forward, backward in stage_ops(model_file):
            for _ in range(5):  # warm-up
                backward(forward())
            found: dict[float, tuple[list[float], list[float]]] = {p: ([], []) for p in pauses}
            for _ in range(ROUNDS):
                for p in pauses:
                    forwards, backwards = timed_ops(forward, backward, p, args.repeats)
                    found[p][0].extend(forwards)
                    found[p][1].extend(backwards)
            for index, what in enumerate(("forward", "backward")):
                print(row(f"{name} {stage} {what}", {p: statistics.median(v[index]) for p, v in found.items()}),
                      flush=True)


if __name__ == "__main__":
    main()
