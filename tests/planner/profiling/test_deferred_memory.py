"""Tests of planner/profiling/deferred_memory.py: the bytes a split backward keeps per layer from B to W."""

from __future__ import annotations

import torch
from torch import nn

from planner.profiling.deferred_memory import measure_deferred_bytes
from planner.profiling.layers import find_layers

FLOAT = 4  # bytes per float32


def _measure(model: nn.Module, x: torch.Tensor) -> list[int]:
    layers = find_layers(model, lambda: model(x))
    found = measure_deferred_bytes(layers, lambda: (model(x) ** 2).sum(), lambda: model.zero_grad(set_to_none=True),
                                   model.parameters())
    assert not any(layer.module._forward_hooks or layer.module._forward_pre_hooks for layer in layers)  # removed
    assert all(parameter.grad is None for parameter in model.parameters())  # after_step ran
    return found


def test_each_linear_after_the_first_keeps_its_outputs_gradient() -> None:
    """B records the gradient entering each linear's backward (its output's size) for W's weight product; a
    ReLU has no weight and keeps nothing; the first layer, a stage's data input, keeps nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 16))
    assert _measure(model, torch.randn(32, 64)) == [0, 0, 32 * 128 * FLOAT, 32 * 16 * FLOAT]


def test_the_bytes_grow_with_the_batch() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    small, large = _measure(model, torch.randn(4, 8)), _measure(model, torch.randn(16, 8))
    assert small[0] == large[0] == 0 and all(4 * a == b > 0 for a, b in zip(small[1:], large[1:]))


def test_nothing_is_kept_with_one_layer_or_nothing_to_cut() -> None:
    assert _measure(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8)) == [0]
    assert _measure(nn.Sequential(nn.Identity(), nn.Linear(8, 8)), torch.randn(4, 8)) == [0, 0]
