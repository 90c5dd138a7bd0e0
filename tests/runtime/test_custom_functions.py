"""Custom autograd Functions at the split (runtime.custom_functions through runtime.stages.split_model): torch.fx and
torch.export both keep a Function's forward and lose its backward. One whose backward is its forward's derivative
(BLOOM's GeLU) splits, with the model's gradients; one whose backward is another (a gradient reversal, a
straight-through estimator) is refused in one line, as is one whose forward autograd cannot differentiate (4.46's
DeBERTa-v2 XSoftmax) and one met without an example to check it on; one inside a
module torch.fx keeps whole runs as written; `Function.apply` is the class's own again afterwards."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from runtime.custom_functions import gradients_differ
from runtime.stages import StageSplitError, run_stages, split_model


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


@pytest.mark.parametrize("function", [Reverse, Rounding], ids=["reversal", "straight-through"])
@pytest.mark.parametrize("by_len", [False, True], ids=["fx", "export"])
def test_a_function_whose_backward_is_another_is_refused_naming_it_and_its_line(by_len: bool, function: type) -> None:
    apply = torch.autograd.Function.__dict__["apply"]
    model = Adversarial(by_len, function=function)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(StageSplitError) as raised:
        split_model(model, ["hidden"], (torch.randn(3, 4),))
    message = str(raised.value)
    assert f"applies the custom autograd Function {function.__name__}, at test_custom_functions.py:" in message
    assert "`h = self.reverse(h) if self.inside else self.function.apply(h)`" in message
    assert "keeps its forward's operations but not its own backward, which gives other gradients" in message
    assert "\n" not in message
    assert torch.autograd.Function.__dict__["apply"] is apply
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("by_len, method", [(False, "fx"), (True, "export")])
def test_a_function_whose_backward_is_its_forwards_derivative_splits_with_the_models_gradients(
        by_len: bool, method: str) -> None:
    model, x = Adversarial(by_len, function=TanhGelu), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["hidden"], (x,))
    assert stages.method == method
    run_stages(stages, x).sum().backward()
    reference(x).sum().backward()
    for (name, found), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(found.grad, wanted.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_function_whose_forward_autograd_cannot_differentiate_is_refused_saying_why() -> None:
    with pytest.raises(StageSplitError, match=r"ZeroedSoftmax, at .* which could not be compared with them on the "
                                              r"example \(RuntimeError: one of the variables needed for gradient"):
        split_model(Adversarial(function=ZeroedSoftmax), ["hidden"], (torch.randn(3, 4),))


def test_without_an_example_a_function_in_traced_code_is_refused_asking_for_one() -> None:
    with pytest.raises(StageSplitError, match="TanhGelu, at .*pass an example microbatch .* so that the split can "
                                              "check"):
        split_model(Adversarial(function=TanhGelu), ["hidden"])


def test_a_function_inside_a_module_kept_whole_runs_as_written() -> None:
    model, x = Adversarial(inside=True), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    stages = split_model(model, ["hidden"], (x,))
    assert stages.method == "fx"
    run_stages(stages, x).sum().backward()
    reference(x).sum().backward()
    for (name, found), wanted in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(found.grad, wanted.grad, rtol=0, atol=0, msg=name)


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


def test_keyword_arguments_are_checked_as_the_model_passes_them() -> None:
    try:
        Scaled.apply(torch.ones(1), scale=2.0)
    except TypeError:  # torch 2.11's apply took none (seen on the GPU lease's torch): no model can pass them there
        pytest.skip("this torch's autograd.Function.apply takes no keyword arguments")
    with pytest.raises(StageSplitError, match="Function Scaled, at .* which gives other gradients"):
        split_model(ScaledByKeyword(), ["b"], (torch.randn(3, 4),))


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


@pytest.mark.parametrize("function, args, dtype, wrong", [
    (Summed, 2, torch.float32, True),  # each gradient against its own size: b's small flipped one is found
    (TanhGelu, 1, torch.bfloat16, False),  # at bf16's precision
    (MaskedDropout, 1, torch.float32, False),  # the same masks in both runs
    (DoubledInPlace, 1, torch.float32, False),  # in place on a value made in the graph, as in a model
])
def test_the_gradients_are_compared_as_the_function_runs(function: type, args: int, dtype: torch.dtype,
                                                         wrong: bool) -> None:
    torch.manual_seed(0)
    call = (tuple(torch.randn(64, 32, dtype=dtype) for _ in range(args)), {})
    state = torch.get_rng_state()
    found = gradients_differ(function, call)
    assert (found == "gives other gradients on the example") if wrong else found is None, found
    assert torch.equal(torch.get_rng_state(), state)


class OnlyWithGrad(Adversarial):
    """Applies the Function only when autograd records (a fused kernel's fast path's usual guard)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if torch.is_grad_enabled():
            h = TanhGelu.apply(h)
        return self.head(self.hidden(h))


def test_the_model_runs_on_the_example_as_in_training_and_an_example_that_fails_is_one_line() -> None:
    assert split_model(OnlyWithGrad(), ["hidden"], (torch.randn(3, 4),)).method == "fx"
    with pytest.raises(StageSplitError, match=r"TanhGelu, at .* the model raised on the example microbatch, so the "
                                              r"split cannot check it \(RuntimeError: mat1 and mat2"):
        split_model(Adversarial(function=TanhGelu), ["hidden"], (torch.randn(3, 5),))
