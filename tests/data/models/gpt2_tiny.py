"""A tiny transformers GPT-2 (tied embedding and head, dropout on) as a model file, for the tests."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 96
CONTEXT = 12
CONFIG = dict(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=4, n_head=2)


class CausalLM(nn.Module):
    """GPT-2 returning next-token logits (batch, steps, vocab)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT2LMHeadModel(GPT2Config(**CONFIG))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=input_ids, use_cache=False).logits


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
