"""Turns off a transformers model's generation cache, which a training step never reads.

A transformers decoder with `config.use_cache` set (GPT-2, Llama, T5, ... by default) returns the keys
and values of every attention layer as a cache object for generating the next token. A training step
does not use it, yet building it copies each layer's keys and values (transformers 5: a `torch.cat`
onto an empty cache), and torch.export cannot return it (a `DynamicCache` is not tensors), so such a
model could be profiled but not split. Models read
`use_cache` from their config when the forward is not given it, so setting it False on each config
is enough; the model file's code need not change.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

__all__ = ["generation_cache_off", "turn_off_generation_cache"]


def turn_off_generation_cache(model: nn.Module) -> list[Any]:
    """Set `use_cache = False` on each distinct config of `model`'s modules where it is True; those configs."""
    configs: list[Any] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True and not any(config is seen for seen in configs):
            config.use_cache = False
            configs.append(config)
    return configs


@contextlib.contextmanager
def generation_cache_off(model: nn.Module) -> Iterator[list[Any]]:
    """`turn_off_generation_cache(model)` for the block's duration, then `use_cache = True` again where it was."""
    configs = turn_off_generation_cache(model)
    try:
        yield configs
    finally:
        for config in configs:
            config.use_cache = True
