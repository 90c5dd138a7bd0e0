"""Dataflow measurement: cut bytes with skip connections, output and saved bytes, parameter use."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from planner.profiling.dataflow import Dataflow, measure_dataflow
from planner.profiling.layers import find_layers
from planner.profiling.model_file import checked_example_batch, default_loss, load_model_file
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
    # the part of them made before the layer: x, the model's input (the relu output is layer 0's own)
    assert flow.input_saved_bytes == [4 * 16 * FLOAT, 0]
    # the skip x and the hidden activation both cross the only boundary
    assert flow.cut_bytes == [4 * 32 * FLOAT + 4 * 16 * FLOAT, 0]
    assert flow.output_bytes == [4 * 32 * FLOAT, 4 * 16 * FLOAT]


def test_the_saved_bytes_made_before_a_layer_are_its_inputs_it_saves_first() -> None:
    """Two Linears: each saves its input, the first the model's x, the second the first's output h; a stage
    from either layer receives what it saves. A ReLU after h in the first layer would save h there instead."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    layers = find_layers(model, lambda: model(x))
    flow = measure_dataflow(model, layers, (x,), lambda: model(x).sum())
    assert flow.saved_bytes == flow.input_saved_bytes == [4 * 16 * FLOAT, 4 * 32 * FLOAT]
    activated = nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Linear(32, 8))
    layers = find_layers(activated, lambda: activated(x))
    flow = measure_dataflow(activated, layers, (x,), lambda: activated(x).sum())
    assert flow.saved_bytes == [4 * 16 * FLOAT + 4 * 32 * FLOAT, 0]
    assert flow.input_saved_bytes == [4 * 16 * FLOAT, 0]


def test_a_layer_that_changes_its_input_in_place_counts_no_input_saved() -> None:
    """A ReLU(inplace=True) after the cut saves its output, the first Linear's h changed in place: a stage from it
    runs on a clone of what it received (`runtime.stage_runner`), which it holds besides, so none of h counts as
    its input; the first layer's x still does."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    layers = find_layers(model, lambda: model(x))
    flow = measure_dataflow(model, layers, (x,), lambda: model(x).sum())
    assert flow.saved_bytes == [4 * 16 * FLOAT, 4 * 32 * FLOAT, 0]
    assert flow.input_saved_bytes == [4 * 16 * FLOAT, 0, 0]


class _ZeroesAView(nn.Module):
    """Changes its input in place through a view it makes itself, then squares it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, :2].zero_()
        return x.pow(2)


class _ClampsTheMask(nn.Module):
    """Uses h and changes the model's second input, a mask made before layer 0, in place."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h.pow(2) * mask.clamp_(min=0)


class _MaskedChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), _ClampsTheMask()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)), mask)


def test_a_change_through_a_view_or_by_a_later_layer_counts_no_input_saved_where_the_stage_would_clone() -> None:
    """A view of the input changed in place is the input changed (its version counter is the input's); and a
    stage from any layer up to the one that changes a tensor made before it receives that tensor, so the runtime
    clones what it received: layers a, b and c all count no input saved (the mask is the model's input)."""
    model = nn.Sequential(nn.Linear(16, 32), _ZeroesAView(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    layers = find_layers(model, lambda: model(x))
    flow = measure_dataflow(model, layers, (x,), lambda: model(x).sum())
    assert flow.saved_bytes[1] == 4 * 32 * FLOAT and flow.input_saved_bytes == [4 * 16 * FLOAT, 0, 4 * 32 * FLOAT]
    chain, mask = _MaskedChain(), torch.randn(4, 32)
    layers = find_layers(chain, lambda: chain(x, mask))
    flow = measure_dataflow(chain, layers, (x, mask), lambda: chain(x, mask).sum())
    assert [layer.name for layer in layers] == ["a", "b", "c"] and all(flow.saved_bytes)
    assert flow.input_saved_bytes == [0, 0, 0]


class _Views(nn.Module):
    """h crosses the boundary twice (itself and a view of it); a mask is expanded from 8 floats."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        flat = h.view(-1)
        mask = torch.ones(8).expand(1000, 8)  # made before `second` begins, used after
        out = self.second(h)
        return out + flat.view_as(out) + mask[: out.shape[0]]


def test_views_of_one_storage_count_once_and_expanded_tensors_at_storage_size() -> None:
    model = _Views()
    x = torch.randn(4, 8)
    layers = find_layers(model, lambda: model(x))
    flow = measure_dataflow(model, layers, (x,), lambda: model(x).sum())
    # h (4x8) and its view share one storage; the mask's storage is 8 floats
    assert flow.cut_bytes == [4 * 8 * FLOAT + 8 * FLOAT, 0]


class _SetItem(nn.Module):
    """The second layer writes the first layer's output into a buffer with `out[...] = h`."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.middle = nn.Linear(4, 4)
        self.last = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        out = self.last(self.middle(h))
        out[:, :4] = h
        return out


def test_a_tensor_consumed_by_setitem_crosses_the_boundaries_before_it() -> None:
    model = _SetItem()
    x = torch.randn(2, 4)
    layers = find_layers(model, lambda: model(x))
    flow = measure_dataflow(model, layers, (x,), lambda: model(x).sum())
    h = 2 * 4 * FLOAT
    assert flow.cut_bytes == [h, h + 2 * 4 * FLOAT, 0]


def test_the_instrumented_pass_leaves_no_graph_alive() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    x, target = torch.randn(2, 4), torch.tensor([0, 2])
    layers = find_layers(model, lambda: model(x))
    kept: list[torch.Tensor] = []

    def step() -> torch.Tensor:
        log_probs = torch.log_softmax(model(x), dim=-1)  # log_softmax saves its own output
        kept.append(log_probs)
        return torch.nn.functional.nll_loss(log_probs, target)

    measure_dataflow(model, layers, (x,), step)
    watcher = weakref.ref(kept.pop())
    assert watcher() is None  # freed with its graph, not held by a saved-tensor cycle


class VmapMasked(nn.Module):
    """A mask built with torch.vmap before the layers and passed to each (transformers 4.x's `sdpa_mask`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0])
        mask = torch.vmap(lambda row: row >= rows)(rows)  # (batch, batch) bool, made inside a vmap
        h = self.embed(x)
        for layer in self.layers:
            h = layer(mask.float() @ h)
        return h


def test_a_tensor_made_inside_a_vmap_counts_from_its_first_use() -> None:
    """Inside torch.vmap the tensors are functorch wrappers without a storage of their own: tracing them failed
    (`Cannot access storage of BatchedTensorImpl`). What the vmap returns crosses every cut to its last use."""
    model, x = VmapMasked(), torch.randn(5, 6)
    layers = find_layers(model, lambda: model(x))
    names = [layer.name for layer in layers]
    flow = measure_dataflow(model, layers, (x,), lambda: model(x).sum())
    cut = dict(zip(names, flow.cut_bytes))
    # the bool mask, used between the layers (as the one before: `mask.float()` ahead of each), last before layers.2
    hidden, mask = 5 * 8 * FLOAT, 5 * 5
    assert cut["embed"] == cut["layers.0"] == hidden + mask
    assert cut["layers.1"] == hidden
    assert cut["layers.2"] == 0


class CachedTable(nn.Module):
    """A table the model holds as a plain attribute (not a buffer), used by every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x @ self.table)
        return x


def test_a_tensor_the_model_holds_crosses_no_cut() -> None:
    """Each stage holds its own modules' attributes: like a parameter, the table is not sent between stages."""
    model, x = CachedTable(), torch.randn(5, 8)
    layers = find_layers(model, lambda: model(x))
    flow = measure_dataflow(model, layers, (x,), lambda: model(x).sum())
    assert flow.cut_bytes[:2] == [5 * 8 * FLOAT] * 2  # the hidden state alone, not the 8 x 8 table
