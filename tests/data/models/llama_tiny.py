"""A tiny transformers Llama (rotary tables as buffers, untied head, grouped-query attention) as a model file, for
the tests, written as a transformers user writes one first: the model itself (its forward returns a `ModelOutput`,
with a generation cache by default), no wrapper and no loss_fn (the default loss reads the output's `logits`), its
inputs by name as a tokenizer gives them."""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96
CONTEXT = 12
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=False)


def build_model() -> nn.Module:
    """The model with transformers' random initialisation."""
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def example_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A tokenizer's inputs by name, random token ids and an attention mask hiding the last 2 positions of every
    other sample (padding), and next-token targets, (batch_size, CONTEXT) each."""
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    mask = torch.ones(batch_size, CONTEXT, dtype=torch.long)
    mask[::2, -2:] = 0
    return {"input_ids": tokens[:, :-1], "attention_mask": mask}, tokens[:, 1:]
