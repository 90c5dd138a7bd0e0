"""Measures the peak memory of one training step (forward, loss, backward).

- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (method "cuda-allocator").
- CPU: there are no allocator statistics, so every aten operation is watched through a
  `TorchDispatchMode`; each distinct storage an operation returns counts from its creation until
  the last tensor viewing it is freed. The peak of that sum, plus the parameters, buffers, inputs
  and gradients present at the start, is reported (method "live-tensors"). It excludes allocator
  caching and fragmentation, so it is the memory a step needs, not what the process's RSS shows.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.profiling.tensors import DeathWatch, tensors_in


class _LiveStorageMode(TorchDispatchMode):
    """Sums the bytes of live storages created by operations; remembers the peak."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled inside this mode; without this, the first dispatch imports
        # torch._dynamo (about a second) to wrap __torch_dispatch__.
        return False

    def __init__(self, resident: set[int], start_bytes: int, count_inputs: bool = False) -> None:
        super().__init__()
        self.count_inputs = count_inputs  # also count storages first seen as an operation's input
        self.resident = resident
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [nbytes, live tensor objects]
        self.deaths = DeathWatch()
        self.live_bytes = start_bytes
        self.peak_bytes = start_bytes

    def __torch_dispatch__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.count_inputs:  # e.g. tensors another thread received: they count from their first use
            for tensor in tensors_in((args, kwargs)):
                if tensor.untyped_storage().data_ptr() not in self.refs:
                    self._track(tensor)
        result = func(*args, **(kwargs or {}))
        for tensor in tensors_in(result):
            self._track(tensor)
        return result

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.resident:
            return
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [storage.nbytes(), 0]
            self.live_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[1] += 1
        self.deaths.watch(tensor, lambda: self._release(key))

    def _release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.refs[key]
            self.live_bytes -= entry[0]


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    """Distinct storages of `tensors`: pointer -> bytes."""
    storages = [t.untyped_storage() for t in tensors]
    return {storage.data_ptr(): storage.nbytes() for storage in storages}


def measure_peak_memory(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], run_step: Callable[[], torch.Tensor],
    device: torch.device,
) -> tuple[int, str]:
    """Peak bytes of one step `run_step()` + backward, and the method used (see module docstring).

    `inputs` are the tensors present before the step (the batch and its target).
    """
    def step() -> None:
        loss = run_step()
        loss.backward()

    return peak_memory_of(step, model, inputs, device)


def peak_memory_of(work: Callable[[], Any], model: torch.nn.Module, present: tuple[torch.Tensor, ...],
                   device: torch.device, count_inputs: bool = False) -> tuple[int, str]:
    """Peak bytes while `work()` runs in this thread, and the method (module docstring): on CUDA
    the allocator's peak; on CPU the live storages its operations create (with `count_inputs`, also
    those first seen as an operation's input, e.g. received from another thread) on top of the
    model's parameters, buffers and gradients and the `present` tensors."""
    _, peak, method = _memory_during(work, model, present, device, count_inputs)
    return peak, method


def extra_memory_of(work: Callable[[], Any], model: torch.nn.Module, present: tuple[torch.Tensor, ...],
                    device: torch.device) -> int:
    """The most bytes `work()` holds beyond what existed when it started (`peak_memory_of`'s peak
    less its starting level): e.g. an optimizer step's scratch tensors."""
    start, peak, _ = _memory_during(work, model, present, device, False)
    return max(peak - start, 0)


def _memory_during(work: Callable[[], Any], model: torch.nn.Module, present: tuple[torch.Tensor, ...],
                   device: torch.device, count_inputs: bool) -> tuple[int, int, str]:
    """(bytes at the start, peak bytes, method) of `work()`, as `peak_memory_of` measures them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = int(torch.cuda.memory_allocated(device))
        work()
        torch.cuda.synchronize(device)
        return start, int(torch.cuda.max_memory_allocated(device)), "cuda-allocator"
    existing = [*model.parameters(), *model.buffers(), *present]
    existing += [p.grad for p in model.parameters() if p.grad is not None]
    resident = _storages(existing)
    mode = _LiveStorageMode(set(resident), sum(resident.values()), count_inputs)
    with mode:
        work()
    return sum(resident.values()), mode.peak_bytes, "live-tensors"
