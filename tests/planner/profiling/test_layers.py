"""Layer discovery: execution order, fully qualified names, depth and split-point overrides."""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest
import torch
from torch import nn

from planner.errors import ProfileError
from planner.profiling.layers import Layer, find_layers
from planner.profiling.model_file import checked_example_batch, load_model_file
from tests.checkpointed_blocks import CheckpointedBlocks

# as in tests/conftest.py; not imported from there, so that the file runs without the repository on sys.path
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


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


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _MoEBlock(nn.Module):
    """A block holding a stack of its own (experts, all run here): it stays one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.experts = nn.ModuleList(_Expert() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + sum(expert(h) for expert in self.experts)


class _Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_MoEBlock() for _ in range(2))
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.norm(x)


class _Classifier(nn.Module):
    """A backbone two levels down from the model, as in `BertForSequenceClassification` wrapped once more."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Module()
        self.body.backbone = _Backbone()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body.backbone(x))


def test_blocks_deep_under_a_backbone_are_found_and_their_inner_stacks_kept_whole() -> None:
    model = _Classifier()
    x = torch.randn(2, 2)
    assert [layer.name for layer in find_layers(model, lambda: model(x))] == [
        "body.backbone.embed", "body.backbone.encoder.layers.0", "body.backbone.encoder.layers.1",
        "body.backbone.norm", "head"]


class _SubLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class _T5StyleBlock(nn.Module):
    """A block whose `layer` ModuleList holds sub-layers of one class: a stack inside a block."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_SubLayer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for sub in self.layer:
            x = sub(x)
        return x


class _Stack(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.embed = shared
        self.block = nn.ModuleList(_T5StyleBlock() for _ in range(2))
        self.final_norm = nn.LayerNorm(4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.block:
            x = block(x)
        return self.final_norm(x)


class _EncoderDecoder(nn.Module):
    """Two stacks sharing one embedding module (registered three times, as in older T5s)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 4)
        self.encoder = _Stack(self.shared)
        self.decoder = _Stack(self.shared)
        self.head = nn.Linear(4, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(ids) + self.encoder(ids).mean(dim=1, keepdim=True))


def test_blocks_with_a_same_class_sub_layer_list_stay_whole_and_a_shared_module_is_one_layer() -> None:
    model = _EncoderDecoder()
    ids = torch.randint(0, 10, (2, 5))
    layers = find_layers(model, lambda: model(ids))
    # the decoder runs first; the shared embedding is named as named_modules() names it first, and
    # its second call (in the encoder) starts no layer: it belongs to decoder.final_norm's layer
    assert [layer.name for layer in layers] == [
        "shared", "decoder.block.0", "decoder.block.1", "decoder.final_norm",
        "encoder.block.0", "encoder.block.1", "encoder.final_norm", "head"]
    _assert_called_in_first_call_order(model, lambda: model(ids), layers)


def _assert_called_in_first_call_order(model: nn.Module, run_forward: Callable[[], Any], layers: list[Layer]) -> None:
    """Every layer is a module the forward calls, named as named_modules() names it first, in first-call order."""
    first_names = {module: name for name, module in model.named_modules()}
    called: list[nn.Module] = []

    def note(module: nn.Module, _args: Any) -> None:
        if module not in called:
            called.append(module)

    handles = [module.register_forward_pre_hook(note) for module in first_names if module is not model]
    try:
        run_forward()
    finally:
        for handle in handles:
            handle.remove()
    for layer in layers:
        assert layer.module in called, f"{layer.name} is not called"
        assert layer.name == first_names[layer.module]
    order = [called.index(layer.module) for layer in layers]
    assert order == sorted(order)


# --- transformers models, built from small configs (no weights downloaded) -----------------------


@pytest.fixture(scope="module")
def transformers() -> ModuleType:
    """The transformers package; its tests are skipped without it."""
    return pytest.importorskip("transformers")


def _hf_layer_names(model: nn.Module, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> list[str]:
    """The default layers of `model(*inputs, **kwargs)`, checked to be called modules in first-call order."""
    model.eval()
    layers = find_layers(model, lambda: model(*inputs, **kwargs))
    _assert_called_in_first_call_order(model, lambda: model(*inputs, **kwargs), layers)
    return [layer.name for layer in layers]


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, 100, shape)


def test_gpt2_is_embeddings_blocks_final_norm_and_head(transformers: ModuleType) -> None:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0))
    assert _hf_layer_names(model, _ids(2, 8)) == [
        "transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
        "transformer.h.2", "transformer.ln_f", "lm_head"]


def test_llama_is_embeddings_rotary_blocks_final_norm_and_head(transformers: ModuleType) -> None:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64))
    assert _hf_layer_names(model, _ids(2, 8)) == [
        "model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.layers.2",
        "model.norm", "lm_head"]


class _BertClassifier(nn.Module):
    """A `BertForSequenceClassification` held in an attribute `bert`, as a model file would: blocks 3 levels down."""

    def __init__(self, transformers: ModuleType) -> None:
        super().__init__()
        self.bert = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, num_labels=3))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids).logits


def test_a_wrapped_bert_classifier_is_split_into_its_encoder_layers(transformers: ModuleType) -> None:
    assert _hf_layer_names(_BertClassifier(transformers), _ids(2, 8)) == [
        "bert.bert.embeddings", "bert.bert.encoder.layer.0", "bert.bert.encoder.layer.1",
        "bert.bert.encoder.layer.2", "bert.bert.pooler", "bert.dropout", "bert.classifier"]


def test_vit_is_embeddings_blocks_final_norm_and_classifier(transformers: ModuleType) -> None:
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64))
    names = _hf_layer_names(model, torch.randn(2, 3, 16, 16))
    # the blocks' container is `vit.encoder.layer` in transformers 4 and `vit.layers` in transformers 5
    blocks = [name for name in names if name.rpartition(".")[2].isdigit()]
    assert len(blocks) == 2 and blocks[0].endswith(".0") and blocks[1].endswith(".1")
    assert names == ["vit.embeddings", *blocks, "vit.layernorm", "classifier"]


def test_t5_has_both_block_stacks_in_execution_order(transformers: ModuleType) -> None:
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=100))
    names = _hf_layer_names(model, input_ids=_ids(2, 8), decoder_input_ids=_ids(2, 5))
    # transformers 5 gives each stack its own embed_tokens (weights tied to `shared`); in 4 they are
    # `shared` itself, recorded once at its first call (in the encoder) under that name
    if "shared" in names:
        embeds = (["shared"], [])
    else:
        embeds = (["encoder.embed_tokens"], ["decoder.embed_tokens"])
    assert names == [
        *embeds[0], "encoder.dropout", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm",
        *embeds[1], "decoder.dropout", "decoder.block.0", "decoder.block.1", "decoder.final_layer_norm", "lm_head"]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_call_is_one_layer_by_every_rule(reentrant: bool) -> None:
    """Open, the Sequential blocks would give layers a split cannot begin (the call trains whole)."""
    model, x = CheckpointedBlocks(reentrant, count=3), torch.randn(2, 4)
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    assert [layer.name for layer in find_layers(model, lambda: model(x))] == ["embed", *blocks, "head"]
    assert [layer.name for layer in find_layers(model, lambda: model(x), depth=3)] == ["embed", *blocks, "head"]
    with pytest.raises(ProfileError, match=r"split point 'blocks.1.1' is inside blocks.1, which the forward "
                                            r"checkpoints \(torch.utils.checkpoint\) as one call"):
        find_layers(model, lambda: model(x), split_points=["blocks.1.1"])
    assert torch.utils.checkpoint.CheckpointFunction.forward.__name__ == "forward"  # put back
    model.reentrant = None  # (not checkpointed: the blocks open as Sequentials again)
    model.forward = lambda h: model.head(model.blocks[2](model.blocks[1](model.blocks[0](model.embed(h)))))
    assert len(find_layers(model, lambda: model(x))) == 2 + 2 * 3


class _CheckpointingItself(nn.Module):
    """A block whose forward checkpoints the rest of itself, as transformers 5.x's layers do
    (`checkpoint(partial(forward, self), ...)`): its call, and its hooks, begin outside the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            return torch.utils.checkpoint.checkpoint(functools.partial(type(self).inner, self), h, use_reentrant=False)
        return self.inner(h)

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


def test_a_layer_that_checkpoints_its_own_forward_is_not_opened_at_any_depth() -> None:
    model = nn.Sequential(nn.Linear(4, 8), _CheckpointingItself(), _CheckpointingItself(), nn.Linear(8, 2))
    x = torch.randn(2, 4)
    assert [layer.name for layer in find_layers(model, lambda: model(x), depth=2)] == ["0", "1", "2", "3"]
    model.eval()  # not checkpointed: opened
    assert len(find_layers(model, lambda: model(x), depth=2)) == 6
