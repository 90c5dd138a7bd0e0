"""The torch.export split (runtime.export_split via runtime.stages): real transformers models split into stages that
reproduce the model's outputs and gradients in training mode, hold the model's own tensors under its names, and
refuse what they cannot run with one line."""

from __future__ import annotations

import copy
import os
from functools import lru_cache
from typing import Any, Callable

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # noqa: E402

from planner.profiling.keyword_inputs import keyword_model  # noqa: E402
from planner.profiling.model_file import default_loss  # noqa: E402
from real_model_worker import model_file  # noqa: E402
from runtime.export_split import ExportFailure, _construct, capture, first_nodes  # noqa: E402
from runtime.stages import StageSplitError, Stages, describe_boundaries, run_stages, split_model  # noqa: E402


class _Logits(nn.Module):
    """A transformers model returning `.logits` (as a model file would wrap it)."""

    def __init__(self, inner: nn.Module, **call: Any) -> None:
        super().__init__()
        self.inner, self.call = inner, call

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) == 2:
            return self.inner(input_ids=inputs[0], decoder_input_ids=inputs[1], **self.call).logits
        return self.inner(inputs[0], **self.call).logits


def _bert() -> nn.Module:
    return _Logits(transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3)))


def _vit() -> nn.Module:
    return _Logits(transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32, num_labels=3)))


def _t5() -> nn.Module:
    return _Logits(transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_ff=32, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=2)),
        use_cache=False)


def _tiny(name: str) -> Callable[[], nn.Module]:
    """The model file's model as its own build_model() returns it (Llama's takes its inputs by name in the file:
    here it is called with the token ids alone, positionally)."""
    return lambda: model_file(name).module.build_model()


# name -> (model maker, inputs maker, split points); every model has dropout on by default (Llama has none)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, ...]], list[str]]] = {
    "gpt2": (_tiny("gpt2_tiny"), lambda: (torch.randint(0, 96, (2, 12)),), ["gpt.transformer.h.1", "gpt.transformer.h.3"]),
    "llama": (_tiny("llama_tiny"), lambda: (torch.randint(0, 96, (2, 12)),), ["model.layers.2"]),
    "bert": (_bert, lambda: (torch.randint(0, 64, (2, 8)),), ["inner.bert.encoder.layer.1", "inner.bert.pooler"]),
    "vit": (_vit, lambda: (torch.randn(2, 3, 16, 16),), ["inner.vit.layers.1"]),
    "t5": (_t5, lambda: (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 5))),
           ["inner.encoder.block.1", "inner.decoder.block.1"]),
}


@lru_cache(maxsize=None)
def _made(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (seed 0, training mode) and its inputs (seed 1), made once: tests deep-copy before using."""
    make, inputs, _ = MODELS[name]
    torch.manual_seed(0)
    model = make().train()
    torch.manual_seed(1)
    return model, inputs()


def _split(name: str) -> tuple[nn.Module, Stages, tuple[torch.Tensor, ...]]:
    """A fresh copy of the model, split at MODELS[name]'s points (for tests that change the stages)."""
    model, inputs = _made(name)
    model = copy.deepcopy(model)
    return model, split_model(model, MODELS[name][2], inputs), inputs


@lru_cache(maxsize=None)
def _split_shared(name: str) -> tuple[nn.Module, Stages, tuple[torch.Tensor, ...]]:
    """`_split(name)` made once, for tests that only run it once or read it (they may leave `.grad` behind)."""
    return _split(name)


@pytest.mark.parametrize("name", list(MODELS))
def test_stages_give_the_models_outputs_and_gradients_in_training_mode(name: str) -> None:
    model, stages, inputs = _split_shared(name)
    reference = copy.deepcopy(_made(name)[0])
    assert stages.method == "export" and len(stages) == len(MODELS[name][2]) + 1
    for stage in stages:  # ATen-level graphs: torch.export made them, not torch.fx
        assert any(node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
                   and node.target.namespace == "aten" for node in stage.graph.nodes)
    assert_like_the_model(model, reference, stages, inputs)


def _logits(output: Any) -> torch.Tensor:
    """The output tensor, or a transformers ModelOutput's logits (the whole model's keeps a generation cache too)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def assert_like_the_model(model: nn.Module, reference: nn.Module, stages: Stages,
                          inputs: tuple[torch.Tensor, ...]) -> None:
    """The chained stages give `reference`'s output exactly (dropout seeded alike) and its gradients (rtol 1e-5)."""
    torch.manual_seed(7)  # dropout draws the same masks in the same order
    expected = _logits(reference(*inputs))
    torch.manual_seed(7)
    found = _logits(run_stages(stages, *inputs))
    torch.testing.assert_close(found, expected, rtol=0, atol=0)
    (expected ** 2).mean().backward()
    (found ** 2).mean().backward()
    grads = dict(reference.named_parameters())
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None, parameter_name
        torch.testing.assert_close(parameter.grad, grads[parameter_name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=parameter_name: f"{n}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_stages_hold_the_models_own_tensors_under_its_names(name: str) -> None:
    model, stages, _ = _split_shared(name)
    state = model.state_dict(keep_vars=True)
    everything = dict(model.named_parameters(remove_duplicate=False))
    everything.update(model.named_buffers(remove_duplicate=False))
    union: dict[str, torch.Tensor] = {}
    for stage in stages:
        for tensor_name, tensor in [*stage.named_parameters(remove_duplicate=False),
                                    *stage.named_buffers(remove_duplicate=False)]:
            if tensor_name.startswith("_pipeline_constants."):
                continue  # lifted constants (not the model's)
            assert everything[tensor_name] is tensor, tensor_name  # the model's object, by its name
        union.update(stage.state_dict(keep_vars=True))
    assert set(union) == set(state)  # together the stages' state_dicts are the model's, nothing else


def test_a_tied_weight_is_held_by_the_name_each_stage_reads_it_by() -> None:
    model, stages, _ = _split_shared("gpt2")
    (shared,) = stages.shared
    assert shared.stages == (0, 2) and shared.stage_names == ("gpt.transformer.wte.weight", "gpt.lm_head.weight")
    assert model.gpt.lm_head.weight is model.gpt.transformer.wte.weight


def test_rotary_tables_are_buffers_of_the_stage_but_not_saved() -> None:
    model, stages, _ = _split_shared("llama")
    name = "model.rotary_emb.inv_freq"
    assert dict(stages[0].named_buffers())[name] is dict(model.named_buffers())[name]
    assert all(name not in stage.state_dict() for stage in stages)


def test_the_cut_is_at_the_first_node_of_the_split_modules_first_call() -> None:
    model, inputs = _made("gpt2")
    captured = capture(copy.deepcopy(model), inputs)
    first = first_nodes(captured.graph, ["gpt.transformer.h.1", "gpt.transformer.ln_f"])
    assert list(first) == ["gpt.transformer.h.1", "gpt.transformer.ln_f"]
    for module_name, node in first.items():
        paths = [path for path, _ in node.meta["nn_module_stack"].values()]
        assert module_name in paths
        earlier = [n for n in captured.graph.nodes][: list(captured.graph.nodes).index(node)]
        assert all(module_name not in [p for p, _ in (n.meta.get("nn_module_stack") or {}).values()] for n in earlier)


def test_other_shapes_and_another_mode_are_refused_in_one_line() -> None:
    _, stages, inputs = _split("llama")
    with pytest.raises(StageSplitError) as raised:
        stages[0](torch.randint(0, 96, (3, 12)))
    assert "\n" not in str(raised.value) and "[2x12]" in str(raised.value) and "[3x12]" in str(raised.value)
    stages[1].eval()
    hidden = stages[0](*inputs)
    with pytest.raises(StageSplitError, match="training mode") as raised:
        stages[1](*hidden)
    assert "\n" not in str(raised.value)


def test_boundaries_of_an_exported_split_are_described_without_running_it() -> None:
    _, stages, inputs = _split_shared("gpt2")
    (first, second) = describe_boundaries(stages, *inputs)
    assert [value.kind for value in first + second] == ["tensor"] * (len(first) + len(second))
    assert {value.dtype for value in first} == {torch.float32}  # the hidden state: no causal mask (SDPA's is_causal)
    with pytest.raises(StageSplitError, match=r"\[4x12\]"):
        describe_boundaries(stages, torch.randint(0, 96, (4, 12)))


class _Attention(nn.Module):
    """SDPA with a mask built in the forward: causal (`causal`), attending everywhere, or the input's (`given`)."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.project = nn.Linear(4, 12)

    def forward(self, x: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x).unsqueeze(1).chunk(3, dim=-1)
        length = x.shape[1]
        mask = {"causal": torch.ones(length, length, dtype=torch.bool).tril(),
                "everywhere": torch.ones(length, length, dtype=torch.bool), "given": given}[self.mask]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask, causal", [("causal", True), ("everywhere", False), ("given", False)])
def test_a_constant_causal_mask_becomes_sdpas_is_causal_and_the_others_stay(mask: str, causal: bool) -> None:
    """As eager transformers runs it (no mask, is_causal) where export materialised the causal mask, whose
    computation goes; a constant mask of another pattern, or one from an input (padding), is kept. (That the
    rewritten graphs compute what the models do: the exported GPT-2 and Llama tests here and in test_real_models.)"""
    torch.manual_seed(0)
    model = _Attention(mask)
    x, given = torch.randn(2, 5, 4), torch.ones(5, 5, dtype=torch.bool).tril()
    captured = capture(model, (x, given))
    (call,) = [node for node in captured.graph.nodes if node.target is torch.ops.aten.scaled_dot_product_attention.default]
    arguments = dict(zip(("query", "key", "value", "attn_mask"), call.args)) | dict(call.kwargs)
    assert (arguments.get("attn_mask") is None) == causal and bool(arguments.get("is_causal")) == causal
    assert not causal or not any(node.target is torch.ops.aten.tril.default for node in captured.graph.nodes)


class _GroupedQuery(nn.Module):
    """Causal attention of 4 query heads over 2 key-value heads repeated to 4 (transformers' repeat_kv), or (`plain`)
    over values of 4 heads of their own."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.plain = plain
        self.query, self.key_value = nn.Linear(8, 4 * 3), nn.Linear(8, 2 * 3 * 2)

    @staticmethod
    def repeat(x: torch.Tensor) -> torch.Tensor:
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.query(x).view(b, s, 4, 3).transpose(1, 2)
        k, v = self.key_value(x).view(b, s, 2, 6).transpose(1, 2).chunk(2, dim=-1)
        v = self.query(x).view(b, s, 4, 3).transpose(1, 2) if self.plain else self.repeat(v)
        return torch.nn.functional.scaled_dot_product_attention(q, self.repeat(k), v, is_causal=True)


@pytest.mark.parametrize("plain", [False, True])
def test_repeated_keys_and_values_become_sdpas_grouped_query_attention(plain: bool) -> None:
    """Keys and values both repeated over the query heads: SDPA takes them unrepeated with enable_gqa, as eager
    transformers does without a mask, and the repetition goes; values of their own heads: nothing changes."""
    torch.manual_seed(0)
    model, x = _GroupedQuery(plain), torch.randn(2, 5, 8)
    captured = capture(model, (x,))
    (call,) = [node for node in captured.graph.nodes if node.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert bool(call.kwargs.get("enable_gqa")) != plain
    assert (call.args[1].meta["val"].shape[1] == 2) != plain  # the key's heads: 2 unrepeated, 4 repeated
    assert any(node.target is torch.ops.aten.expand.default for node in captured.graph.nodes) == plain


class _Routed(nn.Module):
    """Mixture-of-experts routing with a branch on tensor values, in a forward torch.fx must trace."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            mask = choice == index
            if mask.any():
                out[mask] = expert(x[mask])
        return self.head(out)


def test_data_dependent_control_flow_is_one_line_naming_the_code_and_the_way_out(
        capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(StageSplitError) as raised:
        split_model(_Routed(), ["head"], (torch.randn(3, 4),))
    message = str(raised.value)
    assert "\n" not in message
    assert "test_export_split.py" in message and "if mask.any():" in message
    assert "--split-points" in message and "nn.Sequential" in message
    assert capfd.readouterr().err == ""  # torch.export's own dump of the partial graph is kept off the screen


def test_without_example_inputs_the_error_asks_for_them() -> None:
    model, _ = _made("llama")
    with pytest.raises(StageSplitError, match="example microbatch"):
        split_model(copy.deepcopy(model), ["model.layers.2"])


def test_export_failures_carry_the_construct() -> None:
    with pytest.raises(ExportFailure) as raised:
        capture(_Routed(), (torch.randn(3, 4),))
    assert "tensor values" in raised.value.construct


def test_the_construct_is_the_last_frame_outside_torch_even_where_python_lives_under_a_torch_folder() -> None:
    """The device machines' Python lives in /opt/torch/.venv: a transformers frame there is the user's code (seen: a
    Whisper's `if dropout_probability < self.layerdrop:` under transformers 5.17, which draws it unguarded)."""
    torch_frame = os.path.join(os.path.dirname(torch.__file__), "fx", "experimental", "symbolic_shapes.py")
    user = "/opt/torch/.venv/lib/python3.12/site-packages/transformers/models/whisper/modeling_whisper.py"
    message = (f'Could not guard on data-dependent expression\n  File "{user}", line 634, in forward\n'
               f'    if dropout_probability < self.layerdrop:  # skip the layer\n'
               f'  File "{torch_frame}", line 10, in guard_bool\n    return self.evaluate()\n')
    construct = _construct(GuardOnDataDependentSymNode(None, message))  # (its condition, then its message)
    assert construct.endswith("at modeling_whisper.py:634 in forward: `if dropout_probability < self.layerdrop:  "
                              "# skip the layer`"), construct


class _Normed(nn.Module):
    """Batch norm behind a forward torch.fx cannot trace (it calls len() on a tensor) but torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.last = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.norm(self.first(x)).reshape(len(x), -1))


def test_batch_norm_statistics_move_as_in_the_model() -> None:
    torch.manual_seed(0)
    model, x = _Normed().train(), torch.randn(5, 4)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["norm", "last"], (x,))
    assert stages.method == "export"
    for _ in range(2):
        run_stages(stages, x)
        reference(x)
    for name, buffer in reference.norm.named_buffers():
        torch.testing.assert_close(getattr(model.norm, name), buffer, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_stage_moved_to_another_device_creates_its_tensors_there(name: str) -> None:
    """Export writes the capture device into arange/to/metadata checks; a stage on another device (a rank's GPU)
    must use its own. The meta device stands in for a GPU here: nothing may come out on the CPU."""
    _, stages, inputs = _split(name)
    value: Any = tuple(tensor.to("meta") for tensor in inputs)
    for stage in stages:
        value = stage.to("meta")(*value)
        value = value if isinstance(value, tuple) else (value,)
        assert all(tensor.device.type == "meta" for tensor in pytree.tree_leaves(value))


class _Pair:
    """An output that is not tensors nor a container pytree knows."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first, self.second = first, second


class _ReturnsAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Pair:
        hidden = self.first(x)
        return _Pair(hidden, self.second(hidden))


def test_a_model_returning_an_object_is_told_to_return_tensors() -> None:
    with pytest.raises(StageSplitError) as raised:
        split_model(_ReturnsAnObject(), ["second"], (torch.randn(2, 4),))
    message = str(raised.value)
    assert "\n" not in message and "returns a _Pair, which is not tensors" in message, message
    assert "stages.py" not in message  # the failing forward is the model's, not the splitter's


def test_a_transformers_model_with_its_generation_cache_on_splits_and_keeps_it_on() -> None:
    """GPT-2's default config returns a DynamicCache, which export cannot return and no training step reads: the
    split turns it off while it captures (the stages return the logits, with no cache), and gives it back."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                                                 n_positions=16)).eval()
    ids = torch.randint(0, 50, (2, 8))
    assert model.config.use_cache and model(ids).past_key_values is not None
    stages = split_model(model, ["transformer.h.1"], (ids,))
    assert model.config.use_cache
    output = run_stages(stages, ids)
    assert output.past_key_values is None
    torch.testing.assert_close(output.logits, model(ids).logits, rtol=0, atol=0)


def test_gpt2_given_its_attention_mask_by_name_splits_into_stages_that_honour_it() -> None:
    """GPT-2's second argument is past_key_values: a padding mask goes by name (inputs by name in the model file,
    `keyword_model`), and the stages give the model's outputs and gradients with it, not without it."""
    torch.manual_seed(0)  # no cache: eager attention on the cache's contiguous copies of the keys rounds otherwise
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                                                n_positions=16, use_cache=False)).train()
    ids, mask = torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    mask[0, -3:] = 0
    model, reference = keyword_model(copy.deepcopy(base), ("input_ids", "attention_mask")), copy.deepcopy(base)
    stages = split_model(model, ["transformer.h.1"], (ids, mask))
    assert_like_the_model(model, _ByName(reference, ("input_ids", "attention_mask")), stages, (ids, mask))
    torch.manual_seed(7)
    unmasked = run_stages(stages, ids, torch.ones_like(mask)).logits
    torch.manual_seed(7)
    assert not torch.allclose(unmasked, run_stages(stages, ids, mask).logits)


class _ByName(nn.Module):
    """`model` called with its inputs by name: the reference a positional call is checked against."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, inputs)))

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # the model's names, as the split's
        return self.model.named_parameters(*args, **kwargs)


def test_a_model_output_is_rebuilt_by_the_last_stage() -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                                                 n_positions=16, use_cache=False)).eval()
    ids = torch.randint(0, 50, (2, 8))
    stages = split_model(model, ["transformer.h.1"], (ids,))
    output = run_stages(stages, ids)
    assert type(output) is type(model(ids))
    torch.testing.assert_close(output.logits, model(ids).logits, rtol=0, atol=0)


# --- more cuts, state written by the forward, constants, eval mode -----------------------------


@pytest.mark.parametrize("name, points", [
    ("t5", ["inner.encoder.block.1", "inner.decoder.block.0"]),  # the encoder's output and the decoder's inputs cross
    ("llama", ["model.layers.1", "model.layers.3.mlp", "lm_head"]),  # 3 cuts, one inside a block
])
def test_more_cuts_give_the_models_outputs_and_gradients(name: str, points: list[str]) -> None:
    base, inputs = _made(name)
    model, reference = copy.deepcopy(base), copy.deepcopy(base)
    stages = split_model(model, points, inputs)
    assert stages.method == "export" and len(stages) == len(points) + 1
    assert_like_the_model(model, reference, stages, inputs)


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_fx_cannot_trace_the_models_so_without_an_example_the_split_asks_for_one(name: str) -> None:
    model, _ = _made(name)
    with pytest.raises(StageSplitError) as raised:
        split_model(copy.deepcopy(model), MODELS[name][2])
    message = str(raised.value)
    assert "\n" not in message and "torch.fx could not trace" in message and "example" in message


class _Counting(nn.Module):
    """A forward that writes its buffers: an in-place update and a reassignment (fx cannot trace `len(x)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.last = nn.Linear(4, 2)
        self.register_buffer("average", torch.zeros(4))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        hidden = self.first(x)
        self.average.mul_(0.5).add_(hidden.detach().mean(0), alpha=0.5)
        return self.last(hidden + self.average).reshape(len(x), -1)


def test_buffers_the_forward_writes_move_as_in_the_model() -> None:
    torch.manual_seed(0)
    model, x = _Counting(), torch.randn(3, 4)
    stages = split_model(model, ["last"], (x,))
    assert stages.method == "export"
    reference = copy.deepcopy(model)  # after the split: see the known problem of the failed fx trace below
    for _ in range(3):
        torch.testing.assert_close(run_stages(stages, x), reference(x), rtol=0, atol=0)
    torch.testing.assert_close(model.steps, reference.steps, rtol=0, atol=0)
    torch.testing.assert_close(model.average, reference.average, rtol=0, atol=0)
    assert model.average.any()


class _Constant(nn.Module):
    """Tensors export lifts as constants: a plain tensor attribute and a tensor made in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.last = nn.Linear(4, 4)
        self.scale = torch.full((4,), 2.0)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = (self.first(x) * self.scale).reshape(len(x), -1)
        return self.last(hidden) + torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_lifted_constants_are_held_by_the_stage_unsaved_and_follow_it_to_another_device() -> None:
    torch.manual_seed(0)
    model, x = _Constant(), torch.randn(3, 4)
    stages = split_model(model, ["last"], (x,))
    assert stages.method == "export"
    torch.testing.assert_close(run_stages(stages, x), model(x), rtol=0, atol=0)
    constants = [name for stage in stages for name, _ in stage.named_buffers()
                 if name.startswith("_pipeline_constants.")]
    assert len(constants) == 2
    assert set().union(*(stage.state_dict() for stage in stages)) == set(model.state_dict())
    value: Any = (x.to("meta"),)
    for stage in stages:
        value = stage.to("meta")(*value)
        value = value if isinstance(value, tuple) else (value,)
    assert all(tensor.device.type == "meta" for tensor in value)


def test_stages_split_in_eval_mode_keep_the_statistics_and_refuse_training_mode() -> None:
    torch.manual_seed(0)
    model, x = _Normed().train(), torch.randn(5, 4)
    model(x)  # statistics that are not the initial ones
    model.eval()
    saved = {name: buffer.clone() for name, buffer in model.named_buffers()}
    stages = split_model(model, ["norm"], (x,))
    assert stages.method == "export"
    torch.testing.assert_close(run_stages(stages, x), model(x), rtol=0, atol=0)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, saved[name]), name
    stages[0].train()
    with pytest.raises(StageSplitError, match="eval mode") as raised:
        stages[0](x)
    assert "\n" not in str(raised.value)


# --- known problems (each test fails until its fix) ---------------------------------------------


class _Frozen(nn.Module):
    """A frozen backbone run under torch.no_grad() (export captures the block as one higher-order operation)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for layer in self.backbone:
                x = layer(x)
        return self.head(x).reshape(len(x), -1)


def test_a_split_point_inside_a_no_grad_block_begins_its_stage_or_is_refused() -> None:
    """Export wraps a no_grad block in one `wrap_with_set_grad_enabled` node, and the `getitem` after it carries the
    nn_module_stack of the block's last module: without care the cut lands after backbone.1 (stage 0 would run it
    and hold its parameters) with no error. It must begin backbone.1's stage or be refused in one line."""
    torch.manual_seed(0)
    model, x = _Frozen(), torch.randn(3, 4)
    try:
        stages = split_model(model, ["backbone.1"], (x,))
    except StageSplitError as refused:  # acceptable: one line saying the split point is inside the block
        assert "\n" not in str(refused) and "backbone.1" in str(refused)
        return
    held = [{name for name, _ in stage.named_parameters()} for stage in stages]
    assert "backbone.1.weight" not in held[0] and "backbone.1.weight" in held[1], held


def test_a_split_point_that_records_no_operation_is_not_said_to_be_never_called() -> None:
    """An nn.Identity split point is called but export records no node for it: the error must not say it is not
    called, but that it records no operation."""

    class Marked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.mark, self.last = nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(self.mark(self.first(x))).reshape(len(x), -1)

    with pytest.raises(StageSplitError) as raised:
        split_model(Marked(), ["mark"], (torch.randn(3, 4),))
    message = str(raised.value)
    assert "\n" not in message and "'mark'" in message
    assert "is not called" not in message, message


class _Caching(nn.Module):
    """A forward that counts its calls and remembers a size (fx fails later, at `len(x)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.last = nn.Linear(4, 2)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        hidden = self.first(x)
        self.width = hidden.shape[-1]
        return self.last(hidden).reshape(len(x), -1)


def test_a_failed_fx_trace_leaves_the_models_state_as_it_was() -> None:
    """torch.fx runs the forward's Python on the live model before the trace fails: what it wrote (the buffer
    `steps` counting the attempt, `width` left an fx Proxy) must be undone."""
    torch.manual_seed(0)
    model, x = _Caching(), torch.randn(3, 4)
    with pytest.raises(StageSplitError, match="example"):
        split_model(model, ["last"])
    split_model(model, ["last"], (x,))
    assert model.steps.item() == 0, "the split ran the forward on the model's buffers"
    assert not isinstance(getattr(model, "width", None), torch.fx.Proxy), "the failed trace left a Proxy on the model"


def test_a_batch_an_exported_split_cannot_run_is_refused_before_the_step_starts() -> None:
    """Captured at microbatches of 2: a batch of 5 in 2 microbatches (3 and 2) is refused before anything runs."""
    from runtime.pipeline import Pipeline, PipelineError

    _, stages, _ = _split("llama")
    parameters = [parameter for stage in stages for parameter in stage.parameters()]

    with Pipeline(stages, microbatches=2, loss_fn=default_loss) as pipeline:
        with pytest.raises(PipelineError) as raised:
            pipeline.train_step(torch.randint(0, 96, (5, 12)), torch.randint(0, 96, (5, 12)))
        message = str(raised.value)
        assert "\n" not in message and "[2x12]" in message and "[3x12]" in message
        assert "the batch of 5 splits into microbatches of 3, 2" in message
        assert all(parameter.grad is None for parameter in parameters)  # no stage ran
        pipeline.train_step(torch.randint(0, 96, (4, 12)), torch.randint(0, 96, (4, 12)))  # 2 and 2: runs
    assert all(parameter.grad is not None for parameter in parameters if parameter.requires_grad)
