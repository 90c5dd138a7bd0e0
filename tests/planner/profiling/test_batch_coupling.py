"""Batch coupling: batch norm that normalises with the batch, and outputs or losses that mix the samples, are found;
models whose samples are independent are not flagged; the model's modes and the random state are left as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.files.profile import BatchCoupling
from planner.profiling.batch_coupling import find_batch_coupling
from planner.profiling.model_file import default_loss


def batch(size: int = 6) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    return (torch.randn(size, 4),), torch.randint(0, 3, (size,))


def mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3)).train()


class Contrastive(nn.Module):
    """Each sample's similarity to every sample of the batch: logits of shape (batch, batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.embed(x)
        return z @ z.T


class Centred(nn.Module):
    """Subtracts the batch's mean: each output depends on every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y - y.mean(dim=0, keepdim=True)


class FixedBatch(nn.Module):
    """Runs only at a batch of 6 (a hard-coded view)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).view(6, 3)


def test_independent_samples_are_not_flagged_dropout_and_an_odd_batch_included() -> None:
    inputs, target = batch(5)  # halves of 2 and 3 samples: their losses weigh 2/5 and 3/5
    found = find_batch_coupling(mlp(), inputs, target, default_loss)
    assert found == BatchCoupling((), None) and found.notes() == []


def test_batch_norm_that_uses_the_batch_statistics_is_named() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3), nn.BatchNorm1d(3, affine=False))
    inputs, target = batch()
    found = find_batch_coupling(model.train(), inputs, target, default_loss)
    assert found == BatchCoupling(("1", "3"), None)  # in eval mode they use running statistics: samples independent
    model[1].eval()
    assert find_batch_coupling(model, inputs, target, default_loss).batch_norm == ("3",)
    without_running = nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 3)).eval()
    found = find_batch_coupling(without_running, inputs, target, default_loss)
    assert found.batch_norm == ("0",)  # batch statistics in every mode
    assert "changes by" in found.across_samples  # and so in the eval-mode check too


def test_an_output_over_the_batch_is_found_by_its_shape() -> None:
    inputs, _ = batch()
    found = find_batch_coupling(Contrastive(), inputs, torch.arange(6), default_loss)
    assert found.batch_norm == ()
    assert found.across_samples == "the output has shape (6, 6) at a batch of 6 and (3, 3) at 3: it is computed over the batch"


def test_an_output_mixing_the_samples_is_found_by_its_values() -> None:
    inputs, target = batch()
    found = find_batch_coupling(Centred(), inputs, target, default_loss)
    assert found.across_samples is not None
    assert found.across_samples.startswith("the output of the first 3 samples changes by ")
    assert found.across_samples.endswith("of its largest value when the other 3 are left out")


def test_a_loss_summed_over_the_samples_is_found() -> None:
    inputs, target = batch()
    with torch.no_grad():
        whole = float(F.cross_entropy(mlp().eval()(*inputs), target, reduction="sum"))
    found = find_batch_coupling(mlp(), inputs, target,
                                lambda output, labels: F.cross_entropy(output, labels, reduction="sum"))
    # the halves' sums average to half the batch's sum
    assert found.across_samples == (f"the loss of the batch of 6 ({whole:.6g}) is not the mean of its two halves' "
                                    f"losses ({whole / 2:.6g})")


def test_each_modules_mode_and_the_random_state_are_restored() -> None:
    model = mlp()
    model[2].eval()
    inputs, target = batch()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    find_batch_coupling(model, inputs, target, default_loss)
    assert torch.equal(torch.rand(3), expected)
    assert [module.training for module in model] == [True, True, False, True] and model.training


@pytest.mark.parametrize("size, model", [(1, None), (6, "fixed")])
def test_halves_are_not_checked_for_one_sample_or_a_model_fixed_to_its_batch(size: int, model: str | None) -> None:
    torch.manual_seed(1)
    net = FixedBatch() if model == "fixed" else nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    inputs, target = batch(size)
    found = find_batch_coupling(net.train(), inputs, target, default_loss)
    assert found.across_samples is None
    assert found.batch_norm == (() if model == "fixed" else ("1",))


def test_notes_say_what_a_plan_changes() -> None:
    coupling = BatchCoupling(("bn1", "layer1.bn1", "layer1.bn2", "fc.bn"), "the output has shape (8, 8)")
    general, plan = coupling.notes(), coupling.notes(2, 4)
    assert general[0] == ("batch norm in training mode (4 modules: bn1, layer1.bn1, layer1.bn2, ...) normalises each "
                          "microbatch with its own statistics and moves its running statistics once per microbatch: "
                          "training differs from plain PyTorch on the whole batch")
    assert plan[0].endswith("normalises each microbatch of 2 samples with its own statistics and moves its running "
                            "statistics once per microbatch: training differs from plain PyTorch on batches of 8")
    assert plan[1] == ("the samples of a batch are not independent (the output has shape (8, 8)): a pipeline "
                       "computes that over each microbatch of 2 samples, so training differs from plain PyTorch on "
                       "batches of 8")
    assert coupling.notes(2, None)[1].endswith("so training differs from plain PyTorch")  # a step per microbatch
