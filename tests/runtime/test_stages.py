"""build_stages: chained stages reproduce each example model's output and gradients, parameters are shared."""

from __future__ import annotations

import copy
import dataclasses
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import fx, nn

from planner.files.cluster import make_cluster
from planner.errors import PlannerError
from planner.profiling.keyword_inputs import keyword_model
from planner.profiling.model_file import default_loss
from planner.planning.partition import partition
from planner.files.plan import Plan
from planner.files.profile import load_profile
from runtime_examples import model_file
from runtime.stages import (
    Stages,
    StageSplitError,
    build_stages,
    describe_boundaries,
    run_stages,
    split_model,
)

REPO = Path(__file__).resolve().parents[2]
MODELS = ("mlp", "vgg", "resnet", "gpt")
BATCH = 2


@lru_cache(maxsize=None)
def planned(name: str, stages: int) -> Plan:
    """The planner's straight 1f1b plan for the example's profile on `stages` GPUs (one stage per GPU)."""
    plan = partition(load_profile(REPO / "profiles" / f"{name}.json"), make_cluster(stages), straight=True,
                     schedule="1f1b")
    assert len(plan.stages) == stages, "partition did not use every GPU; build the plan by hand instead"
    return plan


def plan_with_splits(base: Plan, first_layers: list[str]) -> Plan:
    """`base` with its stages replaced by ones beginning at `first_layers` (other fields copied)."""
    template = base.stages[0]
    stages = tuple(
        dataclasses.replace(template, first_layer=first, last_layer=first, start=index, stop=index + 1)
        for index, first in enumerate(first_layers)
    )
    return dataclasses.replace(base, stages=stages)


def fresh(name: str, train: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """The example model (seeded, eval mode unless `train`) and one example batch."""
    torch.manual_seed(0)
    source = model_file(name)
    model = source.build_model().train(train)
    inputs, target = source.example_batch(BATCH)
    return model, (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs), target


def loss_of(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The model file's loss, or the profiler's default."""
    return model_file(name).loss_fn or default_loss


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Clones of the parameters' gradients by name; then clears them."""
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_gradients(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> None:
    """Same parameters got gradients, equal to 1e-6."""
    assert found.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.allclose(found[name], grad, rtol=1e-5, atol=1e-6), name


def check_reproduces(name: str, model: nn.Module, stages: Stages, inputs: tuple[torch.Tensor, ...],
                     target: torch.Tensor) -> None:
    """Chained stages give the model's output exactly and the same parameter gradients."""
    torch.manual_seed(1)
    expected = model(*inputs)
    loss_of(name)(expected, target).backward()
    expected_grads = gradients(model)
    torch.manual_seed(1)
    found = run_stages(stages, *inputs)
    assert torch.equal(found, expected)
    loss_of(name)(found, target).backward()
    assert_same_gradients(expected_grads, gradients(model))


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("name", MODELS)
def test_planned_stages_reproduce_forward_and_backward(name: str, count: int) -> None:
    model, inputs, target = fresh(name)
    stages = build_stages(model, planned(name, count))
    assert isinstance(stages, list) and len(stages) == count
    check_reproduces(name, model, stages, inputs, target)


def test_gpt_dropout_in_training_mode_matches_under_the_same_seed() -> None:
    model, inputs, target = fresh("gpt", train=True)
    check_reproduces("gpt", model, build_stages(model, planned("gpt", 3)), inputs, target)


@pytest.mark.parametrize("name", MODELS)
def test_stage_parameters_are_the_models_own_and_used_where_needed(name: str) -> None:
    model, _, _ = fresh(name)
    stages = build_stages(model, planned(name, 4))
    aliases: dict[int, set[str]] = {}
    for alias, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), set()).add(alias)
    holders: dict[int, list[int]] = {}
    for index, stage in enumerate(stages):
        for stage_name, parameter in stage.named_parameters():
            assert stage_name in aliases[id(parameter)], "a stage parameter is not the model's object of that name"
            holders.setdefault(id(parameter), []).append(index)
    assert holders.keys() == aliases.keys()  # every parameter is in some stage
    shared = {key: stages_ for key, stages_ in holders.items() if len(stages_) > 1}
    reported = {id(model.get_parameter(entry.names[0])): list(entry.stages) for entry in stages.shared}
    assert reported == shared


@pytest.mark.parametrize("name", ["vgg", "resnet", "gpt"])
def test_traced_stages_begin_at_their_first_layer_and_keep_trailing_functional_ops(name: str) -> None:
    model, _, _ = fresh(name)
    plan = planned(name, 4)
    stages = build_stages(model, plan)
    for stage, stage_plan in zip(stages[1:], plan.stages[1:]):
        first = next(node for node in stage.graph.nodes if node.op != "placeholder")
        assert (first.op, first.target) == ("call_module", stage_plan.first_layer)
    if name == "resnet":  # flatten after avgpool belongs to avgpool's layer, not to fc's
        tail = build_stages(model, plan_with_splits(plan, ["conv1", "fc"]))
        assert tail.signatures[1].inputs == ("flatten",)
        assert [node.op for node in tail[1].graph.nodes] == ["placeholder", "call_module", "output"]


def test_gpt_tied_embedding_is_one_parameter_reported_as_shared() -> None:
    model, _, _ = fresh("gpt")
    stages = build_stages(model, planned("gpt", 4))
    assert len(stages.shared) == 1
    tied = stages.shared[0]
    assert set(tied.names) == {"transformer.wte.weight", "lm_head.weight"}
    assert tied.stages == (0, 3) and tied.stage_names == ("transformer.wte.weight", "lm_head.weight")
    assert stages[0].get_parameter(tied.stage_names[0]) is stages[3].get_parameter(tied.stage_names[1])
    assert stages[0].get_parameter(tied.stage_names[0]) is model.lm_head.weight


@pytest.mark.parametrize("name", MODELS)
def test_stage_by_stage_backward_on_copies_sums_to_the_models_gradients(name: str) -> None:
    model, inputs, target = fresh(name)
    stages = build_stages(model, planned(name, 4))
    loss_of(name)(model(*inputs), target).backward()
    expected = gradients(model)
    assert_same_gradients(expected, pipelined_gradients(model, stages, inputs, target, loss_of(name)))


def pipelined_gradients(model: nn.Module, stages: Stages, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients as a multi-device runtime gets them: copied stages, detached boundaries, backward stage by
    stage, then each parameter's gradients summed over the stages (by `shared`) under its model name."""
    copies = [copy.deepcopy(stage) for stage in stages]
    received, sent = [], []
    args: tuple[Any, ...] = inputs
    for stage in copies:
        args = tuple(a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args)
        received.append(args)
        # a stage may begin in place (vgg: ReLU(inplace=True)), which a leaf tensor does not allow
        output = stage(*(a.clone() if torch.is_tensor(a) and a.requires_grad else a for a in args))
        sent.append(output)
        args = output if isinstance(stage, fx.GraphModule) else (output,)
    loss_fn(sent[-1], target).backward()
    for index in range(len(copies) - 2, -1, -1):
        outputs = sent[index] if isinstance(copies[index], fx.GraphModule) else (sent[index],)
        pairs = [(out, arg.grad) for out, arg in zip(outputs, received[index + 1])
                 if torch.is_tensor(arg) and arg.grad is not None]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    canonical = {alias: name for name, p in model.named_parameters()
                 for alias, q in model.named_parameters(remove_duplicate=False) if q is p}
    holders = {(index, name) for entry in stages.shared for index, name in zip(entry.stages, entry.stage_names)}
    summed: dict[str, torch.Tensor] = {}
    for index, stage in enumerate(copies):
        for name, parameter in stage.named_parameters():
            assert parameter.grad is not None, f"stage {index} holds {name} but does not use it"
            key = canonical[name]
            if key in summed:
                assert (index, name) in holders, f"{name} is in two stages but not reported as shared"
                summed[key] = summed[key] + parameter.grad
            else:
                summed[key] = parameter.grad.clone()
    return summed


def test_resnet_skip_connections_cross_a_split_inside_a_block() -> None:
    model, inputs, target = fresh("resnet")
    plan = plan_with_splits(planned("resnet", 2), ["conv1", "layer1.1.conv2", "layer2.0.downsample", "fc"])
    stages = build_stages(model, plan)
    signatures = stages.signatures
    assert len(signatures[0].outputs) == 2  # the block's input (identity skip) and its main path
    assert len(signatures[1].outputs) == 2  # the block's input (for the 1x1 projection) and conv2's path
    assert all(later.inputs == earlier.outputs for earlier, later in zip(signatures, signatures[1:]))
    boundaries = describe_boundaries(stages, *inputs)
    assert [spec.shape for spec in boundaries[1]] == [(BATCH, 16, 32, 32), (BATCH, 32, 16, 16)]
    check_reproduces("resnet", model, stages, inputs, target)


def test_gpt_residual_crosses_a_split_inside_a_block() -> None:
    model, inputs, target = fresh("gpt")
    plan = plan_with_splits(planned("gpt", 2), ["transformer.wte", "transformer.h.2.mlp", "transformer.h.5.attn"])
    stages = build_stages(model, plan)
    assert all(len(signature.outputs) == 2 for signature in stages.signatures[:-1])
    check_reproduces("gpt", model, stages, inputs, target)


def test_a_transformers_output_traced_by_torch_fx_leaves_the_last_stage_as_the_model_returns_it() -> None:
    """BertForMaskedLM given its input_ids by name (as a model file's dict gives them: the other arguments then stay
    None) traces with torch.fx, which made its MaskedLMOutput a plain dict ({'logits': ...}) in the last stage: the
    default loss could not read it, and `planner train` of a bare BERT failed on its last rank."""
    transformers = pytest.importorskip("transformers")
    model = keyword_model(transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), ("input_ids",))
    ids = torch.randint(0, 64, (2, 8))
    stages = split_model(model, ["bert.encoder.layer.1"], (ids,))
    assert "MaskedLMOutput(logits = " in stages[1].code  # traced (an exported stage rebuilds it with tree_unflatten)
    hidden = stages[0](ids)
    output, expected = stages[1](*(hidden if isinstance(hidden, tuple) else (hidden,))), model(ids)
    assert type(output) is type(expected) and list(output.keys()) == list(expected.keys())
    assert torch.equal(output.logits, expected.logits)
    assert torch.equal(default_loss(output, ids), default_loss(expected, ids))


def test_sequential_model_is_sliced_into_sequentials() -> None:
    model, inputs, target = fresh("mlp")
    stages = build_stages(model, planned("mlp", 3))
    assert all(isinstance(stage, nn.Sequential) for stage in stages)
    assert [child for stage in stages for child in stage] == list(model)
    assert [name for stage in stages for name, _ in stage.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_sequential_split_below_a_child_is_traced() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 4))
    stages = split_model(model, ["0.2", "2"])
    assert all(isinstance(stage, fx.GraphModule) for stage in stages)
    inputs = torch.randn(3, 8)
    assert torch.equal(run_stages(stages, inputs), model(inputs))


def test_one_stage_is_the_model_itself() -> None:
    model, inputs, _ = fresh("resnet")
    stages = build_stages(model, plan_with_splits(planned("resnet", 2), ["conv1"]))
    assert list(stages) == [model] and stages.shared == ()


class Branchy(nn.Module):
    """A forward whose control flow depends on tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        if x.sum() > 0:
            x = x * 2
        return self.fc2(x)


class Stack(nn.Module):
    """Blocks with data-dependent control flow inside, run by an easily traced forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Branchy() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_untraceable_forward_names_the_construct_and_suggests_a_way_out() -> None:
    with pytest.raises(StageSplitError) as caught:
        split_model(Branchy(), ["fc2"])
    message = str(caught.value)
    assert isinstance(caught.value, PlannerError)
    assert "control flow" in message and "Branchy" in message and "test_stages.py" in message
    assert "nn.Sequential" in message and "\n" not in message


class Interrupted(nn.Module):
    """Ctrl-C while torch.fx traces the forward (a large model's split takes seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt


def test_ctrl_c_while_tracing_is_not_taken_for_an_untraceable_model() -> None:
    # a rank interrupted in its split printed a traceback of StageSplitError "torch.fx could not trace" and the
    # KeyboardInterrupt: the interrupt must reach the rank as it is (runtime.train ends it quietly)
    with pytest.raises(KeyboardInterrupt) as caught:
        split_model(Interrupted(), ["fc2"])
    assert caught.value.__context__ is None


def test_untraceable_code_inside_a_whole_block_does_not_matter() -> None:
    torch.manual_seed(0)
    model = Stack()
    inputs = torch.randn(2, 4)
    assert torch.equal(run_stages(split_model(model, ["blocks.1", "blocks.2"]), inputs), model(inputs))
    with pytest.raises(StageSplitError, match=r"blocks\.1 \(Branchy\)\.forward.*control flow"):
        split_model(model, ["blocks.1.fc2"])


def test_unknown_split_name_suggests_close_matches() -> None:
    model, _, _ = fresh("resnet")
    with pytest.raises(StageSplitError, match=r"'layer2\.O'.*close matches: .*layer2\.0"):
        build_stages(model, plan_with_splits(planned("resnet", 2), ["conv1", "layer2.O"]))
    gpt, _, _ = fresh("gpt")
    with pytest.raises(StageSplitError, match=r"plan stage 1 first_layer 'transformer\.h\.30'.*transformer\.h\.3"):
        build_stages(gpt, plan_with_splits(planned("gpt", 2), ["transformer.wte", "transformer.h.30"]))


def test_plan_of_another_model_is_rejected() -> None:
    model, _, _ = fresh("vgg")
    with pytest.raises(StageSplitError, match="plan stage 0 first_layer 'transformer.wte' is not a module of VGG"):
        build_stages(model, planned("gpt", 2))


def test_split_points_out_of_order_are_rejected() -> None:
    model, _, _ = fresh("gpt")
    with pytest.raises(StageSplitError, match="execution order"):
        split_model(model, ["transformer.h.5", "transformer.h.2"])
    mlp, _, _ = fresh("mlp")
    with pytest.raises(StageSplitError, match="order"):
        split_model(mlp, ["6", "3"])


class _ScaledByABuffer(nn.Module):
    """A traced forward that computes a tensor from a buffer alone (torch.fx keeps it as a constant of the trace)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * (self.scale * 2))


def test_a_tensor_a_traced_forward_computes_from_buffers_alone_is_held_by_its_stage() -> None:
    model, x = _ScaledByABuffer(), torch.randn(3, 4)
    before = set(model.__dict__)
    stages = split_model(model, ["b"])
    assert stages.method == "fx" and set(model.__dict__) == before  # the model as it was
    torch.testing.assert_close(run_stages(stages, x), model(x), rtol=0, atol=0)


class Rotary(nn.Module):
    """Cosines and sines of positions from a non-persistent buffer, in a no_grad block (as transformers' rotary
    embedding makes them), and from a persistent one (saved with the model) and a random draw, for comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(1, 9, dtype=torch.float32) / 8, persistent=False)
        self.register_buffer("saved_freq", torch.arange(1, 9, dtype=torch.float32) / 16)

    def forward(self, length: int) -> tuple[torch.Tensor, ...]:
        positions = torch.arange(length, dtype=torch.float32)[:, None]
        with torch.no_grad():
            angles = positions * self.inv_freq
        with torch.no_grad(), torch.autocast("cpu", enabled=False):  # a block inside a block: its draw is seen too
            noise = torch.rand(length, 8)
        return angles.cos(), angles.sin(), positions * self.saved_freq, noise


class Rotated(nn.Module):
    """A layer given the cosines, sines and the other values, as transformers' decoder layers are."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, saved: torch.Tensor,
                noise: torch.Tensor) -> torch.Tensor:
        return self.linear(x * cos + x.flip(-1) * sin) + saved + 0.0 * noise


class Positional(nn.Module):
    """Two layers each given the same cosines, sines, persistent-buffer and random values; reshaped with len()
    so that the split exports it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rotary, self.layers = Rotary(), nn.ModuleList(Rotated() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(len(x), x.shape[1], -1)
        values = self.rotary(x.shape[1])
        for layer in self.layers:
            x = layer(x, *values)
        return x


def test_values_made_of_no_input_are_computed_again_where_used_not_sent() -> None:
    """Cosines and sines of positions cross no stage boundary (each stage that uses them computes them: on gloo every
    tensor of a message is a send of its own); a value from a persistent buffer or a random draw still does, as
    computing it again could read another value; the stages compute what the model does."""
    model, x = Positional(), torch.randn(3, 5, 8)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["layers.1"], (x,))
    assert stages.method == "export"
    received = [node.meta["val"] for node in stages[1].graph.nodes if node.op == "placeholder"]
    shapes = sorted(tuple(value.shape) for value in received)
    assert shapes == [(3, 5, 8), (5, 8), (5, 8)]  # the hidden state, the persistent buffer's value and the draw
    torch.manual_seed(1)
    output = run_stages(stages, x)
    torch.manual_seed(1)
    torch.testing.assert_close(output, reference(x), rtol=0, atol=0)
    output.square().sum().backward()
    torch.manual_seed(1)
    reference(x).square().sum().backward()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, wanted.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_example_inputs_given_as_a_dict_are_refused_with_the_way_to_pass_them() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(StageSplitError) as raised:
        split_model(model, ["1"], {"input_ids": torch.zeros(2, 4)})
    message = str(raised.value)
    assert "\n" not in message and "example inputs are a dict (input_ids)" in message and "keyword_model" in message
