"""Test helper: how many bytes autograd saves for backward while a forward runs."""

from __future__ import annotations

from typing import Any, Callable

import torch


def saved_bytes(run: Callable[[], Any]) -> int:
    """Bytes of the distinct storages autograd saves while `run()` runs."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())
