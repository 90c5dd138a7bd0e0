"""What a backward split into B and W costs against one whole backward, part by part, side by side.

    python benchmarks/split_backward.py [--models gpt llama mlp resnet] [--batch-sizes 1 8] [--device auto]
                                        [--steps 25]

Per model and batch size, a stage cut after the model's first layer (its outputs made grad-requiring leaves,
as a pipeline stage receives them; `planner.profiling.timing.StageInput`, what the profiler's split timing
does), and per step, in turn: one whole `loss.backward()`, then a fresh forward and B
(`backward_inputs`) then W (`backward_weights`), each part timed on the host's clock with the device
synchronized after it. Printed: the medians (ms) of the whole backward, of B and of W, with the host time
each spent before that synchronization, B's Python bookkeeping (its walk and classification of the
autograd graph), how many autograd calls W still makes, and (B + W) / whole, the ratio the profile
records as `split_backward_ratio`. Gradients are cleared after every step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.profiling import backward_split  # noqa: E402
from planner.profiling.devices import resolve_device  # noqa: E402
from planner.profiling.layers import find_layers  # noqa: E402
from planner.profiling.model_file import checked_example_batch, default_loss, load_model_file  # noqa: E402
from planner.profiling.timing import StageInput  # noqa: E402
from runtime.nested import map_tensors  # noqa: E402
from model_files import MODEL_FILES  # noqa: E402 (beside this script)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "llama", "mlp", "resnet"], choices=list(MODEL_FILES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the profiler and each training process on this machine
    print(f"# B then W against one whole backward on {device} ({args.steps} steps, the first 5 a warm-up), ms")
    for name in args.models:
        for size in args.batch_sizes:
            print(measure(name, size, device, args.steps), flush=True)


def measure(name: str, size: int, device: torch.device, steps: int) -> str:
    """One row: the medians of each part for model `name` at batch `size`."""
    model_file = load_model_file(MODEL_FILES[name])
    torch.manual_seed(0)
    model = model_file.build_model().to(device).train()
    loss_fn = model_file.loss_fn or default_loss
    inputs, target = map_tensors(lambda tensor: tensor.to(device), checked_example_batch(model_file, size))
    layers = find_layers(model, lambda: model(*inputs))
    stage = StageInput(layers[0])
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    bookkeeping = _Timer(backward_split, ("_Graph", "_classify"))
    calls = _Timer(torch.autograd, ("grad",))

    def timed(run: Callable[[], Any]) -> tuple[float, float, Any]:
        began = time.perf_counter()
        result = run()
        host = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - began) * 1e3, (host - began) * 1e3, result

    rows: list[tuple[float, ...]] = []
    try:
        for step in range(steps):
            stage.reset()
            loss = loss_fn(model(*inputs), target)
            whole, _, _ = timed(loss.backward)
            del loss
            model.zero_grad(set_to_none=True)
            stage.reset()
            loss = loss_fn(model(*inputs), target)
            bookkeeping.reset()
            b_ms, b_host, (_, pending) = timed(
                partial(backward_split.backward_inputs, [loss], [None], stage.leaves, parameters))
            walked = bookkeeping.total_ms
            calls.reset()
            w_ms, w_host, _ = timed(partial(backward_split.backward_weights, pending))
            del loss, pending
            model.zero_grad(set_to_none=True)
            if step >= 5:
                rows.append((whole, b_ms, b_host, walked, w_ms, w_host, calls.count))
    finally:
        stage.remove()
        bookkeeping.restore()
        calls.restore()
    whole, b_ms, b_host, walked, w_ms, w_host, count = (statistics.median(column) for column in zip(*rows))
    return (f"{name:7s} batch {size:2d}: whole {whole:8.2f}  B {b_ms:8.2f} (host {b_host:7.2f}, of it graph "
            f"bookkeeping {walked:5.2f})  W {w_ms:8.2f} (host {w_host:7.2f}, {count:.0f} autograd calls)  "
            f"(B + W) / whole {(b_ms + w_ms) / whole:5.2f}")


class _Timer:
    """Wraps functions of a module to add up their wall ms and count their calls, until `restore`."""

    def __init__(self, module: Any, names: tuple[str, ...]) -> None:
        self.module, self.originals = module, {name: getattr(module, name) for name in names}
        self.total_ms, self.count = 0.0, 0
        for name, original in self.originals.items():
            setattr(module, name, self._wrap(original))

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total_ms += (time.perf_counter() - began) * 1e3
                self.count += 1
        return wrapper

    def reset(self) -> None:
        self.total_ms, self.count = 0.0, 0

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(self.module, name, original)


if __name__ == "__main__":
    main()
