"""Nested values (tensors in tuples, lists and dicts): map over their tensors, list them, split a batch."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["map_leaves", "map_tensors", "tensors", "split_batch", "batch_size", "split_minibatch"]


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """`value` with `function` applied to every tensor in it (tuples, named tuples, lists and dicts are walked)."""
    return map_leaves(function, value, torch.Tensor)


def map_leaves(function: Callable[[Any], Any], value: Any, leaf: type) -> Any:
    """`value` with `function` applied to every instance of `leaf` in it, the structure around them kept."""
    if isinstance(value, leaf):
        return function(value)
    if isinstance(value, (tuple, list)):
        return _same_sequence(value, [map_leaves(function, item, leaf) for item in value])
    if isinstance(value, dict):
        return {key: map_leaves(function, item, leaf) for key, item in value.items()}
    return value


def _same_sequence(value: tuple | list, items: list[Any]) -> Any:
    """`items` as the kind of sequence `value` is: a list, a tuple, or the same named tuple."""
    if isinstance(value, list):
        return items
    return type(value)(*items) if hasattr(type(value), "_fields") else tuple(items)


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, in a fixed order (that of `map_tensors`)."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, value)
    return found


def split_batch(value: Any, chunks: int) -> list[Any]:
    """`value` as `chunks` pieces along dim 0 of every tensor (`torch.tensor_split`; other values repeat)."""
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, chunks))
    if isinstance(value, (tuple, list)):
        parts = [split_batch(item, chunks) for item in value]
        pieces = [[part[k] for part in parts] for k in range(chunks)]
        return [_same_sequence(value, piece) for piece in pieces]
    if isinstance(value, dict):
        parts_of = {key: split_batch(item, chunks) for key, item in value.items()}
        return [{key: part[k] for key, part in parts_of.items()} for k in range(chunks)]
    return [value] * chunks


def batch_size(value: Any) -> int | None:
    """The common dim-0 size of every tensor in `value`, or None if they differ, a tensor is 0-d or there is none."""
    sizes = {tensor.shape[0] if tensor.dim() else None for tensor in tensors(value)}
    return sizes.pop() if len(sizes) == 1 else None


def split_minibatch(inputs: Any, target: Any, count: int) -> tuple[list[tuple[Any, ...]], list[Any], list[float]]:
    """(inputs per microbatch as argument tuples, targets per microbatch, each microbatch's share of the batch).

    `inputs` is one tensor or a tuple/list of arguments. Raises ValueError (saying what is wrong)
    unless every tensor has one common batch size in dim 0 of at least `count`.
    """
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    batch = batch_size((args, target))
    if batch is None:
        sizes = sorted({t.shape[0] if t.dim() else None for t in tensors((args, target))}, key=str)
        raise ValueError(f"every input and target tensor needs the batch in dim 0 with one size; "
                         f"got first dimensions {sizes}")
    if batch < count:
        raise ValueError(f"a batch of {batch} cannot be split into {count} microbatches")
    chunks = split_batch(args, count)
    return chunks, split_batch(target, count), [tensors(chunk)[0].shape[0] / batch for chunk in chunks]
