"""Whether a model computes across the samples of a batch, which a pipeline's microbatches change.

A pipeline runs each microbatch through the model on its own and sums the gradients of the microbatches'
losses, each scaled by its share of the batch's samples. That equals plain training on the whole batch only when
every sample's output depends on that sample alone and the loss of the batch is the mean of its samples' losses.
Two ways a model breaks it, found on a built model and its example batch of B >= 2 samples:

- `batch_norm`: batch norm modules (`torch.nn.modules.batchnorm._BatchNorm`: BatchNorm1d/2d/3d, SyncBatchNorm,
  the lazy ones) that normalise with the batch's statistics: those in training mode, and those without running
  statistics in any mode. In a pipeline each microbatch of b samples is normalised with its own statistics,
  and running statistics move once per microbatch.
- `across_samples`: what differs when the batch is cut in two, the model in eval mode (no dropout; batch norm on
  its running statistics), under `torch.no_grad`. With h = B // 2, for each tensor the model returns with the
  batch first: the outputs of the two halves do not have the shapes of the matching rows of the batch's (a result
  over the batch, e.g. CLIP's image-text logits of shape (B, B) against (h, h)); or their values differ (relative
  difference above the dtype's tolerance: something mixes the samples, e.g. a normalisation over the batch
  dimension); or the loss of the batch is not the mean of the two halves' losses weighted by their samples (a
  contrastive loss over the batch's pairs; a loss summed over the samples; a mean over tokens with padding left
  out, which weighs microbatches by their tokens where a pipeline weighs them by their samples). Tensors returned
  without the batch first (a scalar, an LSTM's hidden state) are left to the loss.
- `unchecked`: why `across_samples` could not be checked (None: it was): a batch of one sample, inputs without
  the batch first, a model or loss that raised on half the batch (then it cannot run smaller microbatches
  either), a forward that draws random numbers in eval mode (its halves would draw other numbers than the whole).

Apart from running the model, nothing changes: the model is put back in its modes with its own `train()` (which
some modules override, e.g. LoRA layers that merge their weights on `eval()`), and the random state is restored.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from planner.files.profile import BatchCoupling
from planner.profiling.tensors import rounding_rtol

RTOL = 1e-4  # least relative difference that counts as "differs" (fp32 kernels at two batch sizes: about 1e-6),
# or more for a lower precision (`tensors.rounding_rtol`)


def batch_norm_modules(model: nn.Module) -> tuple[str, ...]:
    """Names of the batch norm modules that normalise with the batch's statistics as the model is now."""
    return tuple(name for name, module in model.named_modules()
                 if isinstance(module, _BatchNorm) and (module.training or not module.track_running_stats))


def find_batch_coupling(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> BatchCoupling:
    """`BatchCoupling` of `model` (as its modules' modes are now) on a batch of `inputs` and `target`, each with
    the batch first."""
    norms = batch_norm_modules(model)
    batch = int(target.shape[0]) if target.dim() > 0 else 0
    if batch < 2:
        return BatchCoupling(norms, None, f"a batch of {batch} sample{'s' if batch != 1 else ''} cannot be halved")
    if any(t.dim() == 0 or t.shape[0] != batch for t in inputs):
        return BatchCoupling(norms, None, "an input does not have the batch first")
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            return BatchCoupling(norms, *_halves_differ(model, inputs, target, loss_fn, batch))
    except Exception as exc:  # a model or loss that runs only at its example's batch size
        message = " ".join(str(exc).split())[:160]
        return BatchCoupling(norms, None, f"the model or loss raised {type(exc).__name__} on half the batch: {message}")
    finally:
        _restore_modes(modes)


def _halves_differ(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], batch: int) -> tuple[str | None, str | None]:
    """(across_samples, unchecked) from the whole batch and its halves (module docstring)."""
    half = batch // 2
    parts = ((0, half), (half, batch))
    whole, drew = _forward(model, inputs)
    halves = []
    for start, stop in parts:
        output, drew_here = _forward(model, tuple(t[start:stop] for t in inputs))
        drew = drew or drew_here
        halves.append(output)
    if drew:
        return None, "the forward draws random numbers in eval mode"
    for (start, stop), output in zip(parts, halves):
        found = _outputs_differ(whole, output, batch, start, stop)
        if found is not None:
            return found, None
    whole_loss = loss_fn(whole, target)
    mean = sum((stop - start) * float(loss_fn(output, target[start:stop]))
               for (start, stop), output in zip(parts, halves)) / batch
    value = float(whole_loss)
    # as precise as the least precise of the loss and the outputs it came from (a float32 loss of bf16 logits)
    tolerance = max(rounding_rtol(tensor, RTOL) for tensor in [whole_loss, *pytree.tree_leaves(whole)]
                    if isinstance(tensor, torch.Tensor))
    if abs(value - mean) > tolerance * max(abs(value), abs(mean), 1e-12):
        apart = abs(value - mean) / max(abs(value), abs(mean))
        return (f"the loss of the batch of {batch} ({value:.6g}) is not the mean of its two halves' losses weighted by "
                f"their samples ({mean:.6g}; {apart:.2%} apart)"), None
    return None, None


def _forward(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[Any, bool]:
    """(the model on `inputs`, whether it drew random numbers), the random state left as it was."""
    cuda = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        cpu = torch.get_rng_state()
        devices = [torch.cuda.get_rng_state(index) for index in cuda]
        output = model(*inputs)
        drew = not torch.equal(torch.get_rng_state(), cpu) or any(
            not torch.equal(torch.cuda.get_rng_state(index), state) for index, state in zip(cuda, devices))
    return output, drew


def _outputs_differ(whole: Any, part: Any, batch: int, start: int, stop: int) -> str | None:
    """How the outputs of samples [start, stop) alone differ from those rows of the outputs of all `batch` samples;
    None where they agree (outputs without the batch first are not compared)."""
    whole_leaves = [(path, leaf) for path, leaf in pytree.tree_flatten_with_path(whole)[0]
                    if isinstance(leaf, torch.Tensor)]
    part_leaves = [leaf for leaf in pytree.tree_leaves(part) if isinstance(leaf, torch.Tensor)]
    size = stop - start
    for (path, big), small in zip(whole_leaves, part_leaves):
        which = "the output" if len(whole_leaves) == 1 else f"output {pytree.keystr(path)}"
        if big.dim() == 0 or big.shape[0] != batch or small.dim() != big.dim() or small.shape[0] != size:
            continue  # not batch first: the loss says whether it matters
        if small.shape[1:] != big.shape[1:]:
            if any(b == batch and s == size for b, s in zip(big.shape[1:], small.shape[1:])):
                return (f"{which} has shape {tuple(big.shape)} at a batch of {batch} and {tuple(small.shape)} at "
                        f"{size}: it is computed over the batch")
            continue
        rows = big[start:stop]
        if not (big.is_floating_point() or big.is_complex()):
            if not torch.equal(rows, small):
                return f"{which} of samples {start}-{stop - 1} changes when the other {batch - size} are left out"
            continue
        scale = max(float(big.abs().max()), 1e-12)
        difference = float((rows - small).abs().max())
        if difference > rounding_rtol(big, RTOL) * scale:
            return (f"{which} of samples {start}-{stop - 1} changes by {difference / scale:.2g} of its largest value "
                    f"when the other {batch - size} are left out")
    return None


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    """Put every module back in its mode through its own `train()`: the root's first, then (parents before
    children) each module left in another mode than it had."""
    root, mode = modes[0]
    root.train(mode)
    for module, training in modes[1:]:
        if module.training != training:
            module.train(training)
