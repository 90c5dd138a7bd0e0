"""Tests of planner.profiling.generation_cache: a transformers model's cache off, and back on after the block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.profiling.generation_cache import generation_cache_off, turn_off_generation_cache

transformers = pytest.importorskip("transformers")


def _t5() -> nn.Module:
    """T5: its encoder and decoder stacks hold configs of their own besides the model's."""
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=32, d_model=8, d_ff=16, d_kv=4, num_layers=1, num_decoder_layers=1, num_heads=2))


def _configs(model: nn.Module) -> dict[int, bool]:
    """use_cache of each distinct config among the model's modules, by id."""
    return {id(module.config): module.config.use_cache for module in model.modules()
            if hasattr(getattr(module, "config", None), "use_cache")}


def test_every_config_that_caches_is_turned_off_once() -> None:
    model = _t5()
    before = _configs(model)
    assert any(before.values())
    changed = turn_off_generation_cache(model)
    assert len(changed) == len({id(config) for config in changed}) == sum(before.values())
    assert not any(_configs(model).values())
    assert turn_off_generation_cache(model) == []  # nothing left on


def test_the_block_gives_the_cache_back_where_it_was_on_even_when_it_raises() -> None:
    model = _t5()
    model.decoder.config.use_cache = False  # one stack off to start with: it stays off
    before = _configs(model)
    ids = torch.randint(0, 32, (1, 4))
    with pytest.raises(RuntimeError, match="inside"):
        with generation_cache_off(model):
            assert not any(_configs(model).values())
            assert model(input_ids=ids, decoder_input_ids=ids).past_key_values is None
            raise RuntimeError("inside")
    assert _configs(model) == before


def test_a_model_without_configs_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with generation_cache_off(model) as changed:
        assert changed == []
