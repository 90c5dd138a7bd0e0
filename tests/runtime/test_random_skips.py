"""Scalar draws at capture (runtime.random_skips through runtime.stages.split_model): a layer skipped at random with
probability 0 or 1 splits, by torch.fx and by torch.export, into stages that compute what the model does and draw
nothing; a skip with a probability in between is refused in one line naming the line of the model; a draw used
otherwise is left to torch.export, which keeps it a draw."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runtime.random_skips import ScalarDraws, UniformDraw, scalar_size
from runtime.stages import StageSplitError, run_stages, split_model


class LayerDrop(nn.Module):
    """Layers skipped at random in training, the draw made whatever the probability (transformers 4.x's BART, OPT,
    Marian, Whisper); `by_len` reshapes with len() of a tensor, which torch.fx cannot trace but torch.export can."""

    def __init__(self, layerdrop: float, by_len: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.layerdrop, self.by_len = layerdrop, by_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if self.by_len:
            x = x.reshape(len(x), -1)
        for layer in self.layers:
            if self.training:
                draw = torch.rand([])
                if draw < self.layerdrop:  # skip the layer
                    continue
            x = torch.tanh(layer(x))
        return x


class RandomScale(nn.Module):
    """A scalar draw used as a number, not compared: it must stay a draw in every step."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x) * torch.rand([]))


def _same_as_the_model(model: nn.Module, names: list[str], x: torch.Tensor) -> str:
    """Split `model` (training mode) at `names`; its stages give the model's output and gradients and draw nothing.
    Returns the split's method."""
    reference = copy.deepcopy(model)
    stages = split_model(model, names, (x,))
    state = torch.get_rng_state()
    out = run_stages(stages, x)
    assert torch.equal(torch.get_rng_state(), state), "the stages drew random numbers"
    expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    expected.sum().backward()
    for (name, found), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(found.grad, wanted.grad, rtol=0, atol=0, msg=name)
    return stages.method


@pytest.mark.parametrize("by_len, method", [(False, "fx"), (True, "export")])
def test_a_skip_that_never_happens_splits_as_a_fixed_branch(by_len: bool, method: str) -> None:
    x = torch.randn(5, 4)
    assert _same_as_the_model(LayerDrop(0.0, by_len).train(), ["layers.1"], x) == method


@pytest.mark.parametrize("by_len", [False, True])
def test_a_skip_that_always_happens_is_fixed_too(by_len: bool) -> None:
    # every layer is skipped: the graph holds no call of a split point there
    with pytest.raises(StageSplitError, match="split point 'layers.1' (records no operation|is not called by)"):
        split_model(LayerDrop(1.0, by_len).train(), ["layers.1"], (torch.randn(5, 4),))


@pytest.mark.parametrize("by_len", [False, True])
def test_a_skip_at_random_is_refused_naming_the_line_and_the_setting(by_len: bool) -> None:
    with pytest.raises(StageSplitError) as raised:
        split_model(LayerDrop(0.3, by_len).train(), ["layers.1"], (torch.randn(5, 4),))
    message = str(raised.value)
    assert "skips work at random in training (a draw of torch.rand compared with 0.3" in message
    assert "test_random_skips.py" in message and "`if draw < self.layerdrop:  # skip the layer`" in message
    assert "set that probability to 0 (a transformers config's layerdrop" in message
    assert "\n" not in message


def test_a_draw_used_as_a_number_stays_a_draw() -> None:
    # torch.fx would run the draw while tracing and keep its value as a constant: the stage must draw anew each call
    stages = split_model(RandomScale(), ["last"], (torch.randn(3, 4),))
    assert stages.method == "export"
    x = torch.randn(3, 4)
    assert not torch.equal(run_stages(stages, x), run_stages(stages, x))


def test_a_scalar_draw_is_one_without_dimensions() -> None:
    assert all(scalar_size(args, kwargs) for args, kwargs in [((), {}), (([],), {}), (((),), {}), ((), {"size": []})])
    assert not any(scalar_size(args, kwargs) for args, kwargs in [((1,), {}), ((2, 3), {}), (([2],), {}),
                                                                  ((), {"size": (1,)})])


class ItemDrop(LayerDrop):
    """The draw read as a Python number first: `torch.rand([]).item() < p`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for layer in self.layers:
            if self.training and torch.rand([]).item() < self.layerdrop:
                continue
            x = torch.tanh(layer(x))
        return x


def test_a_draw_read_as_a_number_is_fixed_the_same_way() -> None:
    assert _same_as_the_model(ItemDrop(0.0).train(), ["layers.1"], torch.randn(5, 4)) == "fx"


def test_a_draw_used_as_a_truth_value_or_for_equality_is_not_fixed() -> None:
    draw = UniformDraw(ScalarDraws())
    with pytest.raises(TypeError):
        bool(draw)
    with pytest.raises(TypeError):
        _ = draw == 0.5
