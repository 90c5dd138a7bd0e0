"""Peak memory of one step on CPU, tracked from live tensor storages."""

from __future__ import annotations

import torch
from torch import nn

from planner.profiling.memory import measure_peak_memory

FLOAT = 4


def test_cpu_peak_counts_weights_gradients_and_activations() -> None:
    model = nn.Linear(1000, 1000, bias=False)
    x = torch.randn(10, 1000)
    peak, method = measure_peak_memory(model, (x,), lambda: model(x).square().sum(), torch.device("cpu"))
    assert method == "live-tensors"
    weights = grads = 1000 * 1000 * FLOAT
    activation = 10 * 1000 * FLOAT
    scalar = FLOAT
    # The peak is when the weight gradient is made: weights, input x, the gradient of the
    # linear's output (its output, saved by square, was released when square's backward ran;
    # square's output was never saved) and the new weight gradient; plus the loss and its
    # gradient (scalars). The forward's peak, weights + 3 activations, is lower.
    assert peak == weights + grads + 2 * activation + 2 * scalar

def test_cpu_peak_sees_a_large_temporary() -> None:
    model = nn.Linear(10, 10)
    x = torch.randn(4, 10)

    def step() -> torch.Tensor:
        big = torch.zeros(1_000_000)  # 4 MB that lives only inside the step
        return model(x).sum() + big.sum()

    peak, _ = measure_peak_memory(model, (x,), step, torch.device("cpu"))
    assert peak >= 1_000_000 * FLOAT
