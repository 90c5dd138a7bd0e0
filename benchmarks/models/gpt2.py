"""A transformers GPT-2 (6 layers, width 256, context 64; tied embedding and head; dropout 0), as a user writes a model file."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 2048
CONTEXT = 64
CONFIG = dict(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=256, n_layer=6, n_head=4, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)


class CausalLM(nn.Module):
    """GPT-2 of `config` (GPT2Config keywords) returning next-token logits (batch, steps, vocab)."""

    def __init__(self, config: dict = CONFIG) -> None:
        super().__init__()
        self.gpt = GPT2LMHeadModel(GPT2Config(**config))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=input_ids).logits


def build_model() -> nn.Module:
    return CausalLM()


def token_batch(batch_size: int, vocab: int = VOCAB, context: int = CONTEXT) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens (batch_size, context) and the same shifted by one as targets."""
    tokens = torch.randint(0, vocab, (batch_size, context + 1))
    return tokens[:, :-1], tokens[:, 1:]


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(batch_size)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
