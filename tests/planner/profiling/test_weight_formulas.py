"""The weight-side gradients computed from saved tensors equal what autograd hands the same edges."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd.graph import GradientEdge

from planner.profiling.weight_formulas import frontier_grads
from tests.conftest import gpu_only

Build = Callable[[torch.Tensor], tuple[torch.Tensor, list[int]]]  # input -> (output, weight-side edge indices)


def _param(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _compare(build: Build, x: torch.Tensor, rtol: float = 1e-6) -> list[torch.Tensor]:
    """frontier_grads against torch.autograd.grad on the node that made the output, for its weight-side edges."""
    out, indices = build(x)
    node = out.grad_fn
    grad = torch.randn_like(out)
    roots = [GradientEdge(node, 0)]
    captures = [GradientEdge(*node.next_functions[index]) for index in indices]
    expected = torch.autograd.grad(roots, captures, [grad], retain_graph=True)
    found = frontier_grads(roots, [grad], captures)
    assert found is not None, node.name()
    for actual, wanted in zip(found, expected):
        assert actual.shape == wanted.shape and actual.dtype == wanted.dtype
        torch.testing.assert_close(actual, wanted, rtol=rtol, atol=rtol * float(wanted.abs().max()))
    return found


def test_linear_weight_and_bias() -> None:
    """A Linear on a 2-d input leaves AddmmBackward0: the weight's transpose (edge 2) and the bias (edge 0)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(5, 3)
    _compare(lambda x: (linear(x), [0, 2]), torch.randn(4, 5, requires_grad=True))


def test_addmm_with_alpha_and_beta() -> None:
    torch.manual_seed(1)
    bias, weight = _param(3), _param(5, 3)
    _compare(lambda x: (torch.addmm(bias, x, weight, beta=0.5, alpha=3.0), [0, 2]), torch.randn(4, 5, requires_grad=True))


def test_linear_without_bias_on_a_3d_input() -> None:
    """Batched tokens fold into one matrix product (MmBackward0 under a view)."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(6, 4, bias=False)

    def build(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        out = linear(x.reshape(-1, 6))
        return out, [1]
    _compare(build, torch.randn(2, 3, 6, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_weight_and_bias(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    norm = torch.nn.LayerNorm(8).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    found = _compare(lambda x: (norm(x), [1, 2]), torch.randn(2, 5, 8, dtype=dtype, requires_grad=True),
                     rtol=1e-6 if dtype == torch.float32 else 1e-2)
    assert all(grad.dtype == dtype for grad in found)


def test_scale_broadcast_over_batch_and_a_kept_dimension() -> None:
    """A parameter of shape (1, 4, 1) times a (2, 3, 4, 5) input (an RMSNorm-style scale): summed back to its shape."""
    torch.manual_seed(4)
    scale = _param(1, 4, 1)
    _compare(lambda x: (scale * x, [0]), torch.randn(2, 3, 4, 5, requires_grad=True))
    _compare(lambda x: (x * scale, [1]), torch.randn(2, 3, 4, 5, requires_grad=True))


def test_float32_scale_of_a_bfloat16_input() -> None:
    """Type promotion: the product is float32, the gradient goes to the float32 parameter."""
    torch.manual_seed(5)
    scale = _param(6)
    _compare(lambda x: (scale * x, [0]), torch.randn(3, 6, dtype=torch.bfloat16, requires_grad=True), rtol=1e-2)


def test_bias_add_with_alpha() -> None:
    torch.manual_seed(6)
    bias = _param(6)
    _compare(lambda x: (torch.add(x, bias, alpha=-2.0), [1]), torch.randn(3, 6, requires_grad=True))
    _compare(lambda x: (bias + x, [0]), torch.randn(3, 6, requires_grad=True))


def test_convolution_weight_and_bias() -> None:
    torch.manual_seed(9)
    conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1, groups=1)
    _compare(lambda x: (conv(x), [1, 2]), torch.randn(2, 3, 9, 9, requires_grad=True))
    grouped = torch.nn.Conv1d(4, 4, 3, groups=2, bias=False)
    _compare(lambda x: (grouped(x), [1]), torch.randn(2, 4, 6, requires_grad=True))


def test_batch_norm_in_training_mode() -> None:
    torch.manual_seed(10)
    norm = torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    _compare(lambda x: (norm(x), [1, 2]), torch.randn(4, 3, 5, 5, requires_grad=True))
    _compare(lambda x: (norm(x), [2]), torch.randn(4, 3, 5, 5, requires_grad=True))


@gpu_only
@pytest.mark.parametrize("channels_last", [False, True])
def test_cudnn_batch_norm_on_a_gpu(channels_last: bool) -> None:
    """float32 batch norm on a GPU runs cuDNN's (CudnnBatchNormBackward0): its weight and bias gradients are
    cuDNN's own backward's, whose input gradient is computed again and dropped."""
    torch.manual_seed(11)
    norm = torch.nn.BatchNorm2d(3).cuda()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(4, 3, 5, 5, device="cuda")
    x = (x.to(memory_format=torch.channels_last) if channels_last else x).requires_grad_()
    assert norm(x).grad_fn.name() == "CudnnBatchNormBackward0"
    _compare(lambda x: (norm(x), [1, 2]), x)
    _compare(lambda x: (norm(x), [2]), x)


def test_what_has_no_formula_is_left_to_autograd() -> None:
    """None for a node without a formula, for batch norm in evaluation mode, and for a product into something that
    is not a parameter (its shape is autograd's to know)."""
    torch.manual_seed(7)
    prelu = torch.nn.PReLU(2)
    x = torch.randn(1, 2, 5, requires_grad=True)
    out = prelu(x)
    edge = GradientEdge(out.grad_fn, 0)
    assert frontier_grads([edge], [torch.ones_like(out)], [GradientEdge(*out.grad_fn.next_functions[1])]) is None
    norm = torch.nn.BatchNorm1d(2).eval()
    out = norm(x)
    assert out.grad_fn.name() == "NativeBatchNormBackward0"
    assert frontier_grads([GradientEdge(out.grad_fn, 0)], [torch.ones_like(out)],
                          [GradientEdge(*out.grad_fn.next_functions[1])]) is None
    scale = _param(4)
    out = (scale * 2.0) * x.new_ones(3, 4)  # the scale reaches mul through another node (MulBackward1)
    product = out.grad_fn
    assert product.name() == "MulBackward0"
    capture = GradientEdge(*product.next_functions[0])
    assert frontier_grads([GradientEdge(product, 0)], [torch.ones_like(out)], [capture]) is None


def test_a_capture_two_roots_lead_to_is_left_to_autograd() -> None:
    """One parameter used by two boundaries of one call: its gradient is their sum, autograd's to add."""
    torch.manual_seed(8)
    weight = _param(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    first, second = x.mm(weight), (x * 2).mm(weight)
    roots = [GradientEdge(first.grad_fn, 0), GradientEdge(second.grad_fn, 0)]
    capture = GradientEdge(*first.grad_fn.next_functions[1])
    assert capture.node is second.grad_fn.next_functions[1][0]
    assert frontier_grads(roots, [torch.ones_like(first), torch.ones_like(second)], [capture]) is None


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), inner=st.integers(1, 6), cols=st.integers(1, 6), bias=st.booleans(),
       alpha=st.sampled_from([1.0, 0.5, -2.0]), beta=st.sampled_from([1.0, 2.0]))
def test_random_matrix_products(rows: int, inner: int, cols: int, bias: bool, alpha: float, beta: float) -> None:
    torch.manual_seed(rows * 100 + inner * 10 + cols)
    weight = _param(inner, cols)
    if bias:
        shift = _param(cols)
        _compare(lambda x: (torch.addmm(shift, x, weight, beta=beta, alpha=alpha), [0, 2]),
                 torch.randn(rows, inner, requires_grad=True), rtol=1e-5)
    else:
        _compare(lambda x: (x.mm(weight), [1]), torch.randn(rows, inner, requires_grad=True), rtol=1e-5)
