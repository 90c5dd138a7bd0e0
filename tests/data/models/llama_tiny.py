"""A tiny transformers Llama (rotary tables as buffers, untied head, grouped-query attention) as a model file, for the tests."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96
CONTEXT = 12
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=False)


class CausalLM(nn.Module):
    """Llama returning next-token logits (batch, steps, vocab)."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = LlamaForCausalLM(LlamaConfig(**CONFIG))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=input_ids, use_cache=False).logits


def build_model() -> nn.Module:
    """The model with transformers' random initialisation."""
    return CausalLM()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets, (batch_size, CONTEXT) each."""
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
