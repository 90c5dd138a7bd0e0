"""Batch coupling: batch norm that normalises with the batch, and outputs or losses that mix the samples, are found;
models whose samples are independent are not flagged (dropout, odd batches, bf16, outputs without the batch first);
what cannot be checked says why; the model's modes (through its own `train()`) and the random state are restored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.files.profile import BatchCoupling
from planner.profiling.batch_coupling import find_batch_coupling
from planner.profiling.model_file import default_loss, load_model_file
from runtime.nested import map_tensors
from tests.conftest import EXAMPLES, REPO, gpu_only

BENCHMARK_MODELS = REPO / "benchmarks" / "models"


def batch(size: int = 6) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    return (torch.randn(size, 4),), torch.randint(0, 3, (size,))


def mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3)).train()


class Wrapped(nn.Module):
    """A linear layer, then `after(y)` on its outputs (batch first)."""

    def __init__(self, after: Any) -> None:
        super().__init__()
        self.linear, self.after = nn.Linear(4, 3), after

    def forward(self, x: torch.Tensor) -> Any:
        return self.after(self.linear(x))


def logits(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output["logits"], target)


class Merging(nn.Linear):
    """A LoRA-like layer: `eval()` folds a delta into the weight, `train()` takes it out again."""

    def __init__(self) -> None:
        super().__init__(4, 3)
        self.delta = nn.Parameter(torch.full((3, 4), 0.5))
        self.merged = False

    def train(self, mode: bool = True) -> "Merging":
        super().train(mode)
        if mode == self.merged:
            with torch.no_grad():
                self.weight += self.delta if not mode else -self.delta
            self.merged = not mode
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight if self.merged else self.weight + self.delta, self.bias)


def test_independent_samples_are_not_flagged_dropout_and_an_odd_batch_included() -> None:
    inputs, target = batch(5)  # halves of 2 and 3 samples: their losses weigh 2/5 and 3/5
    found = find_batch_coupling(mlp(), inputs, target, default_loss)
    assert found == BatchCoupling((), None, None) and found.notes() == []


def test_a_bf16_model_is_compared_at_its_own_precision() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).to(torch.bfloat16)
    inputs, target = (torch.randn(32, 64).bfloat16(),), torch.randint(0, 10, (32,))
    # its cross entropy, rounded to bf16 and returned as float32, reads 2.32812 for the batch and 2.32031 for the
    # halves: rounding, not coupling (a float32 tolerance called it coupled)
    found = find_batch_coupling(model, inputs, target, lambda output, labels: F.cross_entropy(output, labels).float())
    assert found == BatchCoupling()


def test_batch_norm_that_uses_the_batch_statistics_is_named() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3), nn.BatchNorm1d(3, affine=False))
    inputs, target = batch()
    found = find_batch_coupling(model.train(), inputs, target, default_loss)
    assert found == BatchCoupling(("1", "3"))  # in eval mode they use running statistics: samples independent
    model[1].eval()
    assert find_batch_coupling(model, inputs, target, default_loss).batch_norm == ("3",)
    without_running = nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 3)).eval()
    found = find_batch_coupling(without_running, inputs, target, default_loss)
    assert found.batch_norm == ("0",)  # batch statistics in every mode
    assert "changes by" in found.across_samples  # and so in the eval-mode check too


def test_an_output_over_the_batch_is_found_by_its_shape_and_named_by_its_key() -> None:
    inputs, _ = batch()
    found = find_batch_coupling(Wrapped(lambda y: {"logits": y @ y.T, "scale": torch.ones(())}), inputs,
                                torch.arange(6), logits)
    assert found.across_samples == ("output ['logits'] has shape (6, 6) at a batch of 6 and (3, 3) at 3: it is "
                                    "computed over the batch")


def test_an_output_mixing_the_samples_is_found_by_its_values_in_either_half() -> None:
    inputs, target = batch()
    centred = find_batch_coupling(Wrapped(lambda y: y - y.mean(dim=0, keepdim=True)), inputs, target, default_loss)
    assert centred.across_samples is not None
    assert centred.across_samples.startswith("the output of samples 0-2 changes by ")
    assert centred.across_samples.endswith("of its largest value when the other 3 are left out")
    # relative to the first sample: the first half alone keeps it, the second half does not
    anchored = find_batch_coupling(Wrapped(lambda y: y - y[:1]), inputs, target, default_loss)
    assert anchored.across_samples is not None and anchored.across_samples.startswith("the output of samples 3-5 ")


def test_outputs_without_the_batch_first_are_left_to_the_loss() -> None:
    # a learned scale returned as a scalar, an LSTM's hidden state (layers, batch, features): not flagged
    inputs, target = batch()
    scalar = Wrapped(lambda y: {"logits": y, "scale": y.new_ones(()), "hidden": y.T.unsqueeze(0)})
    assert find_batch_coupling(scalar, inputs, target, logits) == BatchCoupling()


def test_a_loss_summed_over_the_samples_is_found() -> None:
    inputs, target = batch()
    with torch.no_grad():
        whole = float(F.cross_entropy(mlp().eval()(*inputs), target, reduction="sum"))
    found = find_batch_coupling(mlp(), inputs, target,
                                lambda output, labels: F.cross_entropy(output, labels, reduction="sum"))
    # the halves' sums average to half the batch's sum
    assert found.across_samples == (f"the loss of the batch of 6 ({whole:.6g}) is not the mean of its two halves' "
                                    f"losses weighted by their samples ({whole / 2:.6g}; 50.00% apart)")


def test_each_modules_mode_comes_back_through_its_own_train_and_the_random_state_too() -> None:
    model = nn.Sequential(Merging(), nn.Dropout(0.1), nn.Linear(3, 3)).train()
    model[1].eval()
    weight = model[0].weight.detach().clone()
    inputs, target = batch()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert find_batch_coupling(model, inputs, target, default_loss) == BatchCoupling()
    assert torch.equal(torch.rand(3), expected)
    assert [module.training for module in model] == [True, False, True] and model.training
    assert not model[0].merged and torch.equal(model[0].weight, weight)  # eval() merged it, train() took it out


def test_what_cannot_be_checked_says_why() -> None:
    torch.manual_seed(1)
    norm = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).train()
    one = find_batch_coupling(norm, *batch(1), default_loss)
    assert one == BatchCoupling(("1",), None, "a batch of 1 sample cannot be halved")
    fixed = find_batch_coupling(Wrapped(lambda y: y.view(6, 3)), *batch(), default_loss)
    assert fixed.across_samples is None
    assert fixed.unchecked.startswith("the model or loss raised RuntimeError on half the batch: shape '[6, 3]'")
    noisy = find_batch_coupling(Wrapped(lambda y: y + torch.randn_like(y)), *batch(), default_loss)  # samples in eval
    assert noisy == BatchCoupling((), None, "the forward draws random numbers in eval mode")
    assert noisy.notes() == ["whether the samples of a batch are independent was not checked: the forward draws "
                             "random numbers in eval mode"]
    assert noisy.notes(2, 4) == []  # a plan says what differs, not what was not checked


def test_notes_say_what_a_plan_changes() -> None:
    coupling = BatchCoupling(("bn1", "layer1.bn1", "layer1.bn2", "fc.bn"), "the output has shape (8, 8)")
    general, plan = coupling.notes(), coupling.notes(2, 4)
    assert general[0] == ("batch norm (4 modules: bn1, layer1.bn1, layer1.bn2, ...) normalises each microbatch with "
                          "that microbatch's statistics, and moves running statistics once per microbatch: training "
                          "differs from plain PyTorch on the whole batch")
    assert plan[0].endswith("normalises each microbatch of 2 samples with that microbatch's statistics, and moves "
                            "running statistics once per microbatch: training differs from plain PyTorch on batches "
                            "of 8")
    assert plan[1] == ("the samples of a batch are not independent (the output has shape (8, 8)): a pipeline "
                       "computes that over each microbatch of 2 samples, so training differs from plain PyTorch on "
                       "batches of 8")
    assert coupling.notes(2, None)[1].endswith("so training differs from plain PyTorch")  # a step per microbatch
    assert coupling.notes(8, 1) == []  # the batch is not cut: nothing changes


@pytest.mark.parametrize("padded", [False, True])
def test_a_token_mean_with_padding_left_out_is_reported_as_weighing_microbatches_otherwise(padded: bool) -> None:
    # a pipeline weighs each microbatch's loss by its samples; a mean over the tokens left after padding weighs the
    # batch's tokens: equal only where every sample has as many
    torch.manual_seed(0)
    tokens = torch.randn(6, 5, 4)
    labels = torch.randint(0, 3, (6, 5))
    if padded:
        labels[0, 2:] = -100
    found = find_batch_coupling(Wrapped(lambda y: y), (tokens,), labels,
                                lambda output, target: F.cross_entropy(output.reshape(-1, 3), target.reshape(-1)))
    assert (found.across_samples is not None) == padded
    if padded:
        assert "is not the mean of its two halves' losses weighted by their samples" in found.across_samples


@gpu_only
@pytest.mark.parametrize("path", [EXAMPLES / f"{name}.py" for name in ("mlp", "gpt", "llama", "resnet", "vgg")]
                         + [BENCHMARK_MODELS / "whisper.py"], ids=lambda path: path.stem)
def test_on_the_gpu_independent_samples_are_not_flagged_at_its_precision(path: Path) -> None:
    """On CUDA a batch and its halves run other kernels (convolutions in TF32 by default, matrix products picked per
    shape): rounding alone must not read as samples that mix; the batch norms are still named."""
    model_file = load_model_file(path)
    torch.manual_seed(0)
    model = model_file.build_model().cuda().train()
    inputs, target = map_tensors(lambda t: t.cuda(), model_file.example_batch(8))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    found = find_batch_coupling(model, inputs, target, model_file.loss_fn or default_loss)
    assert (found.across_samples, found.unchecked) == (None, None)
    assert bool(found.batch_norm) == (path.stem == "resnet")
    assert all(module.training for module in model.modules())
