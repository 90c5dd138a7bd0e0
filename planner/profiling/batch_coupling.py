"""Whether a model computes across the samples of a batch, which a pipeline's microbatches change.

A pipeline runs each microbatch through the model on its own and sums the gradients of the microbatches'
losses, each scaled by its share of the batch. That equals plain training on the whole batch only when every
sample's output depends on that sample alone and the loss of the batch is the mean of its samples' losses.
Two ways a model breaks it, found on a built model and its example batch of B >= 2 samples:

- `batch_norm`: batch norm modules (`torch.nn.modules.batchnorm._BatchNorm`: BatchNorm1d/2d/3d, SyncBatchNorm,
  the lazy ones) that normalise with the batch's statistics: those in training mode, and those without running
  statistics in any mode. In a pipeline each microbatch of b samples is normalised with its own statistics,
  and running statistics move once per microbatch.
- `across_samples`: what differs when the batch is cut in two, the model in eval mode (no dropout; batch norm on
  its running statistics) and the random state the same for each forward, under `torch.no_grad`. With h = B // 2:
  the outputs at h samples do not have the shapes of the first h rows of the outputs at B (a result over the
  batch, e.g. CLIP's image-text logits of shape (B, B)); or their values differ (relative difference above
  `RTOL`: something mixes the samples, e.g. a normalisation over the batch dimension); or the loss of the batch
  is not the mean of the two parts' losses weighted by their sizes (a contrastive loss over the batch's pairs; a
  loss summed rather than averaged over the samples).

Pure apart from running the model: every module's own training flag and the random state are restored.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from planner.files.profile import BatchCoupling

RTOL = 1e-4  # relative difference (to the largest magnitude compared) that counts as "differs"; fp32 batched
#              kernels at two batch sizes agree to about 1e-6


def batch_norm_modules(model: nn.Module) -> tuple[str, ...]:
    """Names of the batch norm modules that normalise with the batch's statistics as the model is now."""
    return tuple(name for name, module in model.named_modules()
                 if isinstance(module, _BatchNorm) and (module.training or not module.track_running_stats))


def find_batch_coupling(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> BatchCoupling:
    """`BatchCoupling` of `model` (as its modules' modes are now) on a batch of `inputs` and `target`, each with
    the batch first; `across_samples` is None, not checked, for a batch of one sample, inputs without the batch
    first, and a model or loss that raises on half the batch (it cannot run a smaller microbatch anyway)."""
    batch = int(target.shape[0]) if target.dim() > 0 else 0
    norms = batch_norm_modules(model)
    if batch < 2 or any(t.dim() == 0 or t.shape[0] != batch for t in inputs):
        return BatchCoupling(norms, None)
    half = batch // 2
    modes = {module: module.training for module in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            whole = _forward(model, inputs)
            first = _forward(model, tuple(t[:half] for t in inputs))
            second = _forward(model, tuple(t[half:] for t in inputs))
            across = _outputs_differ(whole, first, batch, half)
            if across is None:
                whole_loss = float(loss_fn(whole, target))
                parts = (half * float(loss_fn(first, target[:half]))
                         + (batch - half) * float(loss_fn(second, target[half:]))) / batch
                if abs(whole_loss - parts) > RTOL * max(abs(whole_loss), abs(parts), 1e-12):
                    across = (f"the loss of the batch of {batch} ({whole_loss:.6g}) is not the mean of its two halves' "
                              f"losses ({parts:.6g})")
    except Exception:  # a model or loss that runs only at its example's batch size: nothing to say about halves
        across = None
    finally:
        for module, training in modes.items():
            module.training = training
    return BatchCoupling(norms, across)


def _forward(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Any:
    """The model on `inputs` with the random state as it was before (each forward draws the same numbers)."""
    devices = [t.device for t in inputs if t.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        return model(*inputs)


def _outputs_differ(whole: Any, first: Any, batch: int, half: int) -> str | None:
    """How the outputs of the first `half` samples differ from the first rows of the outputs of all `batch`; None
    where they agree."""
    whole_leaves = [leaf for leaf in pytree.tree_leaves(whole) if isinstance(leaf, torch.Tensor)]
    first_leaves = [leaf for leaf in pytree.tree_leaves(first) if isinstance(leaf, torch.Tensor)]
    for index, (big, small) in enumerate(zip(whole_leaves, first_leaves)):
        which = "the output" if len(whole_leaves) == 1 else f"output {index}"
        if big.dim() == 0 or big.shape[0] != batch or small.shape != (half, *big.shape[1:]):
            return (f"{which} has shape {tuple(big.shape)} at a batch of {batch} and {tuple(small.shape)} at "
                    f"{half}: it is computed over the batch")
        if not (big.is_floating_point() or big.is_complex()):
            if not torch.equal(big[:half], small):
                return f"{which} of the first {half} samples changes when the other {batch - half} are left out"
            continue
        scale = max(float(big.abs().max()), 1e-12)
        difference = float((big[:half] - small).abs().max())
        if difference > RTOL * scale:
            return (f"{which} of the first {half} samples changes by {difference / scale:.2g} of its largest value "
                    f"when the other {batch - half} are left out")
    return None
