"""Dataflow measurement: cut bytes with skip connections, output and saved bytes, parameter use."""

from __future__ import annotations

import torch
from torch import nn

from planner.dataflow import Dataflow, measure_dataflow
from planner.layers import find_layers
from planner.model_file import checked_example_batch, default_loss, load_model_file
from tests.conftest import EXAMPLES

FLOAT = 4  # bytes per float32


def _dataflow(example: str, batch_size: int, **options: object) -> tuple[list[str], Dataflow]:
    model_file = load_model_file(EXAMPLES / f"{example}.py")
    model = model_file.build_model()
    inputs, target = checked_example_batch(model_file, batch_size)
    loss_fn = model_file.loss_fn or default_loss
    layers = find_layers(model, lambda: model(*inputs), **options)
    flow = measure_dataflow(model, layers, inputs, lambda: loss_fn(model(*inputs), target))
    return [layer.name for layer in layers], flow


def test_resnet_cut_between_blocks_is_the_block_output() -> None:
    names, flow = _dataflow("resnet", batch_size=8)
    cut = dict(zip(names, flow.cut_bytes))
    # layer1 blocks: 16 channels at 32x32; layer2 blocks: 32 channels at 16x16
    assert cut["layer1.0"] == 8 * 16 * 32 * 32 * FLOAT
    assert cut["layer1.1"] == 8 * 16 * 32 * 32 * FLOAT
    assert cut["layer2.0"] == 8 * 32 * 16 * 16 * FLOAT
    assert cut["avgpool"] == 8 * 64 * FLOAT  # pooled features, before fc
    assert cut["fc"] == 0


def test_resnet_cut_inside_a_residual_block_includes_the_skip() -> None:
    names, flow = _dataflow("resnet", batch_size=8, depth=3)
    cut = dict(zip(names, flow.cut_bytes))
    block_input = 8 * 16 * 32 * 32 * FLOAT  # identity skip of layer1.1, waits for the add after bn2
    # after conv1 of an identity block: conv1's output (16x32x32) and the skip cross the boundary
    assert cut["layer1.1.conv1"] == 8 * 16 * 32 * 32 * FLOAT + block_input
    assert cut["layer1.1.relu"] == 8 * 16 * 32 * 32 * FLOAT + block_input
    # the last layer of a block hands on only the block's output
    assert cut["layer1.0.bn2"] == 8 * 16 * 32 * 32 * FLOAT
    # projection block layer2.0: conv1 halves the resolution; the 16x32x32 input waits for downsample
    assert cut["layer2.0.conv1"] == 8 * 32 * 16 * 16 * FLOAT + block_input
    assert cut["layer2.0.bn2"] == 8 * 32 * 16 * 16 * FLOAT + block_input


def test_gpt_bytes_and_tied_embedding_use() -> None:
    names, flow = _dataflow("gpt", batch_size=2)
    hidden = 2 * 64 * 128 * FLOAT
    cut = dict(zip(names, flow.cut_bytes))
    # positions (64 int64) are made in the model's forward before wte and used by wpe
    assert cut["transformer.wte"] == hidden + 64 * 8
    assert all(cut[f"transformer.h.{i}"] == hidden for i in range(12))
    assert flow.output_bytes[names.index("lm_head")] == 2 * 64 * 8192 * FLOAT
    assert flow.param_layers["transformer.wte.weight"] == [0, names.index("lm_head")]


class _TwoLinear(nn.Module):
    """x -> a (saved by the relu) -> b; a skip carries x to the end."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        return self.second(hidden) + x


def test_saved_bytes_count_activations_not_parameters() -> None:
    model = _TwoLinear()
    x = torch.randn(4, 16)
    layers = find_layers(model, lambda: model(x))
    flow = measure_dataflow(model, layers, (x,), lambda: model(x).sum())
    # layer 0: first saves its input x; relu saves its output (4x32)
    assert flow.saved_bytes[0] == 4 * 16 * FLOAT + 4 * 32 * FLOAT
    # layer 1: second saves its input, the relu output already counted; the add saves nothing
    assert flow.saved_bytes[1] == 0
    # the skip x and the hidden activation both cross the only boundary
    assert flow.cut_bytes == [4 * 32 * FLOAT + 4 * 16 * FLOAT, 0]
    assert flow.output_bytes == [4 * 32 * FLOAT, 4 * 16 * FLOAT]
