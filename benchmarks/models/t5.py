"""A transformers T5 (2 encoder and 2 decoder layers, width 64; one embedding shared by both stacks and the head,
a relative position bias each stack computes once and passes on; dropout 0), built from a config as a user writes a
model file."""

import torch
import torch.nn.functional as F
import transformers
from torch import nn

VOCAB, SOURCE, TARGET = 512, 24, 12


class T5(nn.Module):
    """T5ForConditionalGeneration of a small config, returning its logits (batch, target steps, vocab); no cache."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                       num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                       pad_token_id=0, use_cache=False)
        self.t5 = transformers.T5ForConditionalGeneration(config)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=source, decoder_input_ids=target_in, use_cache=False).logits


def build_model() -> nn.Module:
    return T5()


def example_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(source tokens, decoder input tokens) and the next target tokens."""
    source = torch.randint(1, VOCAB, (batch_size, SOURCE))
    target = torch.randint(1, VOCAB, (batch_size, TARGET + 1))
    return (source, target[:, :-1]), target[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
