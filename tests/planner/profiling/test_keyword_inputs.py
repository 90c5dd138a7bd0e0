"""Tests of planner.profiling.keyword_inputs: a model file's inputs by name made positional, and the model with them."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch import fx, nn

from planner.profiling.keyword_inputs import KeywordInputs, keyword_model


class _Named(nn.Module):
    """A forward whose arguments are in another order than the batches' dicts, one of them optional."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 3)

    def forward(self, mask: torch.Tensor, ids: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.embed(ids) * mask * scale


def _batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {"ids": torch.randn(batch_size, 4), "mask": torch.rand(batch_size, 3)}, torch.zeros(batch_size)


def test_batches_become_positional_in_the_first_dicts_order_and_the_model_takes_them_so() -> None:
    inputs = KeywordInputs(_batch)
    build, example, loader = inputs.adapt(_Named, lambda size: [_batch(size), _batch(size)])
    model = build()
    assert inputs.names == ("ids", "mask")
    (ids, mask), target = example(2)
    assert type(model).__name__ == "_Named" and isinstance(model, _Named)
    assert list(model.state_dict()) == ["embed.weight", "embed.bias"]
    torch.testing.assert_close(model(ids, mask), model.embed(ids) * mask * 2.0)
    assert loader is not None
    for (ids, mask), target in loader(3):  # in the names' order whatever the dict's
        assert ids.shape == (3, 4) and mask.shape == (3, 3)
    assert inputs.positional(({"mask": mask, "ids": ids}, target))[0] == (ids, mask)


def test_positional_model_files_are_left_as_they_are() -> None:
    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 4), torch.zeros(size)

    inputs = KeywordInputs(batch)
    build, example, loader = inputs.adapt(lambda: nn.Linear(4, 2), None)
    model = build()
    assert type(model) is nn.Linear and loader is None and inputs.names == ()
    assert example(2)[0].shape == (2, 4)


def test_other_names_another_way_and_names_no_argument_can_have_are_refused() -> None:
    inputs = KeywordInputs(_batch)
    inputs.found()
    with pytest.raises(ValueError, match="inputs named ids, other, where example_batch's are ids, mask: give every"):
        inputs.positional(({"ids": torch.zeros(1), "other": torch.zeros(1)}, torch.zeros(1)))
    positional = KeywordInputs(lambda size: (torch.zeros(size, 4), torch.zeros(size)))
    assert positional.found() == ()
    with pytest.raises(ValueError, match="where example_batch\\(1\\) gave them by position"):
        positional.positional(_batch(1))
    for name in ("input-ids", "class", "self", 0):
        with pytest.raises(ValueError, match="cannot name an argument of forward"):
            KeywordInputs(_batch).positional(({name: torch.zeros(1)}, torch.zeros(1)))


def test_finding_the_names_draws_from_no_random_stream_the_model_or_batches_see() -> None:
    def drawing(size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        random.random()
        numpy.random.rand()
        return _batch(size)

    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    expected = torch.rand(1), random.random(), numpy.random.rand()
    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    assert KeywordInputs(drawing).found() == ("ids", "mask")
    assert (torch.rand(1), random.random(), numpy.random.rand()) == expected


def test_an_example_batch_that_raises_leaves_the_names_to_its_real_call() -> None:
    def failing(size: int) -> None:
        raise RuntimeError("no data")

    inputs = KeywordInputs(failing)
    assert inputs.found() == () and inputs.names is None


def test_torch_fx_and_torch_export_see_one_argument_per_name() -> None:
    model = keyword_model(_Named(), ("ids", "mask"))
    traced = fx.symbolic_trace(model)
    assert [node.target for node in traced.graph.nodes if node.op == "placeholder"] == ["ids", "mask"]
    ids, mask = torch.randn(2, 4), torch.rand(2, 3)
    program = torch.export.export(model, (ids, mask), strict=False)
    assert [spec.arg.name for spec in program.graph_signature.input_specs][-2:] == ["ids", "mask"]
    torch.testing.assert_close(traced(ids, mask), model(ids, mask))
