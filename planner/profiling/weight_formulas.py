"""Weight gradients of the commonest autograd nodes, computed from their saved tensors (W's phase 1, fast).

W's phase 1 (`backward_split.backward_weights`) runs each boundary node again from the gradients B
recorded at it, for its outputs into the weight side only. Run through `torch.autograd.grad`, every
such call makes autograd walk the whole graph below the node (`compute_dependencies`): a chain of L
layers costs O(L^2) node visits, which measured 0.05-0.45 ms per call on a CPU and dominated W on
small microbatches (the gpt example at batch 1: 75 calls, 18 ms, against 19 ms for the whole plain
backward). For the nodes that Linear, convolution, layer and batch norm, scales and bias adds leave,
the weight side is computed here from the node's saved tensors, with no walk:

    AddmmBackward0    out = beta self + alpha mat1 @ mat2:   d mat2 = alpha mat1^T g,  d self = sum_to(beta g)
    MmBackward0       out = self @ mat2:                      d mat2 = self^T g
    MulBackward0      out = self other:                       d self = sum_to(g other),  d other = sum_to(g self)
    AddBackward0      out = self + alpha other:               d self = sum_to(g),  d other = sum_to(alpha g)
    NativeLayerNormBackward0, ConvolutionBackward0, NativeBatchNormBackward0 (training mode): the aten
        backward kernel autograd calls, with the output mask asking for the weight and bias only;
        CudnnBatchNormBackward0 (training mode): cuDNN's backward kernel, which has no mask

(g: the gradient B recorded at the node; sum_to: summed over the dimensions broadcasting added, to the
shape of the parameter the edge leads to.) Each result is what autograd would hand the edge: the same
shape and dtype, equal to rounding (the products may be taken in another order: 1e-6 relative in
float32; the kernels' results are autograd's own). `frontier_grads` answers for a whole phase-1 call
or for none of it (None: the caller runs the call through autograd): a node of another kind (a custom
Function, a compiled graph), a sum_to or product into a node other than a
parameter's AccumulateGrad (whose shape and dtype only autograd knows), a complex or sparse tensor,
or a saved tensor that cannot be read. Unlike autograd, no hook registered on these nodes or on the
tensors between them and the parameters runs (W's own limits already exclude AccumulateGrad's
post-hooks).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["frontier_grads"]


def frontier_grads(roots: Sequence[GradientEdge], grads: Sequence[torch.Tensor],
                   captures: Sequence[GradientEdge]) -> list[torch.Tensor] | None:
    """The gradient flowing into each of `captures` when `roots` (boundary nodes, each entered at input 0)
    start from `grads`, as `torch.autograd.grad(roots, captures, grads)` would give it, by the module
    docstring's formulas; None unless every capture is a child edge of exactly one root and has a formula."""
    if len({id(edge.node) for edge in roots}) != len(roots) or any(edge.output_nr != 0 for edge in roots):
        return None
    wanted: dict[int, tuple[Node, torch.Tensor, list[int], list[Node]]] = {}  # per root: its captured edges
    places: list[tuple[int, int]] = []  # per capture: (root, position among that root's captured edges)
    for capture in captures:
        sources = [(edge.node, grad, index) for edge, grad in zip(roots, grads)
                   for index, (child, slot) in enumerate(edge.node.next_functions)
                   if child is capture.node and slot == capture.output_nr]
        if len(sources) != 1 or sources[0][0].name() not in _FORMULAS or not _plain(sources[0][1]):
            return None
        node, grad, index = sources[0]
        entry = wanted.setdefault(id(node), (node, grad, [], []))
        places.append((id(node), len(entry[2])))
        entry[2].append(index)
        entry[3].append(capture.node)
    found: dict[int, list[torch.Tensor | None]] = {}
    for key, (node, grad, indices, children) in wanted.items():
        try:
            with torch.no_grad():  # as autograd runs a node (no create_graph): no view records grad mode
                found[key] = _FORMULAS[node.name()](node, grad, indices, children)
        except (RuntimeError, AttributeError, TypeError):  # a saved tensor freed, shapes a formula cannot take,
            return None  # or a saved attribute another torch version names otherwise: autograd does it
    results = [found[key][position] for key, position in places]
    return None if any(result is None for result in results) else results  # type: ignore[return-value]


def _plain(tensor: object) -> bool:
    """A dense, real floating-point tensor."""
    return (isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and tensor.is_floating_point())


def _parameter(child: Node) -> torch.Tensor | None:
    """The parameter whose AccumulateGrad `child` is, else None."""
    variable = getattr(child, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def _sum_to(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """`tensor` summed over the leading dimensions it has beyond `shape` and over those `shape` has as 1
    (undoing broadcasting, as autograd's sum_to); None where the shapes do not broadcast that way."""
    extra = tensor.dim() - len(shape)
    if extra < 0:
        return None
    if extra:
        tensor = tensor.sum(tuple(range(extra)))
    ones = tuple(dim for dim, size in enumerate(shape) if size == 1 and tensor.shape[dim] != 1)
    if ones:
        tensor = tensor.sum(ones, keepdim=True)
    return tensor if tensor.shape == shape else None


def _into_parameter(child: Node, grad: torch.Tensor) -> torch.Tensor | None:
    """`grad` summed to the shape and cast to the dtype of the parameter `child` accumulates into; None when
    `child` is not a parameter's AccumulateGrad."""
    parameter = _parameter(child)
    if parameter is None or not parameter.is_floating_point():
        return None
    summed = _sum_to(grad, parameter.shape)
    return None if summed is None else summed.to(parameter.dtype)


def _scaled(tensor: torch.Tensor, factor: object) -> torch.Tensor:
    """tensor x factor, skipping a factor of 1."""
    return tensor if factor == 1 else tensor * factor


def _matrix_grad(grad: torch.Tensor, left: torch.Tensor, factor: object) -> torch.Tensor | None:
    """d mat2 of left @ mat2 from the output gradient: factor left^T grad, laid out transposed as autograd
    lays out a Linear's mat2 (the weight's transpose)."""
    if not _plain(left) or left.dim() != 2 or grad.dim() != 2 or left.dtype != grad.dtype:
        return None
    return _scaled(grad.t().mm(left).t(), factor)


def _each(indices: Sequence[int], children: Sequence[Node],
          one: Callable[[int, Node], torch.Tensor | None]) -> list[torch.Tensor | None]:
    """One formula per captured edge."""
    return [one(index, child) for index, child in zip(indices, children)]


def _masked(kernel: Callable[[list[bool]], Sequence[torch.Tensor]], indices: Sequence[int]) -> list[torch.Tensor | None]:
    """The outputs at `indices` of an aten backward kernel that takes an output mask of 3 (input, weight, bias),
    asked for those outputs only: the kernel autograd calls, once for all of a node's captured edges."""
    if any(index not in (1, 2) for index in indices):
        return [None] * len(indices)
    outputs = kernel([False, 1 in indices, 2 in indices])
    return [outputs[index] for index in indices]


def _addmm(node: Node, grad: torch.Tensor, indices: Sequence[int], children: Sequence[Node]) -> list[torch.Tensor | None]:
    """d mat2 = alpha mat1^T g (edge 2), d self = sum_to(beta g) (edge 0, into a parameter)."""
    def one(index: int, child: Node) -> torch.Tensor | None:
        if index == 2:
            return _matrix_grad(grad, node._saved_mat1, node._saved_alpha)
        return _into_parameter(child, _scaled(grad, node._saved_beta)) if index == 0 else None
    return _each(indices, children, one)


def _mm(node: Node, grad: torch.Tensor, indices: Sequence[int], children: Sequence[Node]) -> list[torch.Tensor | None]:
    """d mat2 = self^T g (edge 1)."""
    return _each(indices, children, lambda index, _: _matrix_grad(grad, node._saved_self, 1) if index == 1 else None)


def _mul(node: Node, grad: torch.Tensor, indices: Sequence[int], children: Sequence[Node]) -> list[torch.Tensor | None]:
    """d self = sum_to(g other), d other = sum_to(g self), each into a parameter."""
    def one(index: int, child: Node) -> torch.Tensor | None:
        other = node._saved_other if index == 0 else node._saved_self if index == 1 else None
        return _into_parameter(child, grad * other) if _plain(other) else None
    return _each(indices, children, one)


def _add(node: Node, grad: torch.Tensor, indices: Sequence[int], children: Sequence[Node]) -> list[torch.Tensor | None]:
    """d self = sum_to(g), d other = sum_to(alpha g), each into a parameter."""
    def one(index: int, child: Node) -> torch.Tensor | None:
        if index not in (0, 1):
            return None
        return _into_parameter(child, grad if index == 0 else _scaled(grad, node._saved_alpha))
    return _each(indices, children, one)


def _layer_norm(node: Node, grad: torch.Tensor, indices: Sequence[int],
                children: Sequence[Node]) -> list[torch.Tensor | None]:
    """Weight and bias gradients by `native_layer_norm_backward`, masked to them."""
    return _masked(lambda mask: torch.ops.aten.native_layer_norm_backward(
        grad, node._saved_input, node._saved_normalized_shape, node._saved_result1, node._saved_result2,
        node._saved_weight, node._saved_bias, mask), indices)


def _convolution(node: Node, grad: torch.Tensor, indices: Sequence[int],
                 children: Sequence[Node]) -> list[torch.Tensor | None]:
    """Weight and bias gradients by `convolution_backward`, masked to them."""
    return _masked(lambda mask: torch.ops.aten.convolution_backward(
        grad, node._saved_input, node._saved_weight, node._saved_bias_sym_sizes_opt, node._saved_stride,
        node._saved_padding, node._saved_dilation, node._saved_transposed, node._saved_output_padding,
        node._saved_groups, mask), indices)


def _batch_norm(node: Node, grad: torch.Tensor, indices: Sequence[int],
                children: Sequence[Node]) -> list[torch.Tensor | None]:
    """Weight and bias gradients by `native_batch_norm_backward` in training mode, masked to them."""
    if not node._saved_training:  # (evaluation mode: left to autograd)
        return [None] * len(indices)
    return _masked(lambda mask: torch.ops.aten.native_batch_norm_backward(
        grad, node._saved_input, node._saved_weight, node._saved_running_mean, node._saved_running_var,
        node._saved_result1, node._saved_result2, True, node._saved_eps, mask), indices)


def _cudnn_batch_norm(node: Node, grad: torch.Tensor, indices: Sequence[int],
                      children: Sequence[Node]) -> list[torch.Tensor | None]:
    """cuDNN's batch norm (float32 and half on a GPU): its backward kernel has no output mask, so it computes
    the input's gradient again too (one pass over the activations; an autograd call would cost a graph walk)."""
    if not node._saved_training or any(index not in (1, 2) for index in indices):
        return [None] * len(indices)
    source = node._saved_input
    outputs = torch.ops.aten.cudnn_batch_norm_backward(
        source, grad.contiguous(memory_format=_memory_format(source)), node._saved_weight,
        node._saved_running_mean, node._saved_running_var, node._saved_result1, node._saved_result2,
        node._saved_epsilon, node._saved_result3.clone())
    return [outputs[index] for index in indices]


def _memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """The layout autograd hands cuDNN's batch norm its gradient in (`suggest_memory_format`)."""
    return torch.channels_last if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last) \
        and not tensor.is_contiguous() else torch.contiguous_format


# node name -> (node, gradient at it, indices of its captured edges, their nodes) -> a gradient per edge (None: none)
_Formula = Callable[[Node, torch.Tensor, Sequence[int], Sequence[Node]], list["torch.Tensor | None"]]
_FORMULAS: dict[str, _Formula] = {
    "AddmmBackward0": _addmm,
    "MmBackward0": _mm,
    "MulBackward0": _mul,
    "AddBackward0": _add,
    "NativeLayerNormBackward0": _layer_norm,
    "ConvolutionBackward0": _convolution,
    "NativeBatchNormBackward0": _batch_norm,
    "CudnnBatchNormBackward0": _cudnn_batch_norm,
}
