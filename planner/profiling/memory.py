"""Measures the peak memory of one training step (forward, loss, backward).

- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (method "cuda-allocator").
- CPU: there are no allocator statistics, so every aten operation is watched through a
  `TorchDispatchMode`; each distinct storage an operation returns counts from its creation until
  the last tensor viewing it is freed. The peak of that sum, plus the parameters, buffers, inputs
  and gradients present at the start, is reported (method "live-tensors"). It excludes allocator
  caching and fragmentation, so it is the memory a step needs, not what the process's RSS shows.
  Such a mode sees only the operations of the thread that entered it: tensors another thread allocates
  (a receiver thread's buffers, `runtime.p2p.Links.watch_allocations`) count from when that thread reports them
  (`LiveStorageMode.watch_allocated`), or with `count_inputs` from their first use here.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.profiling.layer_tracker import LayerTracker
from planner.profiling.layers import Layer
from planner.profiling.tensors import DeathWatch, tensors_in
from planner.profiling.timing import backward_nodes, sequence_nr


class LiveStorageMode(TorchDispatchMode):
    """Sums the bytes of live storages created by operations; remembers the peak. Its counts may also change from
    other threads (`watch_allocated`, and a tensor freed last by another thread), under a lock."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled inside this mode; without this, the first dispatch imports
        # torch._dynamo (about a second) to wrap __torch_dispatch__.
        return False

    def __init__(self, resident: set[int], start_bytes: int, count_inputs: bool = False) -> None:
        super().__init__()
        self.count_inputs = count_inputs  # also count storages first seen as an operation's input
        self.resident = resident  # storages never tracked: those counted in start_bytes, and any not counted at all
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [nbytes, live tensor objects]
        self.deaths = DeathWatch()
        self.live_bytes = start_bytes
        self.peak_bytes = start_bytes
        self.start_bytes = start_bytes
        self.saved: dict[int, int] = {}  # storages autograd saved for backward (`mark_saved`), still alive
        self.saved_by: dict[int, int] = {}  # storage -> the layer `mark_saved` named when it saved it
        self.saved_bytes = 0
        self.excess_peak = 0  # the most of `excess()` since `reset_excess()`
        self._lock = threading.RLock()

    def __torch_dispatch__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.count_inputs:  # e.g. tensors another thread received: they count from their first use
            for tensor in tensors_in((args, kwargs)):
                if tensor.untyped_storage().data_ptr() not in self.refs:
                    self._track(tensor)
        result = func(*args, **(kwargs or {}))
        for tensor in tensors_in(result):
            self._track(tensor)
        return result

    def watch_allocated(self, allocated: list[torch.Tensor]) -> None:
        """Count tensors another thread allocated (e.g. buffers a receiver thread posts receives into) from now
        until they are freed; thread-safe."""
        for tensor in allocated:
            self._track(tensor)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.resident:
            return
        with self._lock:
            entry = self.refs.get(key)
            if entry is None:
                entry = self.refs[key] = [storage.nbytes(), 0]
                self.live_bytes += entry[0]
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                self.excess_peak = max(self.excess_peak, self.excess())
            entry[1] += 1
            self.deaths.watch(tensor, lambda: self._release(key))

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self.refs.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self.refs[key]
                self.live_bytes -= entry[0]
                self.saved_bytes -= self.saved.pop(key, 0)

    def mark_saved(self, tensor: torch.Tensor, layer: int = -1) -> None:
        """Count `tensor`'s storage as saved activations from now until it is freed (if it is tracked), saved by
        `layer` (-1: none)."""
        key = tensor.untyped_storage().data_ptr()
        with self._lock:
            entry = self.refs.get(key)
            if entry is not None and key not in self.saved:
                self.saved[key] = entry[0]
                self.saved_by[key] = layer
                self.saved_bytes += entry[0]

    def excess(self) -> int:
        """Bytes live beyond the starting ones and the saved activations."""
        return self.live_bytes - self.start_bytes - self.saved_bytes

    def reset_excess(self) -> None:
        """Start a new `excess_peak` from the present excess."""
        self.excess_peak = self.excess()


def _resident(model: torch.nn.Module, present: tuple[torch.Tensor, ...]) -> dict[int, int]:
    """The storages there before the work (pointer -> bytes): the model's parameters, buffers and
    gradients, and the `present` tensors."""
    existing = [*model.parameters(), *model.buffers(), *present]
    return _storages(existing + [p.grad for p in model.parameters() if p.grad is not None])


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


Watcher = Callable[[Callable[[list[torch.Tensor]], None] | None], None]


def peak_memory_of(work: Callable[[], Any], model: torch.nn.Module, present: tuple[torch.Tensor, ...],
                   device: torch.device, count_inputs: bool = False,
                   other_threads: Watcher | None = None, host: tuple[torch.Tensor, ...] = ()) -> tuple[int, str]:
    """Peak bytes while `work()` runs in this thread, and the method (module docstring): on CUDA
    the allocator's peak; on CPU the live storages its operations create (with `count_inputs`, also
    those first seen as an operation's input, e.g. received from another thread) on top of the
    model's parameters, buffers and gradients and the `present` tensors. `host`: tensors whose storages are
    never counted on CPU, not even as inputs: the caller's batch, which a GPU's allocator does not hold either.
    `other_threads(report)`, where given, is called with a function other threads call with the tensors they
    allocate while `work()` runs (counted from then on; on CPU), and with None once it has returned."""
    _, peak, method = _memory_during(work, model, present, device, count_inputs, other_threads, host)
    return peak, method


def library_bytes(model: torch.nn.Module, present: tuple[torch.Tensor, ...], device: torch.device) -> int:
    """Bytes the device holds beyond tensors once a step has run, at rest: on CUDA, the allocator's bytes in
    use less the storages of the model's parameters, buffers and gradients and of the `present` tensors
    (cuBLAS and cuBLASLt keep their workspaces in PyTorch's allocator from their first call on: 65 MiB on an
    H200, x1.35-1.43 of a small model's predicted peak before the planner counted them); 0 on CPU, whose
    memory is counted by tensors alone."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return max(0, int(torch.cuda.memory_allocated(device)) - sum(_resident(model, present).values()))


def extra_memory_of(work: Callable[[], Any], model: torch.nn.Module, present: tuple[torch.Tensor, ...],
                    device: torch.device) -> int:
    """The most bytes `work()` holds beyond what existed when it started (`peak_memory_of`'s peak
    less its starting level): e.g. an optimizer step's scratch tensors."""
    start, peak, _ = _memory_during(work, model, present, device, False, None)
    return max(peak - start, 0)


def _memory_during(work: Callable[[], Any], model: torch.nn.Module, present: tuple[torch.Tensor, ...],
                   device: torch.device, count_inputs: bool, other_threads: Watcher | None,
                   host: tuple[torch.Tensor, ...] = ()) -> tuple[int, int, str]:
    """(bytes at the start, peak bytes, method) of `work()`, as `peak_memory_of` measures them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = int(torch.cuda.memory_allocated(device))
        work()
        torch.cuda.synchronize(device)
        return start, int(torch.cuda.max_memory_allocated(device)), "cuda-allocator"
    resident = _resident(model, present)
    mode = LiveStorageMode(set(resident) | set(_storages(list(host))), sum(resident.values()), count_inputs)
    if other_threads is not None:
        other_threads(mode.watch_allocated)
    try:
        with mode:
            work()
    finally:
        if other_threads is not None:
            other_threads(None)
    return sum(resident.values()), mode.peak_bytes, "live-tensors"


def measure_workspace(model: torch.nn.Module, layers: Sequence[Layer], present: tuple[torch.Tensor, ...],
                      run_step: Callable[[], torch.Tensor],
                      backward: Callable[[list[torch.Tensor], dict[int, int], LiveStorageMode], None] | None = None,
                      ) -> tuple[list[int], list[int]]:
    """Per layer, the most bytes live while its backward runs beyond the weights, their gradients,
    the `present` tensors (the batch) and the activations autograd saved and still holds: the
    gradients flowing between layers and each operation's temporaries (a language model's loss
    holds several vocabulary-sized tensors there); and the same while its forward runs (from its
    call to the next layer's: its input, output and temporaries, where a layer that saves nothing,
    e.g. one whose weights and inputs need no gradient, holds all it needs). One step of `run_step()`
    (forward and loss) and its backward, tracked as on the CPU (live storages per operation) on any
    device; each backward node counts for the layer whose forward created it (`timing.backward_nodes`).
    Gradients that do not exist yet are made (zeros) first and removed after, so that they count as
    weights'. `backward([loss], layer_of, mode)` runs the backward instead of `loss.backward()` (a split
    backward's B, `planner.profiling.deferred_memory`), given the loss in a list it may empty (holding it
    would keep what only the loss's graph needs), the layer of each node by its id, and the tracking mode: its `saved`
    and `saved_by` tell which saved storages live and the layer that saved each, its `mark_saved(tensor)`
    counts a tensor as held apart from the work, as saved activations are (a stage's received inputs).
    Returns (backward, forward) bytes per layer.
    """
    made = [p for p in model.parameters() if p.requires_grad and p.grad is None]
    for parameter in made:
        parameter.grad = torch.zeros_like(parameter)
    try:
        resident = _resident(model, present)
        mode = LiveStorageMode(set(resident), sum(resident.values()))
        workspace, forward = [0] * len(layers), [0] * len(layers)
        sequence_starts: list[int | None] = [None] * len(layers)
        current = [-1]  # the layer whose backward runs
        running = [-1]  # the layer whose forward runs

        def forward_ends() -> None:
            if running[0] >= 0:
                forward[running[0]] = max(forward[running[0]], mode.excess_peak)

        def enter(index: int, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
            sequence_starts[index] = sequence_nr()
            forward_ends()
            running[0] = index
            mode.reset_excess()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            mode.mark_saved(tensor, running[0])
            return tensor.detach()  # (the tensor itself would tie an output saved by its own node into a cycle)

        def close() -> None:
            if current[0] >= 0:
                workspace[current[0]] = max(workspace[current[0]], mode.excess_peak)

        def starts(layer: int) -> Callable[[Any], None]:
            def hook(_grad_outputs: Any) -> None:
                close()
                current[0] = layer
                mode.reset_excess()
            return hook

        hooks = [starts(layer) for layer in range(len(layers))]
        with mode:
            with LayerTracker(layers, on_enter=enter), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = run_step()
            forward_ends()
            nodes = backward_nodes(loss, sequence_starts)
            handles = [node.register_prehook(hooks[layer]) for node, layer in nodes]
            layer_of = {id(node): layer for node, layer in nodes}
            del nodes  # (so that what only the loss's graph holds can go as a backward frees it)
            try:
                if backward is None:
                    loss.backward()
                    del loss
                else:
                    box = [loss]
                    del loss
                    backward(box, layer_of, mode)
                    del box
            finally:
                for handle in handles:  # (a graph kept for later, a split backward's W, runs without them)
                    handle.remove()
            del handles
            close()
    finally:
        for parameter in made:
            parameter.grad = None
    return workspace, forward
