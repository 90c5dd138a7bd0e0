"""Measures, in one instrumented forward pass, what each layer outputs, saves and must send on.

Every torch function call is seen through a `TorchFunctionMode`: a tensor it returns is
*produced* by the running layer, a tensor it takes is *consumed* by the running layer. Then

    cut_bytes[i] = sum over storages S of min(nbytes(S), sum of nbytes(t) over tensors t on S
                                               with producer(t) <= i < last_consumer(t))

which counts skip connections (a residual tensor that jumps over a boundary is part of it),
counts views of one storage once and an expanded tensor at most at its storage's size.
The model's inputs are produced "before layer 0" (index -1); the target is loaded where the
loss runs and is not counted; parameters, buffers and views of them live with their layer and
are never cut. Calls that only read metadata (size, dtype, ...) consume nothing.
`saved_bytes[i]` counts, once per storage, the tensors autograd saves for backward while layer
i runs (`torch.autograd.graph.saved_tensors_hooks`), parameters and buffers excluded.
`input_saved_bytes[i]` counts the part of `saved_bytes[i]` made before layer i (by an earlier layer, or the
model's inputs): the storages layer i is the first to save that a stage starting at layer i receives. The
runtime runs a stage on what it received, so such a stage holds them once, as its inputs; 0 where layer i or
a later one changes in place a tensor made before layer i (its version counter moves, through the tensor or a
view of it), as a ReLU(inplace=True) after a cut does: the runtime runs such a stage on clones of what it
received, which it holds beside it (an upper bound where the stage ends before the changing layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from planner.files.cuts import boundary_cut_bytes
from planner.profiling.layers import Layer
from planner.profiling.layer_tracker import LayerTracker
from planner.profiling.tensors import DeathWatch, storage_of, tensor_nbytes, tensors_in

# Functions that read a tensor's metadata, not its data: calling them does not consume the tensor.
_METADATA_CALLS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "element_size",
    "storage_offset", "data_ptr", "untyped_storage", "get_device", "is_floating_point", "is_complex",
    "__get__", "__len__", "__repr__", "__format__", "__str__", "__hash__",
})


@dataclass(frozen=True)
class Dataflow:
    """Per-layer byte counts and parameter use of one forward pass (lists indexed by layer)."""

    output_bytes: list[int]
    cut_bytes: list[int]
    saved_bytes: list[int]
    param_layers: dict[str, list[int]]  # parameter name -> layers that used it, ascending
    input_saved_bytes: list[int] = field(default_factory=list)


@dataclass
class _StorageLife:
    """The tensors produced on one storage while it is alive."""

    nbytes: int
    tensors: list["_TensorLife"] = field(default_factory=list)
    live: int = 0


class _TensorLife:
    """Producer, last consumer and size of one tensor object."""

    __slots__ = ("producer", "last_consumer", "nbytes")

    def __init__(self, producer: int, nbytes: int) -> None:
        self.producer = producer
        self.last_consumer = producer
        self.nbytes = nbytes


class _DataflowMode(TorchFunctionMode):
    """Records producers and consumers of tensors, and which layers use which parameters."""

    def __init__(self, tracker: LayerTracker, param_names: dict[int, str], resident: set[int]) -> None:
        super().__init__()
        self.tracker = tracker
        self.param_names = param_names
        self.resident = resident  # storages of parameters and buffers
        self.tensors: dict[int, _TensorLife] = {}  # live tensor objects by id
        self.open_storages: dict[int, _StorageLife] = {}  # live storages by data pointer
        self.storages: list[_StorageLife] = []
        self.param_layers: dict[str, set[int]] = {}
        self.changed: list[tuple[int, int]] = []  # (made by, changed in place by) of tensors a later layer changed
        self.deaths = DeathWatch()

    def produce(self, tensor: torch.Tensor, layer: int) -> None:
        """Register a new tensor object as produced by `layer`."""
        key = id(tensor)
        if key in self.tensors or key in self.param_names:
            return
        storage = storage_of(tensor)
        if storage is None:  # a vmap's wrapper: what the vmap returns is registered at its first use
            return
        pointer = storage.data_ptr()
        if pointer in self.resident:
            return
        group = self.open_storages.get(pointer)
        if group is None:
            group = self.open_storages[pointer] = _StorageLife(storage.nbytes())
            self.storages.append(group)
        life = _TensorLife(layer, tensor_nbytes(tensor))
        group.tensors.append(life)
        group.live += 1
        self.tensors[key] = life

        def freed() -> None:
            self.tensors.pop(key, None)
            group.live -= 1
            if group.live == 0 and self.open_storages.get(pointer) is group:
                del self.open_storages[pointer]  # the pointer may be reused by a new storage

        self.deaths.watch(tensor, freed)

    def made_before(self, tensor: torch.Tensor, layer: int) -> int | None:
        """The layer that made `tensor`'s storage (-1: the model's inputs), if before `layer`, else None. A view
        made in `layer` of a tensor made before it has that tensor's storage, and version counter."""
        if tensor.is_inference():  # (no version counter to read)
            return None
        storage = storage_of(tensor)
        made = None if storage is None else self.open_storages.get(storage.data_ptr())
        if made is None or made.tensors[0].producer >= layer:
            return None
        return made.tensors[0].producer

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        layer = self.tracker.current
        earlier = [(made, tensor, tensor._version) for tensor in tensors_in((args, kwargs))
                   if (made := self.made_before(tensor, layer)) is not None]
        result = func(*args, **kwargs)
        self.changed.extend((made, layer) for made, tensor, version in earlier if tensor._version != version)
        outputs = tensors_in(result)
        if not outputs and getattr(func, "__name__", "") in _METADATA_CALLS:
            return result
        for tensor in tensors_in((args, kwargs)):
            key = id(tensor)
            name = self.param_names.get(key)
            if name is not None:
                self.param_layers.setdefault(name, set()).add(max(layer, 0))
                continue
            life = self.tensors.get(key)
            if life is None:  # made where no torch function ran (a vmap's result): it exists by its first use
                self.produce(tensor, layer)
            elif layer > life.last_consumer:
                life.last_consumer = layer
        for tensor in outputs:
            self.produce(tensor, layer)
        return result

    def cut_bytes(self, num_layers: int) -> list[int]:
        """Bytes crossing each boundary, views of a storage together capped at the storage's size."""
        singles: list[tuple[int, int, int]] = []
        cuts = [0] * num_layers
        for group in self.storages:
            crossing = [t for t in group.tensors if t.last_consumer > t.producer]
            if len(crossing) == 1:
                life = crossing[0]
                singles.append((life.producer, life.last_consumer, min(life.nbytes, group.nbytes)))
            elif crossing:
                shared = boundary_cut_bytes(num_layers, [(t.producer, t.last_consumer, t.nbytes) for t in crossing])
                cuts = [total + min(extra, group.nbytes) for total, extra in zip(cuts, shared)]
        return [total + extra for total, extra in zip(cuts, boundary_cut_bytes(num_layers, singles))]


def measure_dataflow(
    model: nn.Module,
    layers: Sequence[Layer],
    inputs: tuple[torch.Tensor, ...],
    run_step: Callable[[], torch.Tensor],
) -> Dataflow:
    """Run `run_step` (forward and loss, returning the loss) once under instrumentation.

    The graph is released without a backward pass; gradients are not touched.
    """
    num_layers = len(layers)
    output_bytes = [0] * num_layers
    saved_bytes = [0] * num_layers
    input_saved = [0] * num_layers
    param_names = {id(p): name for name, p in model.named_parameters()}
    # parameters, buffers and tensors the modules hold as plain attributes (a cached rotary table): there before
    # the step, each stage holds its own, so none is produced by a layer
    held = [t for module in model.modules() for t in tensors_in(list(vars(module).values()))]
    resident = {storage.data_ptr() for t in [*model.parameters(), *model.buffers(), *held]
                if (storage := storage_of(t)) is not None}
    counted_storages: dict[int, int] = {}  # storage -> the layer whose saved_bytes counts it

    def on_exit(index: int, output: Any) -> None:
        output_bytes[index] = sum(tensor_nbytes(t) for t in tensors_in(output))

    tracker = LayerTracker(layers, on_exit=on_exit)
    mode = _DataflowMode(tracker, param_names, resident)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = storage_of(tensor)
        key = storage.data_ptr() if storage is not None else 0
        layer = max(tracker.current, 0)
        if storage is not None and key not in resident and key not in counted_storages:
            counted_storages[key] = layer
            saved_bytes[layer] += storage.nbytes()
            if mode.made_before(tensor, layer) is not None:
                input_saved[layer] += storage.nbytes()
        # A detached alias: returning the tensor itself would tie an output saved by its own
        # node into a reference cycle through C++ that keeps the whole graph alive.
        return tensor.detach()

    for tensor in inputs:
        mode.produce(tensor, -1)
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), mode:
        loss = run_step()
    del loss
    param_layers = {name: sorted(used) for name, used in mode.param_layers.items()}
    for made, changed in mode.changed:  # a stage from any layer in (made, changed] receives it and clones
        for layer in range(made + 1, changed + 1):
            input_saved[layer] = 0
    return Dataflow(output_bytes, mode.cut_bytes(num_layers), saved_bytes, param_layers, input_saved)
