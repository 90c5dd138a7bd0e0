"""Custom autograd Functions at the split (runtime.custom_functions through runtime.stages.split_model): each call is
one node of the traced (torch.fx) or exported (torch.export) graph that applies the Function, so split stages train
with the Function's own backward, as eager mode does: a gradient reversal, a straight-through estimator, a
hand-written derivative that saves only its input (BLOOM's GeLU: its memory too), an in-place softmax autograd
could not differentiate (4.46's DeBERTa-v2), keyword and non-tensor arguments and outputs, random draws, in-place
`mark_dirty` Functions, the setup_context style, an `apply` bound before the split, a class defined in the forward,
a defaulted argument left out, buffers and devices that follow the stage; a forward called directly runs as
written; the classes are as they were afterwards."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from autograd_saved import saved_bytes
from runtime.stages import run_stages, split_model
from tests.conftest import gpu_only


class Reverse(torch.autograd.Function):
    """Gradient reversal: the identity forward, the negated gradient backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class Rounding(torch.autograd.Function):
    """A straight-through estimator: rounds, and passes the gradient through as if it had not."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


class TanhGelu(torch.autograd.Function):
    """GeLU's tanh form with its derivative written by hand (BLOOM's GeLUFunction, which saves only its input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        tanh = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - tanh * tanh) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh))


class ZeroedSoftmax(torch.autograd.Function):
    """A softmax that zeroes its smallest entries in place and saves its output (transformers 4.46's XSoftmax):
    autograd of its forward alone cannot run, since softmax's backward needs the output it overwrote."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        output = torch.softmax(x, -1)
        output.masked_fill_(output < 0.1, 0)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (output,) = ctx.saved_tensors
        return output * (grad - (grad * output).sum(-1, keepdim=True))


class Reversing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Reverse.apply(x)


class Adversarial(nn.Module):
    """A feature extractor, a gradient reversal, a head; `by_len` reshapes with len() (torch.fx cannot trace that,
    torch.export can); `inside` applies the reversal in a module of its own instead of in this forward."""

    def __init__(self, by_len: bool = False, inside: bool = False, function: type = Reverse) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features, self.hidden, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.reverse = Reversing()
        self.by_len, self.inside, self.function = by_len, inside, function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if self.by_len:
            h = h.reshape(len(h), -1)
        h = self.reverse(h) if self.inside else self.function.apply(h)
        return self.head(self.hidden(h))


class Scaled(torch.autograd.Function):
    """x * scale, its backward ignoring the scale: wrong unless scale is 1."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ScaledByKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(Scaled.apply(self.a(x), scale=-1.0))


class Summed(torch.autograd.Function):
    """a * 1e4 + b, its backward flipping b's gradient: wrong, next to a large right one."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * 1e4 + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad * 1e4, -grad


class MaskedDropout(torch.autograd.Function):
    """Dropout that keeps only its mask for backward (right, and it draws)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand_like(x) > 0.5
        ctx.save_for_backward(keep)
        return x * keep * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (keep,) = ctx.saved_tensors
        return grad * keep * 2


class DoubledInPlace(torch.autograd.Function):
    """Doubles its input in place (mark_dirty), reading ctx.needs_input_grad: right."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        assert ctx.needs_input_grad[0]
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class OnlyWithGrad(Adversarial):
    """Applies the Function only when autograd records (a fused kernel's fast path's usual guard)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if torch.is_grad_enabled():
            h = TanhGelu.apply(h)
        return self.head(self.hidden(h))




class TwoOutputs(torch.autograd.Function):
    """Takes a list of two tensors and a keyword scale; returns (a * scale + b, its row count, a - b), its backward
    not the derivative (b's gradient doubled)."""

    @staticmethod
    def forward(ctx: Any, pair: list[torch.Tensor], scale: float = 1.0) -> tuple[torch.Tensor, int, torch.Tensor]:
        a, b = pair
        return a * scale + b, a.shape[0], a - b

    @staticmethod
    def backward(ctx: Any, grad_sum: torch.Tensor, _rows: None, grad_difference: torch.Tensor) -> tuple[None, None]:
        return None, None  # a list argument gets no gradient from apply (as in eager mode)


class Applying(nn.Module):
    """features -> `function` -> hidden -> head; `by_len` reshapes with len() (torch.fx cannot trace that,
    torch.export can). `function` takes the features and returns a tensor."""

    def __init__(self, function: Any, by_len: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features, self.hidden, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.function, self.by_len = function, by_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if self.by_len:
            h = h.reshape(len(h), -1)
        return self.head(self.hidden(self.function(h)))


class ScaledWithContext(torch.autograd.Function):
    """x * scale in the setup_context style (forward without ctx), its backward ignoring the scale."""

    @staticmethod
    def forward(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad + 0 * x, None


class ReverseAgain(Reverse):
    """Inherits Reverse's forward and backward."""


class ReverseScaled(torch.autograd.Function):
    """Gradient reversal with a defaulted strength its backward ignores: one gradient, as in eager mode where the
    caller leaves `alpha` out."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        return x * alpha

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class Masked(torch.autograd.Function):
    """x times diag(mask), the mask moved to `device`; the mask's gradient None."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
        return x @ torch.diag(mask.to(device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return -grad, None, None


def _reversed_by_a_class_made_now(h: torch.Tensor) -> torch.Tensor:
    class MadeNow(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return -grad

    return MadeNow.apply(h)


def _two_outputs(h: torch.Tensor) -> torch.Tensor:
    total, rows, difference = TwoOutputs.apply([h, h * 2], scale=-1.0)
    return total * rows + difference


def _doubled_in_place(h: torch.Tensor) -> torch.Tensor:
    return DoubledInPlace.apply(h * 1)


CALLS = {
    "reversal": Reverse.apply,  # bound before the split, as a model's attribute would be
    "reversal-applied-by-name": lambda h: Reverse.apply(h),
    "inherited": ReverseAgain.apply,
    "setup-context": lambda h: ScaledWithContext.apply(h, -1.0),
    "class-defined-in-the-forward": _reversed_by_a_class_made_now,
    "defaulted-argument-left-out": ReverseScaled.apply,
    "forward-called-directly": lambda h: Reverse.forward(None, h) * 2,  # plain operations, as in eager mode
    "straight-through": Rounding.apply,
    "hand-written-derivative": TanhGelu.apply,
    "in-place-softmax": ZeroedSoftmax.apply,
    "keyword": lambda h: Scaled.apply(h, scale=-1.0),
    "two-arguments": lambda h: Summed.apply(h, h * 3),
    "draws": MaskedDropout.apply,
    "mark-dirty": _doubled_in_place,
    "list-argument-and-int-output": _two_outputs,
}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.grad for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("by_len, method", [(False, "fx"), (True, "export")])
@pytest.mark.parametrize("call", list(CALLS))
def test_a_split_model_trains_with_each_functions_own_backward_as_in_eager_mode(call: str, by_len: bool,
                                                                                 method: str) -> None:
    try:
        Scaled.apply(torch.ones(1), scale=2.0)
    except TypeError:  # torch 2.11's apply took none (seen on the GPU lease's torch): no model can pass them there
        if call in ("keyword", "list-argument-and-int-output"):
            pytest.skip("this torch's autograd.Function.apply takes no keyword arguments")
    classes = (Reverse, ReverseAgain, ScaledWithContext, TwoOutputs, torch.autograd.function.FunctionMeta)
    before = [dict(cls.__dict__) for cls in classes]
    model, x = Applying(CALLS[call], by_len), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["hidden"], (x,))
    assert stages.method == method
    assert [dict(cls.__dict__) for cls in classes] == before  # forward and setup_context put back
    torch.manual_seed(1)
    run_stages(stages, x).sum().backward()
    torch.manual_seed(1)
    reference(x).sum().backward()
    for name, wanted in _grads(reference).items():
        torch.testing.assert_close(_grads(model)[name], wanted, rtol=0, atol=0, msg=name)


def test_the_reversal_is_not_the_forwards_derivative() -> None:
    """The check above can tell: autograd of Reverse's forward would give the other sign."""
    model, x = Applying(lambda h: h.view_as(h), False), torch.randn(3, 4)
    reversed_model = Applying(Reverse.apply, False)
    model(x).sum().backward()
    reversed_model(x).sum().backward()
    torch.testing.assert_close(reversed_model.features.weight.grad, -model.features.weight.grad)


class Wide(nn.Module):
    """A width-256 linear, BLOOM's GeLU Function, a head: the Function saves its input alone."""

    def __init__(self, by_len: bool) -> None:
        super().__init__()
        self.up, self.down, self.by_len = nn.Linear(64, 256), nn.Linear(256, 64), by_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.by_len:
            h = h.reshape(len(h), -1)
        return self.down(TanhGelu.apply(h))


@pytest.mark.parametrize("by_len", [False, True], ids=["fx", "export"])
def test_a_function_that_saves_less_than_its_forwards_operations_saves_as_much_once_split(by_len: bool) -> None:
    model, x = Wide(by_len), torch.randn(32, 64)
    eager = saved_bytes(lambda: model(x))
    inlined = saved_bytes(lambda: model.down(model.up(x) * 0.5 * (1 + torch.tanh(0.79788456 * model.up(x)))))
    assert inlined > eager  # operations in place of the Function would save more (the test can tell)
    stages = split_model(model, ["down"], (x,))
    assert saved_bytes(lambda: run_stages(stages, x)) == eager


def test_a_function_applied_only_when_autograd_records_is_one_node_of_the_traced_graph() -> None:
    model, x = OnlyWithGrad(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["hidden"], (x,))
    assert stages.method == "fx"
    assert any("TanhGelu" in repr(node.target) for stage in stages for node in stage.graph.nodes)
    run_stages(stages, x).sum().backward()
    reference(x).sum().backward()
    for name, wanted in _grads(reference).items():
        torch.testing.assert_close(_grads(model)[name], wanted, rtol=0, atol=0, msg=name)


class WithBuffer(nn.Module):
    """A Function given a buffer and the input's device, in a forward torch.fx traces (`by_len`: export)."""

    def __init__(self, by_len: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.by_len = nn.Linear(4, 4), nn.Linear(4, 2), by_len
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.by_len:
            h = h.reshape(len(h), -1)
        return self.b(Masked.apply(h, self.mask, h.device))


@pytest.mark.parametrize("by_len", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("moved_to", ["double", "meta", pytest.param("cuda", marks=gpu_only)])
def test_a_functions_buffer_and_device_arguments_follow_the_stage(by_len: bool, moved_to: str) -> None:
    model, x = WithBuffer(by_len), torch.randn(3, 4)
    stages = split_model(model, ["b"], (x,))  # on the CPU, as training splits before it moves stages
    move: Any = (lambda value: value.double()) if moved_to == "double" else (lambda value: value.to(moved_to))
    for stage in stages:
        move(stage)  # as a runtime moves stages to their device: the buffer goes too
    assert move(torch.ones(1)).dtype == stages[0].get_buffer("mask").dtype
    assert stages[0].get_buffer("mask").device == move(torch.ones(1)).device
    reference = move(copy.deepcopy(model))
    found = run_stages(stages, move(x))
    wanted = reference(move(x))
    assert found.device == wanted.device and found.dtype == wanted.dtype
    if moved_to != "meta":
        torch.testing.assert_close(found, wanted)
        found.square().sum().backward()
        wanted.square().sum().backward()
        for name, expected in _grads(reference).items():
            torch.testing.assert_close(_grads(model)[name], expected, msg=name)


def test_functions_run_as_written_outside_the_capture_and_a_forward_without_a_signature_is_left_alone() -> None:
    class Builtin(torch.autograd.Function):
        forward = staticmethod(max)  # no signature to copy: left as it is

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    from runtime.custom_functions import FunctionCalls

    x = torch.randn(3, requires_grad=True)
    with FunctionCalls():  # as in another thread while a split runs: real tensors, no capture
        Reverse.apply(x).sum().backward()
        assert Builtin.forward is max
    torch.testing.assert_close(x.grad, -torch.ones(3))
    assert "forward" in Reverse.__dict__ and Reverse.__dict__["forward"].__func__.__name__ == "forward"
