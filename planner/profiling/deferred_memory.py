"""What a split backward keeps per layer between B and W: the gradients W starts from (`held_gradients`)."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from planner.profiling.backward_split import backward_inputs, backward_weights, held_gradients
from planner.profiling.layer_tracker import LayerTracker
from planner.profiling.layers import Layer
from planner.profiling.timing import StageInput, backward_nodes, sequence_nr


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the memory `tensor` lives in (its whole storage when strided)."""
    if tensor.layout == torch.strided:
        return int(tensor.untyped_storage().nbytes())
    return tensor.numel() * tensor.element_size()


def measure_deferred_bytes(
    layers: Sequence[Layer], run_step: Callable[[], torch.Tensor], after_step: Callable[[], None],
    parameters: Iterable[torch.Tensor],
) -> list[int]:
    """Per layer, the bytes a zero-bubble schedule keeps for it from a microbatch's B to its W, at the
    step's batch: the gradients `backward_inputs` records at the layer's boundary nodes (one per weighted
    op, about the size of that op's output; a loss's gradient over a vocabulary for a language model's
    head), which a plain backward frees as it goes. The graph's saved tensors are not counted: they are
    the layer's `saved_bytes`, kept by both.

    One step, cut after the first layer as `timing.time_split_backward` cuts it (the first layer's outputs
    become a stage's received inputs: a first stage runs its whole backward as W and keeps nothing,
    so layer 0 gets 0); each gradient goes to the layer whose forward made the node it enters
    (`timing.backward_nodes`; one entering a node no layer made goes to layer 1). `after_step` runs
    after the step (zeroing the gradients W wrote). A model of one layer, or whose first layer returns
    nothing that needs a gradient, gives zeros.
    """
    counts = [0] * len(layers)
    if len(layers) < 2:
        return counts
    parameters = [parameter for parameter in parameters if parameter.requires_grad]
    starts: list[int | None] = [None] * len(layers)

    def enter(index: int, _args: object, _kwargs: object) -> None:
        starts[index] = sequence_nr()

    stage = StageInput(layers[0])
    tracker = LayerTracker(layers, on_enter=enter)
    try:
        loss = run_step()
        if stage.leaves and loss.requires_grad:
            layer_of = {id(node): layer for node, layer in backward_nodes(loss, starts)}
            _, pending = backward_inputs([loss], [None], stage.leaves, parameters)
            for node, grad in held_gradients(pending):
                counts[max(layer_of.get(id(node), 1), 1)] += _nbytes(grad)
            backward_weights(pending)
            del pending
        del loss
    finally:
        stage.remove()
        tracker.remove()
    after_step()
    return counts
