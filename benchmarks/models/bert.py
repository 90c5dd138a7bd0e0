"""A transformers BERT for masked-token logits (4 layers, width 128, an attention mask that hides each sequence's
last 4 tokens; dropout 0), built from a config as a user writes a model file."""

import torch
import torch.nn.functional as F
import transformers
from torch import nn

VOCAB, CONTEXT, PADDED = 1024, 32, 4


class Bert(nn.Module):
    """BertForMaskedLM of a small config, returning its logits (batch, context, vocab)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                         intermediate_size=256, max_position_embeddings=CONTEXT, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        self.bert = transformers.BertForMaskedLM(config)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=tokens, attention_mask=mask).logits


def build_model() -> nn.Module:
    return Bert()


def example_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(tokens, attention mask) and a target token per position."""
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT))
    mask = torch.ones(batch_size, CONTEXT, dtype=torch.long)
    mask[:, -PADDED:] = 0
    return (tokens, mask), torch.randint(0, VOCAB, (batch_size, CONTEXT))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
