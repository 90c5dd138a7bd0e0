"""Measures, in one instrumented forward pass, what each layer outputs, saves and must send on.

Every torch function call is seen through a `TorchFunctionMode`: a tensor it returns is
*produced* by the running layer, a tensor it takes is *consumed* by the running layer. Then

    cut_bytes[i] = sum of nbytes(t) over tensors t with producer(t) <= i < last_consumer(t)

which counts skip connections: a residual tensor that jumps over a boundary is part of it.
The model's inputs are produced "before layer 0" (index -1); the target is loaded where the
loss runs and is not counted; parameters and buffers live with their layer and are never cut.
`saved_bytes[i]` counts, once per storage, the tensors autograd saves for backward while layer
i runs (`torch.autograd.graph.saved_tensors_hooks`), parameters and buffers excluded.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from planner.cuts import boundary_cut_bytes
from planner.layers import Layer
from planner.segments import LayerTracker


@dataclass(frozen=True)
class Dataflow:
    """Per-layer byte counts and parameter use of one forward pass (lists indexed by layer)."""

    output_bytes: list[int]
    cut_bytes: list[int]
    saved_bytes: list[int]
    param_layers: dict[str, list[int]]  # parameter name -> layers that used it, ascending


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements: numel x element size."""
    return tensor.numel() * tensor.element_size()


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a nested structure of tuples, lists and dicts (cheaper than pytree)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensors_in(item)]
    return []


class _TensorLife:
    """Producer, last consumer and size of one tensor object."""

    __slots__ = ("producer", "last_consumer", "nbytes")

    def __init__(self, producer: int, nbytes: int) -> None:
        self.producer = producer
        self.last_consumer = producer
        self.nbytes = nbytes


class _DataflowMode(TorchFunctionMode):
    """Records producers and consumers of tensors, and which layers use which parameters."""

    def __init__(self, tracker: LayerTracker, param_names: dict[int, str], buffer_ids: set[int]) -> None:
        super().__init__()
        self.tracker = tracker
        self.param_names = param_names
        self.buffer_ids = buffer_ids
        self.live: dict[int, _TensorLife] = {}
        self.finished: list[_TensorLife] = []
        self.param_layers: dict[str, set[int]] = {}

    def produce(self, tensor: torch.Tensor, layer: int) -> None:
        """Register a new tensor object as produced by `layer`."""
        key = id(tensor)
        if key in self.live or key in self.param_names or key in self.buffer_ids:
            return
        self.live[key] = _TensorLife(layer, tensor_nbytes(tensor))
        weakref.finalize(tensor, self._retire, key)

    def _retire(self, key: int) -> None:
        life = self.live.pop(key, None)
        if life is not None:
            self.finished.append(life)

    def all_lives(self) -> list[_TensorLife]:
        """Records of every tensor seen, alive or not."""
        return self.finished + list(self.live.values())

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        outputs = tensors_in(result)
        if not outputs:  # metadata queries (size, dim, ...) move no data
            return result
        layer = self.tracker.current
        for tensor in tensors_in((args, kwargs)):
            key = id(tensor)
            name = self.param_names.get(key)
            if name is not None:
                self.param_layers.setdefault(name, set()).add(max(layer, 0))
                continue
            life = self.live.get(key)
            if life is not None and layer > life.last_consumer:
                life.last_consumer = layer
        for tensor in outputs:
            self.produce(tensor, layer)
        return result


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
    param_names = {id(p): name for name, p in model.named_parameters()}
    buffer_ids = {id(b) for b in model.buffers()}
    resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    counted_storages: set[int] = set()

    def on_exit(index: int, output: Any) -> None:
        output_bytes[index] = sum(tensor_nbytes(t) for t in tensors_in(output))

    tracker = LayerTracker(layers, on_exit=on_exit)
    mode = _DataflowMode(tracker, param_names, buffer_ids)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in resident and key not in counted_storages:
            counted_storages.add(key)
            saved_bytes[max(tracker.current, 0)] += storage.nbytes()
        return tensor

    for tensor in inputs:
        mode.produce(tensor, -1)
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), mode:
        loss = run_step()
    del loss
    cut_bytes = boundary_cut_bytes(
        num_layers, [(life.producer, life.last_consumer, life.nbytes) for life in mode.all_lives()]
    )
    param_layers = {name: sorted(used) for name, used in mode.param_layers.items()}
    return Dataflow(output_bytes, cut_bytes, saved_bytes, param_layers)
