"""Modules torch.export cannot capture, kept whole (runtime.kept_modules through runtime.stages.split_model): a
mixture of experts that loops over the experts its batch hits, inside a model torch.fx cannot trace either, splits
with the experts' module as one call; its stages hold the module, train to eager mode's gradients and route other
batches as eager mode does; every module of its class is kept in one round; a split point may be such a module;
a failure inside a module that encloses a split point is still refused in one line."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from runtime.kept_modules import KeptModule
from runtime.stages import StageSplitError, run_stages, split_model, stage_args
from tests.conftest import gpu_only


class Experts(nn.Module):
    """Top-1 routing over 4 experts, looping over the experts the batch hits (data-dependent: export fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for expert in torch.unique(choice).tolist():
            rows = choice == expert
            out[rows] = self.experts[expert](x[rows])
        return x + out


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(8), Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.norm(x))


class Model(nn.Module):
    """embed, 3 layers of experts, head; reshapes with len() (torch.fx cannot trace that)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).reshape(len(x), -1)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _kept(stages: list[nn.Module]) -> list[str]:
    return [node.target.path for stage in stages for node in stage.graph.nodes if isinstance(node.target, KeptModule)]


@pytest.mark.parametrize("split_point", ["layers.1", "layers.1.moe"], ids=["a-layer", "the-kept-module-itself"])
def test_a_module_export_cannot_capture_is_kept_whole_and_trains_as_in_eager_mode(split_point: str) -> None:
    model, x = Model(), torch.randn(6, 4)
    reference = copy.deepcopy(model)
    stages = split_model(model, [split_point], (x,))
    assert stages.method == "export"
    assert _kept(stages) == ["layers.0.moe", "layers.1.moe", "layers.2.moe"]  # every module of its class
    first_stage = dict(stages[0].named_parameters())
    assert first_stage["layers.0.moe.experts.3.weight"] is model.layers[0].moe.experts[3].weight
    assert "layers.1.moe.router.weight" not in first_stage
    for batch in (x, torch.randn(6, 4) * 3):  # another batch hits other experts: routed at run time
        model.zero_grad()
        reference.zero_grad()
        found = run_stages(stages, batch)
        wanted = reference(batch)
        torch.testing.assert_close(found, wanted, rtol=0, atol=0)
        found.square().sum().backward()
        wanted.square().sum().backward()
        for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(parameter.grad, expected.grad, rtol=1e-6, atol=1e-7, msg=name)
    between = stage_args(stages[0], stages[0](x))
    torch.testing.assert_close(copy.deepcopy(stages[1])(*between), stages[1](*between))  # a copy runs the same


class ProjectedExperts(Experts):
    def forward(self, x: torch.Tensor, proj: nn.Module | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(proj(x) if proj is not None else x)


class Holding:
    """A plain callable object that holds a module (not a pytree node)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class Projecting(Model):
    """Model whose last layer's experts are given a module of the model that no other call uses (`proj`), as
    itself, its bound forward, a partial of it or inside an object."""

    def __init__(self, how: str) -> None:
        super().__init__()
        for layer in self.layers:
            layer.moe.__class__ = ProjectedExperts
        self.proj = nn.Linear(8, 8)
        self.given = {"module": self.proj, "bound-forward": self.proj.forward,
                      "partial": functools.partial(self.proj), "object": Holding(self.proj)}[how]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).reshape(len(x), -1)
        for index, layer in enumerate(self.layers):
            h = layer.moe(layer.norm(h), proj=self.given if index == 2 else None)
        return self.head(h)


@pytest.mark.parametrize("how", ["module", "bound-forward", "partial", "object"])
def test_a_module_passed_to_a_kept_call_is_held_and_trained_by_the_stage_that_makes_the_call(how: str) -> None:
    model, x = Projecting(how), torch.randn(6, 4)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["layers.1.norm"], (x,))
    holding = [index for index, stage in enumerate(stages) if "proj.weight" in dict(stage.named_parameters())]
    assert holding == [1] and not stages.shared
    assert dict(stages[1].named_parameters())["proj.weight"] is model.proj.weight
    optimizer = torch.optim.SGD(stages[1].parameters(), lr=0.1)  # what the rank of stage 1 trains
    run_stages(stages, x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(model.proj.weight.grad, reference.proj.weight.grad)
    optimizer.step()
    assert not torch.equal(model.proj.weight, reference.proj.weight)


def test_a_model_holding_a_module_under_two_names_keeps_its_modules_too() -> None:
    """torch.export then hands the forward stand-ins of its modules (`_AttrProxy`): the failing one is found."""
    model, x = Model(), torch.randn(6, 4)
    model.alias = model.head  # one module, two names
    reference = copy.deepcopy(model)
    stages = split_model(model, ["layers.1"], (x,))
    assert _kept(stages) == ["layers.0.moe", "layers.1.moe", "layers.2.moe"]
    torch.testing.assert_close(run_stages(stages, x), reference(x), rtol=0, atol=0)


def test_a_failure_inside_a_module_that_encloses_a_split_point_is_refused_in_one_line() -> None:
    with pytest.raises(StageSplitError) as raised:
        split_model(Model(), ["layers.1.moe.experts.2"], (torch.randn(6, 4),))
    message = str(raised.value)
    assert "control flow (if/while/loop bounds) or a size depends on tensor values, at test_kept_modules.py:" in message
    assert "\n" not in message


@gpu_only
def test_a_kept_module_trains_on_cuda_as_in_eager_mode() -> None:
    """Split on the CPU, as training splits, then moved: the stage's kept module goes with it."""
    model, x = Model(), torch.randn(6, 4)
    stages = split_model(model, ["layers.1"], (x,))
    for stage in stages:
        stage.to("cuda")
    reference = copy.deepcopy(model).cuda()
    batch = x.cuda() * 3
    found, wanted = run_stages(stages, batch), reference(batch)
    torch.testing.assert_close(found, wanted)
    found.square().sum().backward()
    wanted.square().sum().backward()
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
        assert parameter.device.type == "cuda", name
        torch.testing.assert_close(parameter.grad, expected.grad, msg=name)
