"""Layer discovery: execution order, fully qualified names, depth and split-point overrides."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.errors import ProfileError
from planner.layers import find_layers
from planner.model_file import checked_example_batch, load_model_file
from tests.conftest import EXAMPLES


def _layer_names(example: str, **options: object) -> list[str]:
    model_file = load_model_file(EXAMPLES / f"{example}.py")
    model = model_file.build_model()
    inputs, _ = checked_example_batch(model_file, 2)
    return [layer.name for layer in find_layers(model, lambda: model(*inputs), **options)]


def test_gpt_layers_are_embeddings_blocks_norm_and_head() -> None:
    expected = (
        ["transformer.wte", "transformer.wpe", "transformer.drop"]
        + [f"transformer.h.{i}" for i in range(12)]
        + ["transformer.ln_f", "lm_head"]
    )
    assert _layer_names("gpt") == expected


def test_sequential_layers_are_its_children() -> None:
    assert _layer_names("mlp") == [str(i) for i in range(13)]


def test_nested_sequentials_are_expanded_but_custom_blocks_are_kept() -> None:
    assert _layer_names("resnet") == [
        "conv1", "bn1", "relu", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1",
        "avgpool", "fc",
    ]
    vgg = _layer_names("vgg")
    assert vgg[:3] == ["features.0", "features.1", "features.2"]
    assert vgg[-4:] == ["classifier.0", "classifier.1", "classifier.2", "classifier.3"]


def test_depth_goes_inside_blocks_in_execution_order() -> None:
    names = _layer_names("resnet", depth=3)
    start = names.index("layer2.0.conv1")
    # the block's skip projection runs after bn2, and the block's second relu call is not a new layer
    assert names[start:start + 6] == [
        "layer2.0.conv1", "layer2.0.bn1", "layer2.0.relu", "layer2.0.conv2", "layer2.0.bn2", "layer2.0.downsample",
    ]
    assert _layer_names("resnet", depth=1)[:4] == ["conv1", "bn1", "relu", "layer1"]


def test_split_points_start_layers_at_named_modules() -> None:
    names = _layer_names("gpt", split_points=["transformer.h.4", "transformer.h.8"])
    assert names == ["transformer.wte", "transformer.h.4", "transformer.h.8"]


def test_unknown_split_point_is_refused_with_names() -> None:
    with pytest.raises(ProfileError, match="transformer.h.99"):
        _layer_names("gpt", split_points=["transformer.h.99"])


def test_depth_and_split_points_together_are_refused() -> None:
    with pytest.raises(ProfileError, match="either"):
        _layer_names("gpt", depth=2, split_points=["transformer.h.4"])


class _Encoder(nn.Module):
    """A holder with its own forward looping over a stack of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Wrapper(nn.Module):
    """One module wrapping the whole model: the layers are found inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Encoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def test_single_wrapper_and_stack_holders_are_looked_through() -> None:
    model = _Wrapper()
    x = torch.randn(2, 4)
    names = [layer.name for layer in find_layers(model, lambda: model(x))]
    # the stack holder is expanded, and so are the Sequential blocks it holds
    assert names == [f"encoder.blocks.{i}.{j}" for i in range(3) for j in range(2)]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(x))


class _DecoderLayer(nn.Module):
    """Two attention modules of one class held as attributes: a block, not a stack."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()
        self.cross_attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cross_attn(self.self_attn(x))


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_DecoderLayer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_same_class_attributes_do_not_make_a_stack() -> None:
    model = _Decoder()
    x = torch.randn(2, 4)
    assert [layer.name for layer in find_layers(model, lambda: model(x))] == ["layers.0", "layers.1", "layers.2"]


class _Reversed(nn.Sequential):
    """A Sequential subclass whose forward runs its children backwards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in reversed(self):
            x = module(x)
        return x


def test_a_sequential_subclass_with_its_own_forward_is_ordered_by_execution() -> None:
    model = _Reversed(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    assert [layer.name for layer in find_layers(model, lambda: model(x))] == ["1", "0"]


class _GradInForward(nn.Module):
    """A physics-informed style model: its forward differentiates its own output."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 8)
        self.second = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        y = self.second(torch.tanh(self.first(x)))
        (dy,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + dy.sum(dim=1, keepdim=True)


def test_a_model_that_differentiates_in_its_forward_can_be_split() -> None:
    model = _GradInForward()
    x = torch.randn(3, 2)
    assert [layer.name for layer in find_layers(model, lambda: model(x))] == ["first", "second"]
