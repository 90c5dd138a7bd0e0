"""Tests of planner.profiling.keyword_inputs: a model file's inputs by name made positional, and the model with them."""

from __future__ import annotations

import pickle
import random

import numpy
import pytest
import torch
from torch import fx, nn

from planner.profiling.keyword_inputs import KeywordInputs, keyword_model, without_keyword_inputs


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
    with pytest.raises(ValueError, match="where example_batch gives them by position"):
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


def test_an_example_batch_that_raises_leaves_the_inputs_positional_and_the_error_to_its_real_call() -> None:
    def failing(size: int) -> None:
        raise RuntimeError("no data")

    inputs = KeywordInputs(failing)
    assert inputs.found() == () and inputs.probe_failure == "RuntimeError: no data"
    batch = torch.zeros(2, 4), torch.zeros(2)
    assert inputs.positional(batch) is batch


def test_torch_fx_and_torch_export_see_one_argument_per_name() -> None:
    model = keyword_model(_Named(), ("ids", "mask"))
    traced = fx.symbolic_trace(model)
    assert [node.target for node in traced.graph.nodes if node.op == "placeholder"] == ["ids", "mask"]
    ids, mask = torch.randn(2, 4), torch.rand(2, 3)
    program = torch.export.export(model, (ids, mask), strict=False)
    assert [spec.arg.name for spec in program.graph_signature.input_specs][-2:] == ["ids", "mask"]
    torch.testing.assert_close(traced(ids, mask), model(ids, mask))


def test_a_failed_look_for_the_names_refuses_a_dict_after_it_instead_of_misplacing_the_inputs() -> None:
    """example_batch(1) raising while the model is built: the model takes its inputs by position, so a dict of
    inputs after it would land on the wrong arguments; it is refused naming what example_batch(1) raised."""
    def even_only(size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        assert size % 2 == 0, "even batch sizes only"
        return _batch(size)

    inputs = KeywordInputs(even_only)
    build, example, _ = inputs.adapt(_Named, None)
    assert type(build()) is _Named
    with pytest.raises(ValueError, match="but example_batch\\(1\\), which the planner makes to find the names as the "
                                         "model is built, raised AssertionError: even batch sizes only"):
        example(2)


def test_names_the_forward_does_not_take_a_forward_on_the_object_and_clashing_names_are_refused() -> None:
    with pytest.raises(ValueError, match="inputs named labels, which _Named.forward does not take \\(its arguments: "
                                         "mask, ids, scale\\)"):
        keyword_model(_Named(), ("ids", "labels"))
    hooked = _Named()
    hooked.forward = hooked.forward  # as accelerate's hooks replace it
    with pytest.raises(ValueError, match="forward is set on the model object"):
        keyword_model(hooked, ("ids", "mask"))
    with pytest.raises(ValueError, match="cannot name an argument of forward"):
        keyword_model(_Named(), ("ids", "__forward__"))

    class Anything(nn.Module):  # **kwargs takes any name
        def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
            return inputs["a"] - inputs["b"]

    assert keyword_model(Anything(), ("b", "a"))(torch.ones(1), torch.zeros(1)) == -1


def test_the_model_gets_its_own_class_back_to_be_pickled_whole() -> None:
    model = keyword_model(_Named(), ("ids", "mask"))
    with pytest.raises(Exception):
        pickle.dumps(model)
    assert type(without_keyword_inputs(model)) is _Named
    assert type(pickle.loads(pickle.dumps(model))) is _Named
    assert without_keyword_inputs(model) is model and type(model) is _Named  # a plain model stays as it is
