"""A transformers GPT-2 (6 layers, width 256, context 64; tied embedding and head; dropout 0), as a user writes a model file."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 2048
CONTEXT = 64
CONFIG = dict(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=256, n_layer=6, n_head=4, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


class CausalLM(nn.Module):
    """GPT-2 returning next-token logits (batch, steps, vocab)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT2LMHeadModel(GPT2Config(**CONFIG))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=input_ids).logits


def build_model() -> nn.Module:
    return CausalLM()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
