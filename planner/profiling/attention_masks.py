"""Attention masks a batch gives without padding (all ones), which transformers' models run the same without."""

from __future__ import annotations

import inspect

import torch
from torch import nn

MASK_SUFFIX = "attention_mask"  # transformers' names: attention_mask, decoder_attention_mask, encoder_attention_mask


def masks_without_padding(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[str, ...]:
    """The names of `inputs` (passed as `model(*inputs)`, named by the forward's positional arguments) that end in
    "attention_mask" and hold only ones: no padding to mask. transformers reads a missing mask as that. Its SDPA
    attention drops such a mask in eager mode (so a profile does not see it), while a split stage, which cannot look
    at the values, keeps it with its layers and sends it on, and on a GPU attention cannot use the flash kernel."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature to read
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [parameter.name for parameter in parameters if parameter.kind in positional]
    return tuple(name for name, tensor in zip(names, inputs)
                 if name.endswith(MASK_SUFFIX) and tensor.numel() and bool((tensor == 1).all()))
