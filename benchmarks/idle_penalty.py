"""How much longer a pipeline stage's forward and backward take when they start after the rank has waited.

    python benchmarks/idle_penalty.py [--models whisper mlp resnet gpt] [--pauses 0 1 2 5 10] [--repeats 40]
                                      [--device cpu]

A pipeline rank waits for messages between its operations; a profile times steps back to back. On a machine
whose caches others use while a rank waits (a shared host: other tenants' virtual CPUs on the same cores and
last-level cache), the rank comes back to caches that no longer hold its code and weights. This measures that,
in one process and one torch thread: per model, a straight 2-stage plan of a quick profile
(`planner.planning.partition`, 1f1b, 4 microbatches), its stages built as the runtime builds them
(`runtime.stages.build_stages`); then each stage's forward, and its backward, are timed as separate operations,
as the engine runs them, each after a pause of P ms (`time.sleep`: the thread blocks as a rank waiting for a
message does). Printed: the median time per pause, and its ratio to back to back (P = 0). A pure-Python loop of
about the same length is the control: it keeps its few cache lines, so a penalty there would be the clock's or
the sleep's (on a GPU, one 4096 x 4096 matrix product is a second control: one kernel, no host work to speak of).

Rounds repeat the pauses in turn (the machine drifts); medians are over the rounds' samples. No process waits for
another here: the effect is the pause alone.

`--device cuda`: the stages run on the GPU and each op is timed by the host until the device is done with it
(`torch.cuda.synchronize` after the op), as a rank that waits on its next message would see it; two more rows
split it: "launch", the host's time until the op's Python returns, and "kernels", CUDA events around the op (the
device's span). A launch that grows after a pause is the host's caches; kernels that grow, the GPU's clocks or
caches.
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
from planner.profiling.devices import resolve_device  # noqa: E402
from planner.profiling.model_file import ModelFile, default_loss, load_model_file  # noqa: E402
from planner.profiling.profiler import ProfileSettings, profile_model  # noqa: E402
from runtime.nested import map_tensors, tensors  # noqa: E402
from runtime.stages import build_stages  # noqa: E402

BATCH = 8  # the microbatch: the profile's batch, as `planner partition` keeps it
MICROBATCHES = 4
ROUNDS = 3


def stage_ops(model_file: ModelFile, device: torch.device
              ) -> list[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """Per stage of a straight 2-stage plan on `device`: (name, forward, backward of what that forward returned)."""
    settings = ProfileSettings(batch_size=BATCH, device=device.type, warmup=1, iters=3, threads=1, processes=1)
    profile = profile_model(model_file, settings)
    plan = partition(profile, make_cluster(2), straight=True, schedule="1f1b", microbatches=MICROBATCHES)
    torch.manual_seed(0)
    model = model_file.build_model().to(device).train()
    inputs, target = map_tensors(lambda t: t.to(device), model_file.example_batch(BATCH))
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


def timed(op: Callable[[], Any], device: torch.device) -> tuple[Any, dict[str, float]]:
    """(what `op()` returned, its times in s): "until done" by the host's clock, until the device is done with it;
    on a GPU also "launch" (until `op` returns: the host's part) and "kernels" (CUDA events around it: the device's
    span from the first kernel's start)."""
    cuda = device.type == "cuda"
    if cuda:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
    start = time.perf_counter()
    out = op()
    launched = time.perf_counter()
    if not cuda:
        return out, {"until done": launched - start}
    last.record()
    torch.cuda.synchronize(device)
    return out, {"until done": time.perf_counter() - start, "launch": launched - start,
                 "kernels": first.elapsed_time(last) / 1e3}


def timed_ops(forward: Callable[[], Any], backward: Callable[[Any], None], pause_s: float, repeats: int,
              device: torch.device) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Forward and backward times (`timed`), each op after a pause of `pause_s`."""
    forwards, backwards = [], []
    for _ in range(repeats):
        if pause_s:
            time.sleep(pause_s)
        out, times = timed(forward, device)
        forwards.append(times)
        if pause_s:
            time.sleep(pause_s)
        backwards.append(timed(lambda: backward(out), device)[1])
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
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    args = parser.parse_args()
    device = resolve_device(args.device)
    torch.set_num_threads(1)
    pauses = sorted({p / 1e3 for p in [0.0, *args.pauses]})
    print(f"# {datetime.date.today()}: op ms after a pause (median of {ROUNDS} rounds x {args.repeats}), and its "
          f"ratio to back to back; one process, one torch thread, on {device}")
    print(f"{'':28s}" + "".join(f"{f'{p * 1e3:g} ms':>14s}" for p in pauses))
    control: dict[float, list[dict[str, float]]] = {p: [] for p in pauses}
    for _ in range(ROUNDS):
        for p in pauses:
            control[p] += timed_ops(python_loop, lambda _: None, p, args.repeats, torch.device("cpu"))[0]
    print_rows("pure-Python loop (control)", control)
    if device.type == "cuda":  # one kernel of a few ms: grows after a pause only if the GPU's clocks or caches do
        a, b = torch.randn(4096, 4096, device=device), torch.randn(4096, 4096, device=device)
        product: dict[float, list[dict[str, float]]] = {p: [] for p in pauses}
        for _ in range(ROUNDS):
            for p in pauses:
                product[p] += timed_ops(lambda: a @ b, lambda _: None, p, args.repeats, device)[0]
        print_rows("4096^2 product (GPU control)", product)
    for name in args.models:
        model_file = load_model_file(MODEL_FILES[name])
        for stage, forward, backward in stage_ops(model_file, device):
            for _ in range(5):  # warm-up
                backward(forward())
            found: dict[float, tuple[list[dict[str, float]], list[dict[str, float]]]] = {p: ([], []) for p in pauses}
            for _ in range(ROUNDS):
                for p in pauses:
                    forwards, backwards = timed_ops(forward, backward, p, args.repeats, device)
                    found[p][0].extend(forwards)
                    found[p][1].extend(backwards)
            for index, what in enumerate(("forward", "backward")):
                print_rows(f"{name} {stage} {what}", {p: samples[index] for p, samples in found.items()})


def print_rows(label: str, samples: dict[float, list[dict[str, float]]]) -> None:
    """One row per kind of time (`timed`): the label's row is the time until done, then the GPU's parts."""
    for kind in samples[0.0][0]:
        medians = {p: statistics.median(times[kind] for times in found) for p, found in samples.items()}
        print(row(label if kind == "until done" else f"  {kind}", medians), flush=True)


if __name__ == "__main__":
    main()
