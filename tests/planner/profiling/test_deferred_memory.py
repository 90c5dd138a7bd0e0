"""Tests of planner/profiling/deferred_memory.py: the bytes a split backward keeps per layer from B to W, and what
its B holds per layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.profiling.deferred_memory import SplitMemory, measure_split_memory
from planner.profiling.layers import find_layers
from planner.profiling.memory import measure_workspace

FLOAT = 4  # bytes per float32


def _split(model: nn.Module, x: torch.Tensor) -> SplitMemory | None:
    layers = find_layers(model, lambda: model(x))
    found = measure_split_memory(model, layers, (x,), lambda: (model(x) ** 2).sum(),
                                 lambda: model.zero_grad(set_to_none=True), model.parameters())
    assert not any(layer.module._forward_hooks or layer.module._forward_pre_hooks for layer in layers)  # removed
    assert all(parameter.grad is None for parameter in model.parameters())  # after_step ran
    return found


def _measure(model: nn.Module, x: torch.Tensor) -> list[int]:
    found = _split(model, x)
    assert found is not None
    return found.deferred_bytes


def test_each_linear_after_the_first_keeps_its_outputs_gradient_and_b_frees_what_only_it_read() -> None:
    """B records the gradient entering each linear's backward (its output's size) for W's weight product; a
    ReLU has no weight and keeps nothing; the first layer, a stage's data input, keeps nothing. Once B has run
    and the loss is let go, the loss's saved output (the square's input, 32 x 16), which only the input
    gradient reads, is gone: freed for the last layer. A product with a constant frees nothing of the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 16))
    found = _split(model, torch.randn(32, 64))
    assert found is not None
    assert found.deferred_bytes == [0, 0, 32 * 128 * FLOAT, 32 * 16 * FLOAT]
    assert found.freed_by_b_bytes == [0, 0, 0, 32 * 16 * FLOAT]
    layers = find_layers(model, lambda: model(torch.randn(32, 64)))
    x = torch.randn(32, 64)
    scale = torch.randn(32, 16)  # a product with a constant saves the constant, nothing of the model's
    unsaved = measure_split_memory(model, layers, (x,), lambda: (model(x) * scale).sum(),
                                   lambda: model.zero_grad(set_to_none=True), model.parameters())
    assert unsaved is not None and unsaved.freed_by_b_bytes == [0, 0, 0, 0]


def test_the_bytes_grow_with_the_batch() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    small, large = _measure(model, torch.randn(4, 8)), _measure(model, torch.randn(16, 8))
    assert small[0] == large[0] == 0 and all(4 * a == b > 0 for a, b in zip(small[1:3], large[1:3]))


def test_nothing_is_measured_with_one_layer_or_nothing_to_cut() -> None:
    """None, not zeros: zeros would read as measured, and a stage's B as holding nothing."""
    assert _split(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8)) is None
    assert _split(nn.Sequential(nn.Identity(), nn.Linear(8, 8)), torch.randn(4, 8)) is None
    assert _split(nn.Sequential(nn.Flatten(), nn.Linear(8, 8), nn.Linear(8, 8)), torch.randn(4, 8)) is None


def test_a_w_call_holds_the_weights_of_parallel_projections_together() -> None:
    """A layer with separate query, key and value projections of its input: W computes their three weight
    gradients in one call, so it holds 3 x 64 x 64 floats (and the biases) at once; a plain linear layer holds
    its own weight and bias."""

    class Projections(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) * self.k(x) + self.v(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), Projections(), nn.Linear(64, 64))
    found = _split(model, torch.randn(8, 64))
    assert found is not None
    assert found.weight_workspace_bytes == [0, 3 * (64 * 64 + 64) * FLOAT, (64 * 64 + 64) * FLOAT]


def test_b_holds_the_gradient_flowing_in_and_the_one_it_makes_less_what_later_layers_keep() -> None:
    """Linear(64, 128), ReLU, Linear(128, 128), Linear(128, 16) at batch 32, cut after the first. B at the last
    linear holds the loss's gradient (32 x 16, which it keeps for W) and makes its input's (32 x 128); at the middle
    one, the gradient flowing in (32 x 128, kept) and its input's; at the ReLU the gradient flowing in and its
    own, the received input's, with the two later layers' kept gradients not counted. The stage's received input
    is held apart, as saved activations are (the ReLU saves its output, not it). A few bytes of the loss's scalar
    gradients ride along."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 16))
    found = _split(model, torch.randn(32, 64))
    assert found is not None
    held = found.input_workspace_bytes
    wide, narrow = 32 * 128 * FLOAT, 32 * 16 * FLOAT
    assert held[0] == 0
    assert [nbytes - expected for nbytes, expected in zip(held[1:], [2 * wide, 2 * wide, narrow + wide])] == \
        [pytest.approx(0, abs=16)] * 3


def test_b_piles_up_the_gradients_a_block_keeps_beyond_a_whole_backwards_workspace() -> None:
    """A block of convolution, batch norm, convolution, batch norm keeps each one's output gradient for W as B
    runs through it (4 activations), on top of the gradient flowing and the one it makes: B holds more there
    than the whole backward does (which frees each gradient as it goes)."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            self.conv1, self.norm1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
            self.conv2, self.norm2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x))))))

    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), Block(16), nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    x = torch.randn(8, 3, 16, 16)
    found = _split(model, x)
    assert found is not None
    activation = 8 * 16 * 16 * 16 * FLOAT
    assert found.deferred_bytes[1] == 4 * activation
    layers = find_layers(model, lambda: model(x))
    whole, _ = measure_workspace(model, layers, (x,), lambda: (model(x) ** 2).sum())
    assert found.input_workspace_bytes[1] >= 4 * activation + activation > whole[1]
