"""Bytes that cross each layer boundary, from when tensors are produced and last consumed."""

from __future__ import annotations

from typing import Iterable


def boundary_cut_bytes(num_layers: int, tensors: Iterable[tuple[int, int, int]]) -> list[int]:
    """Bytes crossing each layer boundary, by a difference array in O(num_layers + number of tensors).

    Each tensor is `(producer position, last consumer position, bytes)`; positions are 0-based layer
    indexes, -1 for a tensor available before layer 0 (an input). Boundary i lies right after layer i,
    and a tensor crosses it iff `producer <= i < last_consumer`:
    `cut[i] = sum(bytes for producer, last, bytes in tensors if producer <= i < last)`.
    A tensor with no consumer (last consumer = producer) crosses nothing.
    """
    diff = [0] * (num_layers + 1)
    for producer, last_consumer, size in tensors:
        start = max(producer, 0)
        stop = min(last_consumer, num_layers)
        if start < stop:
            diff[start] += size
            diff[stop] -= size
    cuts: list[int] = []
    running = 0
    for i in range(num_layers):
        running += diff[i]
        cuts.append(running)
    return cuts
