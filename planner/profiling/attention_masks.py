"""Attention masks a batch gives without padding (all ones), which transformers' models run the same without."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from planner.profiling.keyword_inputs import own_class

MASK_SUFFIX = "attention_mask"  # transformers' names: attention_mask, decoder_attention_mask, encoder_attention_mask


def masks_without_padding(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[str, ...]:
    """The names of `inputs` (passed as `model(*inputs)`, named by the forward's positional arguments) that end in
    "attention_mask", hold only ones (no padding to mask) and that the model's own forward can go without (a default
    value: transformers' None, read as no padding). Its SDPA attention drops such a mask in eager mode (so a
    profile does not see it), while a split stage, which cannot look at the values, keeps it with its layers and
    sends it on, and on a GPU attention cannot use the flash kernel."""
    try:
        given = inspect.signature(model.forward).parameters.values()
        own = inspect.signature(own_class(model).forward).parameters
    except (TypeError, ValueError):  # a forward without a signature to read
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [parameter.name for parameter in given if parameter.kind in positional]
    return tuple(name for name, tensor in zip(names, inputs)
                 if name.endswith(MASK_SUFFIX) and name in own and own[name].default is not inspect.Parameter.empty
                 and tensor.numel() and bool((tensor == 1).all()))
