"""What a split backward holds per layer: the gradients it keeps from B to W (`held_gradients`), the saved tensors
B frees, what its B holds while it runs each layer, and what a W call holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from planner.profiling.backward_split import (
    PendingWeights, backward_inputs, backward_weights, held_gradients, weight_call_bytes,
)
from planner.profiling.layers import Layer
from planner.profiling.memory import LiveStorageMode, measure_workspace
from planner.profiling.timing import StageInput


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the memory `tensor` lives in (its whole storage when strided)."""
    if tensor.layout == torch.strided:
        return int(tensor.untyped_storage().nbytes())
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class SplitMemory:
    """Per layer, bytes at the step's batch (`Profile` fields of the same names): `deferred_bytes`, the gradients
    B keeps for W; `freed_by_b_bytes`, the saved tensors B frees; `input_workspace_bytes`, what B holds while it
    runs the layer beyond saved activations and what the layers after it keep; `weight_workspace_bytes`, the most
    one of W's calls holds for the layer beyond the gradients it starts from."""

    deferred_bytes: list[int]
    freed_by_b_bytes: list[int]
    input_workspace_bytes: list[int]
    weight_workspace_bytes: list[int]


def measure_split_memory(
    model: torch.nn.Module, layers: Sequence[Layer], present: tuple[torch.Tensor, ...],
    run_step: Callable[[], torch.Tensor], after_step: Callable[[], None], parameters: Iterable[torch.Tensor],
) -> SplitMemory | None:
    """One step, cut after the first layer as `timing.time_split_backward` cuts it (the first layer's outputs
    become a stage's received inputs: a first stage runs its whole backward as W and keeps nothing, so layer
    0 gets 0 of each), its backward run as B (`backward_inputs`) with live tensors tracked per layer
    (`memory.measure_workspace`, `present` the batch), then W.

    `deferred_bytes[i]`: the gradients `backward_inputs` records at layer i's boundary nodes (one per weighted
    op, about the size of that op's output; a loss's gradient over a vocabulary for a language model's head),
    which a plain backward frees as it goes. Each goes to the layer whose forward made the node it enters
    (`timing.backward_nodes`; one entering a node no layer made goes to layer 1).

    `freed_by_b_bytes[i]`: the saved tensors layer i saved that are gone once B returned and its caller let go of
    the loss (those only the input gradients read: the loss's log-softmax over a vocabulary, 16.8 MB on the gpt
    example's head, whose kept gradient is 28.6 MB). B itself frees nothing while it runs.

    `input_workspace_bytes[i]`: the most bytes live beyond saved activations and the received inputs while B
    runs layer i's nodes, less the gradients the layers after i keep (all held there): b_i = excess_i -
    sum_{j > i} deferred_j, so that a stage's B at layer i holds b_i plus what the stage's own later layers
    keep. b_i holds the gradient flowing in, temporaries, and the gradients layer i keeps as it goes (along a
    block of convolutions and batch norms, several).

    `weight_workspace_bytes[i]`: the most parameter bytes one of W's batched calls for layer i captures
    (`backward_split.weight_call_bytes`: separate query, key and value projections are one call), which W holds
    until it adds them into `.grad`.

    `after_step` runs after the step (zeroing the gradients W wrote). None for a model of one layer, or whose
    first layer returns nothing that needs a gradient: nothing is cut, nothing measured.
    """
    if len(layers) < 2:
        return None
    parameters = [parameter for parameter in parameters if parameter.requires_grad]
    stage = StageInput(layers[0])
    kept: list[PendingWeights] = []
    layer_of: dict[int, int] = {}
    freed = [0] * len(layers)  # saved bytes B freed, by the layer that saved them

    def split(box: list[torch.Tensor], layers_of: dict[int, int], mode: LiveStorageMode) -> None:
        for leaf in stage.leaves:  # a stage holds what it received until its B, as it holds saved activations
            mode.mark_saved(leaf)
        if stage.leaves and box[0].requires_grad:
            layer_of.update(layers_of)
            before = dict(mode.saved)
            kept.append(backward_inputs([box.pop()], [None], stage.leaves, parameters)[1])
            for key, nbytes in before.items():
                if key not in mode.saved and mode.saved_by.get(key, -1) >= 0:
                    freed[mode.saved_by[key]] += nbytes

    try:
        excess, _ = measure_workspace(model, layers, present, run_step, backward=split)
    finally:
        stage.remove()
    if not kept:
        after_step()
        return None
    gradients, calls = [0] * len(layers), [0] * len(layers)
    for node, grad in held_gradients(kept[0]):
        gradients[max(layer_of.get(id(node), 1), 1)] += _nbytes(grad)
    for node, nbytes in weight_call_bytes(kept[0]):
        layer = max(layer_of.get(id(node), 1), 1)
        calls[layer] = max(calls[layer], nbytes)
    backward_weights(kept.pop())
    after_step()
    after = [sum(gradients[layer + 1:]) for layer in range(len(layers))]
    held = [0] + [max(excess[layer] - after[layer], 0) for layer in range(1, len(layers))]
    freed[0] = 0
    return SplitMemory(gradients, freed, held, calls)
