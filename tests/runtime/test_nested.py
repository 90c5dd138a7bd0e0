"""Nested values: map_tensors and tensors walk tuples, lists and dicts; split_batch and batch_size."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from runtime.nested import batch_size, map_tensors, split_batch, split_minibatch, tensors


def nested_value() -> dict[str, Any]:
    """Tensors at several depths in tuples, lists and dicts, with non-tensor leaves between them."""
    return {
        "x": torch.arange(6.0).reshape(6, 1),
        "pair": (torch.ones(6, 2), "label", [torch.zeros(6, dtype=torch.int64), None]),
        "flag": True,
        "inner": {"y": torch.full((6, 3), 2.0), "n": 7},
    }


def test_map_tensors_applies_the_function_to_every_tensor_and_keeps_structure_and_other_leaves() -> None:
    value = nested_value()
    mapped = map_tensors(lambda t: t + 1, value)
    assert list(mapped) == ["x", "pair", "flag", "inner"]
    assert torch.equal(mapped["x"], value["x"] + 1)
    assert isinstance(mapped["pair"], tuple) and len(mapped["pair"]) == 3
    assert torch.equal(mapped["pair"][0], torch.full((6, 2), 2.0))
    assert mapped["pair"][1] == "label"
    assert isinstance(mapped["pair"][2], list)
    assert torch.equal(mapped["pair"][2][0], torch.ones(6, dtype=torch.int64))
    assert mapped["pair"][2][1] is None
    assert mapped["flag"] is True
    assert torch.equal(mapped["inner"]["y"], torch.full((6, 3), 3.0)) and mapped["inner"]["n"] == 7


def test_map_tensors_does_not_modify_the_input_value() -> None:
    value = nested_value()
    map_tensors(lambda t: t * 0, value)
    assert torch.equal(value["x"], torch.arange(6.0).reshape(6, 1))
    assert isinstance(value["pair"][2], list) and value["pair"][2][1] is None


def test_map_tensors_on_a_tensor_and_on_a_plain_value() -> None:
    assert torch.equal(map_tensors(torch.neg, torch.tensor([1.0, -2.0])), torch.tensor([-1.0, 2.0]))
    assert map_tensors(torch.neg, 3) == 3
    assert map_tensors(torch.neg, "text") == "text"
    assert map_tensors(torch.neg, ()) == () and map_tensors(torch.neg, []) == [] and map_tensors(torch.neg, {}) == {}


def test_tensors_lists_every_tensor_in_the_order_map_tensors_visits_them() -> None:
    value = nested_value()
    visited: list[torch.Tensor] = []
    map_tensors(visited.append, value)
    found = tensors(value)
    assert len(found) == 4
    assert [id(t) for t in found] == [id(t) for t in visited]
    assert found[0] is value["x"] and found[1] is value["pair"][0]
    assert found[2] is value["pair"][2][0] and found[3] is value["inner"]["y"]


def test_tensors_of_values_without_tensors_is_empty() -> None:
    assert tensors(None) == [] and tensors((1, "a", [None])) == [] and tensors({"k": 2.0}) == []


def test_split_batch_splits_every_tensor_along_dim_0_and_repeats_other_leaves() -> None:
    value = nested_value()
    pieces = split_batch(value, 3)
    assert len(pieces) == 3
    for k, piece in enumerate(pieces):
        rows = slice(2 * k, 2 * k + 2)
        assert list(piece) == ["x", "pair", "flag", "inner"]
        assert torch.equal(piece["x"], value["x"][rows])
        assert isinstance(piece["pair"], tuple) and isinstance(piece["pair"][2], list)
        assert torch.equal(piece["pair"][0], value["pair"][0][rows])
        assert piece["pair"][1] == "label" and piece["pair"][2][1] is None
        assert torch.equal(piece["pair"][2][0], value["pair"][2][0][rows])
        assert piece["pair"][2][0].dtype == torch.int64
        assert piece["flag"] is True
        assert torch.equal(piece["inner"]["y"], value["inner"]["y"][rows]) and piece["inner"]["n"] == 7


def test_split_batch_pieces_concatenate_back_to_the_batch() -> None:
    value = (torch.randn(7, 2), [torch.randn(7)])
    pieces = split_batch(value, 3)
    torch.testing.assert_close(torch.cat([p[0] for p in pieces]), value[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p[1][0] for p in pieces]), value[1][0], rtol=0, atol=0)


@pytest.mark.parametrize("size, chunks, expected", [
    (10, 4, [3, 3, 2, 2]),  # tensor_split: the first size % chunks pieces get one more
    (7, 3, [3, 2, 2]),
    (3, 5, [1, 1, 1, 0, 0]),  # more chunks than rows: empty pieces at the end
    (8, 1, [8]),
])
def test_split_batch_uneven_sizes_follow_tensor_split(size: int, chunks: int, expected: list[int]) -> None:
    pieces = split_batch({"a": torch.arange(size), "b": [torch.zeros(size, 2)]}, chunks)
    assert [piece["a"].shape[0] for piece in pieces] == expected
    assert [piece["b"][0].shape[0] for piece in pieces] == expected
    assert [piece["b"][0].shape[1] for piece in pieces] == [2] * chunks
    assert torch.equal(torch.cat([piece["a"] for piece in pieces]), torch.arange(size))


def test_split_batch_of_a_tensor_is_a_list_of_pieces() -> None:
    pieces = split_batch(torch.arange(5), 2)
    assert isinstance(pieces, list)
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4]]


def test_split_batch_of_a_value_without_tensors_repeats_it() -> None:
    assert split_batch("same", 3) == ["same", "same", "same"]
    assert split_batch((1, [2], {"k": None}), 2) == [(1, [2], {"k": None})] * 2


def test_batch_size_is_the_common_dim_0_size() -> None:
    assert batch_size(nested_value()) == 6
    assert batch_size(torch.zeros(4, 3)) == 4
    assert batch_size(((torch.zeros(5), "x"), {"t": torch.zeros(5, 2, 2)})) == 5


@pytest.mark.parametrize("value", [
    (torch.zeros(4), torch.zeros(5)),  # sizes differ
    {"a": torch.zeros(4, 2), "b": [torch.zeros(3, 2)]},  # sizes differ, nested
    (torch.zeros(4), torch.tensor(1.0)),  # a 0-d tensor among others
    torch.tensor(2.0),  # only a 0-d tensor
    (1, "a", [None], {"k": 2.0}),  # no tensor at all
    (),
], ids=["differ", "differ-nested", "0-d-among-others", "only-0-d", "no-tensors", "empty"])
def test_batch_size_is_none_without_one_common_size(value: Any) -> None:
    assert batch_size(value) is None


def test_batch_size_of_split_pieces() -> None:
    pieces = split_batch((torch.zeros(10, 2), {"t": torch.ones(10)}, "x"), 4)
    assert [batch_size(piece) for piece in pieces] == [3, 3, 2, 2]


def test_split_minibatch_gives_argument_tuples_targets_and_shares() -> None:
    inputs, target = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    chunks, targets, shares = split_minibatch(inputs, target, 2)
    assert [chunk[0].shape[0] for chunk in chunks] == [3, 2] and [t.tolist() for t in targets] == [[0, 1, 2], [3, 4]]
    assert shares == [0.6, 0.4]
    assert split_minibatch((inputs, inputs), target, 5)[0][4][1].tolist() == [[8.0, 9.0]]


def test_split_minibatch_says_what_is_wrong_with_the_batch() -> None:
    with pytest.raises(ValueError, match="a batch of 3 cannot be split into 4 microbatches"):
        split_minibatch(torch.zeros(3, 2), torch.zeros(3), 4)
    with pytest.raises(ValueError, match=r"batch in dim 0 with one size; got first dimensions \[4, 5\]"):
        split_minibatch(torch.zeros(4, 2), torch.zeros(5), 2)


class Pair(NamedTuple):
    ids: torch.Tensor
    mask: torch.Tensor


def test_named_tuples_keep_their_type_through_map_tensors_and_split_batch() -> None:
    value = Pair(torch.arange(4), torch.ones(4))
    mapped = map_tensors(lambda t: t * 2, value)
    assert type(mapped) is Pair and torch.equal(mapped.ids, torch.arange(4) * 2)
    halves = split_batch(value, 2)
    assert [type(half) for half in halves] == [Pair, Pair]
    assert torch.equal(halves[1].mask, torch.ones(2))

