"""A small transformers Whisper built from a config (no weights downloaded): log-mel features to the encoder,
tokens to the decoder, next-token logits. Its operations are tiny (width 32), so a step is mostly per-operation
overhead: the kind of model whose pipelined times on a CPU depend most on what the caches still hold."""

import torch
import torch.nn.functional as F
import transformers
from torch import nn

VOCAB, CONTEXT, MELS, FRAMES = 128, 12, 8, 32


class Whisper(nn.Module):
    """WhisperForConditionalGeneration returning its logits (no cache)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=MELS, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32,
            max_source_positions=FRAMES // 2, max_target_positions=32, pad_token_id=0, decoder_start_token_id=0,
            bos_token_id=0, eos_token_id=0, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        self.model = transformers.WhisperForConditionalGeneration(config)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_features=features, decoder_input_ids=tokens, use_cache=False).logits


def build_model() -> nn.Module:
    return Whisper()


def example_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(features, decoder tokens) and the next tokens."""
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return (torch.randn(batch_size, MELS, FRAMES), tokens[:, :-1]), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
