"""Small helpers on tensors: their size, finding them in nested outputs, noticing when they die."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements: numel x element size."""
    return tensor.numel() * tensor.element_size()


EPS_FACTOR = 8.0  # results of a low-precision dtype differ by rounding alone within this many of its epsilon


def rounding_rtol(tensor: torch.Tensor, floor: float) -> float:
    """Relative difference above which two results of `tensor`'s dtype differ by more than rounding: `floor`, or
    EPS_FACTOR epsilons of a lower precision (bf16, fp16; TF32's 10-bit mantissa for float32 on CUDA, which
    convolutions use by default); 0 for integers."""
    if not tensor.is_floating_point():
        return 0.0
    eps = torch.finfo(tensor.dtype).eps
    if tensor.device.type == "cuda" and tensor.dtype == torch.float32:
        eps = max(eps, 2.0 ** -10)
    return max(floor, EPS_FACTOR * eps)


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage `tensor` views; None for a tensor with none, such as functorch's wrappers inside `torch.vmap`
    (transformers 4.x builds attention masks that way), whose storage is their unwrapped tensor's."""
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a nested structure of tuples, lists and dicts (cheaper than pytree)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensors_in(item)]
    return []


class DeathWatch:
    """Calls `callback()` when a tensor object is freed; holds only weak references.

    PyTorch keeps a tensor's Python object alive as long as the C++ tensor lives (autograd's
    saved tensors included), so the callback runs when the memory is really released.
    Unlike `weakref.finalize`, nothing is left in a global registry once the watch is dropped.
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def watch(self, tensor: torch.Tensor, callback: Callable[[], None]) -> None:
        """Run `callback` once `tensor` is freed."""

        def fire(ref: weakref.ref) -> None:
            self._refs.pop(id(ref), None)
            callback()

        ref = weakref.ref(tensor, fire)
        self._refs[id(ref)] = ref
