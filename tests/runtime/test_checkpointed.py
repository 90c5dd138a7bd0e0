"""Activation checkpointing at the split (runtime.checkpointed through runtime.stages.split_model): a model that
checkpoints its blocks (torch.utils.checkpoint, reentrant or not, however it names the block; transformers'
gradient checkpointing) splits with each checkpointed call kept, checkpointed: its stages save what eager mode
saves and train to eager mode's gradients, under torch.fx and torch.export; what cannot be kept is refused in one
line; torch is as it was afterwards."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.kept_modules import KeptModule
from autograd_saved import saved_bytes
from runtime.stages import StageSplitError, run_stages, split_model
from tests.conftest import gpu_only


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) * scale


CALLS: dict[str, Callable[[Block, torch.Tensor, bool], torch.Tensor]] = {
    "module": lambda block, h, reentrant: checkpoint(block, h, use_reentrant=reentrant),
    "bound-forward": lambda block, h, reentrant: checkpoint(block.forward, h, use_reentrant=reentrant),
    "partial-of-call": lambda block, h, reentrant: checkpoint(functools.partial(block.__call__, scale=0.5), h,
                                                              use_reentrant=reentrant),
}


class Model(nn.Module):
    """embed, 3 checkpointed blocks, head; `by_len` reshapes with len() (torch.fx cannot trace that)."""

    def __init__(self, call: str, reentrant: bool, by_len: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(4, 16), nn.Linear(16, 2)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.call, self.reentrant, self.by_len = CALLS[call], reentrant, by_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.by_len:
            h = h.reshape(len(h), -1)
        for block in self.blocks:
            h = self.call(block, h, self.reentrant)
        return self.head(h)


def _torch_now() -> list[Any]:
    return [torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction.forward,
            nn.Module.__call__, dict(Block.__dict__)]


@pytest.mark.parametrize("by_len, method", [(False, "fx"), (True, "export")])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("call", list(CALLS))
def test_checkpointed_blocks_stay_checkpointed_once_split(call: str, reentrant: bool, by_len: bool,
                                                          method: str) -> None:
    before = _torch_now()
    model, x = Model(call, reentrant, by_len), torch.randn(32, 4)
    reference = copy.deepcopy(model)
    if call == "bound-forward" and not reentrant:  # torch calls the bound forward itself: traced through, unkept,
        _traced_through(model, reference, x, "head")  # and no block is entered as a module (none can begin a stage)
        assert _torch_now() == before
        return
    stages = split_model(model, ["blocks.1"], (x,))
    assert stages.method == method
    assert _torch_now() == before
    kept = [node.target for stage in stages for node in stage.graph.nodes if isinstance(node.target, KeptModule)]
    assert [target.path for target in kept] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(target.checkpoint["use_reentrant"] is reentrant for target in kept)
    eager = saved_bytes(lambda: reference(x))
    assert eager < saved_bytes(lambda: _uncheckpointed(reference)(x)) / 2  # checkpointing saves memory here
    assert saved_bytes(lambda: run_stages(stages, x)) == eager
    run_stages(stages, x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, wanted.grad, rtol=1e-6, atol=1e-7, msg=name)


def _uncheckpointed(model: Model) -> Model:
    """A copy that calls its blocks without checkpointing."""
    plain = copy.deepcopy(model)
    plain.call = lambda block, h, _reentrant: block(h)
    return plain


def _traced_through(model: Model, reference: Model, x: torch.Tensor, split_point: str = "blocks.1") -> None:
    """The split traces through a non-reentrant checkpoint it cannot keep (as before it kept any): the stages
    keep every activation, and train to eager mode's gradients."""
    stages = split_model(model, [split_point], (x,))
    assert not [node for stage in stages for node in stage.graph.nodes if isinstance(node.target, KeptModule)]
    assert saved_bytes(lambda: run_stages(stages, x)) > saved_bytes(lambda: reference(x))
    run_stages(stages, x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, wanted.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_checkpointed_function_that_is_not_a_module_call_is_traced_through() -> None:
    model, x = Model("module", False, True), torch.randn(8, 4)
    model.call = lambda block, h, _reentrant: checkpoint(lambda value: block(value) * 2, h, use_reentrant=False)
    reference = copy.deepcopy(model)
    _traced_through(model, reference, x)


def test_transformers_checkpoint_keywords_for_the_layer_reach_the_layer() -> None:
    """`self._gradient_checkpointing_func(layer.__call__, h, scale=...)`: `scale` is the layer's, not torch's."""
    model, x = Model("module", True, True), torch.randn(8, 4)
    for block in model.blocks:
        block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    model.call = lambda block, h, _reentrant: block._gradient_checkpointing_func(block.__call__, h, scale=0.5)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["blocks.1"], (x,))
    kept = [node.target for stage in stages for node in stage.graph.nodes if isinstance(node.target, KeptModule)]
    assert [target.checkpoint for target in kept] == [{"use_reentrant": False}] * 3
    torch.testing.assert_close(run_stages(stages, x), reference(x), rtol=0, atol=0)


class Scale:
    """A plain object (not a pytree node) that carries a value to a block."""

    def __init__(self, value: Any) -> None:
        self.value = value


@pytest.mark.parametrize("by_len", [False, True], ids=["fx", "export"])
def test_a_checkpointed_call_given_an_object_holding_a_forward_value_is_refused_in_one_line(by_len: bool) -> None:
    """The node would hold the object with the capture's value in it (export's fake tensor, fx's proxy)."""
    model, x = Model("module", False, by_len), torch.randn(8, 4)
    model.call = lambda block, h, _reentrant: checkpoint(block, h, Scale(torch.sigmoid(h.mean())).value * 0 + 1.0,
                                                         use_reentrant=False)  # a tensor given as itself: fine
    split_model(model, ["blocks.1"], (x,))
    model.call = lambda block, h, _reentrant: checkpoint(lambda value, scale: block(value, scale.value), h,
                                                         Scale(torch.sigmoid(h.mean())), use_reentrant=False)
    split_model(model, ["blocks.1"], (x,))  # not a module call: traced through, the value stays the graph's
    for block in model.blocks:
        block.__class__ = ScaledBlock
    model.call = lambda block, h, _reentrant: checkpoint(block, h, Scale(torch.sigmoid(h.mean())), use_reentrant=False)
    with pytest.raises(StageSplitError, match=r"checkpointed blocks.0, which the split keeps whole, is given a Scale "
                                              r"object .* \(Scale.value\)"):
        split_model(model, ["blocks.1"], (x,))


class ScaledBlock(Block):
    def forward(self, x: torch.Tensor, scale: Scale) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, scale.value)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_model_holding_a_module_under_two_names_keeps_its_checkpointed_blocks(reentrant: bool) -> None:
    """torch.export then hands the forward stand-ins of every module (`_AttrProxy`; T5's shared embedding
    makes transformers' T5 such a model): each is known as the model's own module."""
    model, x = Model("module", reentrant, True), torch.randn(8, 4)
    model.alias = model.embed  # one module, two names
    reference = copy.deepcopy(model)
    stages = split_model(model, ["blocks.1"], (x,))
    assert stages.method == "export"
    kept = [node.target.path for stage in stages for node in stage.graph.nodes if isinstance(node.target, KeptModule)]
    assert kept == ["blocks.0", "blocks.1", "blocks.2"]
    run_stages(stages, x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, wanted.grad, rtol=1e-6, atol=1e-7, msg=name)


class Routed(nn.Module):
    """Top-1 routing over two experts as transformers 4.46's Mixtral routes: rows picked by `torch.where` (sizes
    that depend on the data) and added back with `index_add_`; no branch on a value, so export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            (rows,) = torch.where(choice == index)
            out = out.index_add(0, rows, expert(x[rows]))
        return x + out


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_block_that_routes_by_the_data_is_kept_checkpointed(reentrant: bool) -> None:
    """Learning its output's shape on export's fake tensors makes sizes that the graph never holds: let go."""
    model, x = Model("module", reentrant, True), torch.randn(8, 4)
    model.blocks = nn.ModuleList(Routed() for _ in range(3))
    reference = copy.deepcopy(model)
    stages = split_model(model, ["blocks.1"], (x,))
    kept = [node.target.path for stage in stages for node in stage.graph.nodes if isinstance(node.target, KeptModule)]
    assert stages.method == "export" and kept == ["blocks.0", "blocks.1", "blocks.2"]
    run_stages(stages, x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, wanted.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_checkpointed_module_that_encloses_a_split_point_is_refused_in_one_line() -> None:
    with pytest.raises(StageSplitError, match=r"split point 'blocks.1.down' is inside blocks.1, which the forward "
                                              r"checkpoints \(torch.utils.checkpoint\) as one call"):
        split_model(Model("module", False, True), ["blocks.1.down"], (torch.randn(8, 4),))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_only)])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_transformers_gradient_checkpointing_splits_checkpointed(reentrant: bool, device: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x; gradient_checkpointing_enable before
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    tokens = torch.randint(0, 64, (4, 16))

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.gpt(input_ids=ids).logits

    wrapped = Logits()
    stages = split_model(wrapped, ["gpt.transformer.h.1"], (tokens,))  # on the CPU, as training splits
    for stage in stages:
        stage.to(device)
    reference = copy.deepcopy(wrapped)
    tokens = tokens.to(device)
    eager = saved_bytes(lambda: reference(tokens))
    # the layers get None for the causal mask the exported graph materialises, as in eager mode (they saved its
    # 4 x 16 x 16 bytes beside eager's before `export_split._causal_kept_calls`)
    if device == "cpu":
        assert saved_bytes(lambda: run_stages(stages, tokens)) == eager
    else:  # attention may save what another kernel needs; without checkpointing it is x17
        assert saved_bytes(lambda: run_stages(stages, tokens)) <= 1.5 * eager
    run_stages(stages, tokens).square().mean().backward()
    reference(tokens).square().mean().backward()
    for (name, parameter), wanted in zip(wrapped.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, wanted.grad, rtol=1e-5, atol=1e-7, msg=name)


class Attention(nn.Module):
    """Self-attention over (batch, length, 16) in 2 heads; `mask` None reads as causal where `none_is_causal` (as
    transformers' SDPA path reads it), as no mask at all otherwise (as its eager path does)."""

    def __init__(self, none_is_causal: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.none_is_causal = nn.Linear(16, 48), nn.Linear(16, 16), none_is_causal

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (part.unflatten(-1, (2, 8)).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=-1))
        causal = mask is None and self.none_is_causal
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return x + self.out(attended.transpose(1, 2).flatten(-2))


class KeysAttended(nn.Module):
    """h times the most keys a query attends to over their count (1 for a causal mask), from an integer mask."""

    def forward(self, h: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        return h * ones.sum(-1).amax() / ones.shape[-1]


class Masked(nn.Module):
    """embed, 3 checkpointed attention layers given a causal mask the forward builds from the length (as
    transformers builds one under torch.export), head; reshaped with len() so that the split exports it."""

    def __init__(self, none_is_causal: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(4, 16), nn.Linear(16, 2)
        self.layers = nn.ModuleList(Attention(none_is_causal) for _ in range(3))
        self.scale = KeysAttended()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).reshape(len(x), x.shape[1], -1)
        length = x.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril().expand(len(x), 1, length, length)
        for layer in self.layers:
            h = checkpoint(layer, h, mask, use_reentrant=False)
        h = checkpoint(self.scale, h, mask.long(), use_reentrant=False)  # an integer one too (DeBERTa's), left as is
        return self.head(h)


@pytest.mark.parametrize("none_is_causal", [True, False], ids=["None is causal", "None is no mask"])
def test_a_checkpointed_layer_given_the_causal_mask_takes_none_where_that_is_the_same(none_is_causal: bool) -> None:
    """As eager transformers passes None where it attends causally (SDPA's is_causal: its flash kernel on a GPU),
    which it materialises under torch.export only: the layers that read None as causal get None (no mask
    saved, none sent between stages), the others keep it; both train to eager mode's gradients."""
    model, x = Masked(none_is_causal), torch.randn(4, 6, 4)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["layers.1"], (x,))
    assert stages.method == "export"
    kept = [node for stage in stages for node in stage.graph.nodes if isinstance(node.target, KeptModule)]
    assert len(kept) == 4 and all((node.args[2] is None) is none_is_causal for node in kept[:3])
    assert kept[3].args[2] is not None  # an integer mask: not SDPA's
    run_stages(stages, x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, wanted.grad, rtol=1e-5, atol=1e-6, msg=name)


class WithAuxiliary(Attention):
    """Attention that also returns an empty auxiliary loss (a mixture of experts' with nothing to add)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x, mask), x.new_zeros(0)


class MaskedAuxiliary(Masked):
    def __init__(self) -> None:
        super().__init__(none_is_causal=True)
        torch.manual_seed(0)
        self.layers = nn.ModuleList(WithAuxiliary(True) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).reshape(len(x), x.shape[1], -1)
        length = x.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril().expand(len(x), 1, length, length)
        for layer in self.layers:
            h, _ = checkpoint(layer, h, mask, use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize("model_type", [functools.partial(Masked, True), MaskedAuxiliary],
                         ids=["attention", "with an empty auxiliary output"])
def test_the_trial_without_the_mask_leaves_the_random_stream_and_takes_empty_outputs(model_type: Any) -> None:
    """The trial's random inputs come from a fork of the random state (a seeded caller's stream does not move),
    and an empty output compares as equal (review findings: `.max()` of an empty output failed the split)."""
    model, x = model_type(), torch.randn(4, 6, 4)
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    stages = split_model(model, ["layers.1"], (x,))
    assert torch.equal(torch.random.get_rng_state(), before)
    kept = [node for stage in stages for node in stage.graph.nodes
            if isinstance(node.target, KeptModule) and node.target.path.startswith("layers.")]
    assert len(kept) == 3 and all(node.args[2] is None for node in kept)


class TrainsOtherwise(Attention):
    """Attention whose training path scores explicitly, where None is no mask (transformers' eager path), and whose
    eval path is SDPA's, where None is causal."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if not self.training:
            return super().forward(x, mask)
        q, k, v = (part.unflatten(-1, (2, 8)).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / 8 ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return x + self.out((scores.softmax(-1) @ v).transpose(1, 2).flatten(-2))


def test_the_trial_runs_in_the_mode_the_stages_train_in_and_moves_no_seed() -> None:
    """A layer that reads None as causal in eval mode only keeps its mask in a model split for training (a review
    finding: tried in eval mode, it got None and trained attending both ways), and the trial leaves the seed that
    CUDA's generators will take when first used as it was (it had reseeded them to 0)."""
    model = Masked(True)
    torch.manual_seed(0)
    model.layers = nn.ModuleList(TrainsOtherwise(True) for _ in range(3))
    x, reference = torch.randn(4, 6, 4), copy.deepcopy(model)
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    torch.manual_seed(42)
    queued = None if tracker is None or tracker.manual_seed_all_cb is None else tracker.manual_seed_all_cb
    stages = split_model(model, ["layers.1"], (x,))
    if tracker is not None and not torch.cuda.is_initialized():
        assert tracker.manual_seed_all_cb is queued
    kept = [node for stage in stages for node in stage.graph.nodes
            if isinstance(node.target, KeptModule) and node.target.path.startswith("layers.")]
    assert len(kept) == 3 and all(node.args[2] is not None for node in kept)
    torch.testing.assert_close(run_stages(stages, x), reference(x), rtol=1e-6, atol=1e-6)
