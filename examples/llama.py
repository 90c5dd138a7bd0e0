"""A Llama from the `transformers` library, built from a small config (no weights downloaded): copy it for your own model.

The model-file contract (see `planner.profiling.model_file`): `build_model()`, `example_batch(batch_size)`
and, here, `data_loader`. The model is returned as it is: its generation cache is turned off for
training, and the default loss (cross entropy) reads its output's `logits`. Its inputs are given by
name, as a tokenizer gives them (`model(**inputs)`), and the target apart: the next tokens, as the
default loss compares position with position. torch.fx cannot trace a transformers model, so the
runtime splits it with torch.export at the example microbatch's shapes: train with batches shaped
like `example_batch`'s.
"""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 2048
CONTEXT = 64
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
)


def build_model() -> nn.Module:
    """The model, with transformers' own random initialisation (seeded by the caller)."""
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _named(tokens: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Token sequences one longer than the context as (inputs by name, next-token targets)."""
    return {"input_ids": tokens[..., :-1]}, tokens[..., 1:]


def example_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random token ids and their next-token targets, (batch_size, CONTEXT) each. No attention mask: no sequence
    is padded (a mask would be a tensor every stage keeps and sends, where the model's causal attention needs none)."""
    return _named(torch.randint(0, VOCAB, (batch_size, CONTEXT + 1)))


def data_loader(batch_size: int) -> torch.utils.data.DataLoader:
    """A seeded stream of synthetic token sequences (every rank sees the same batches in the same order); the
    loader's default collation stacks the samples' dicts into the batch's."""
    generator = torch.Generator().manual_seed(0)
    samples = [_named(sequence) for sequence in torch.randint(0, VOCAB, (64 * batch_size, CONTEXT + 1),
                                                               generator=generator)]
    return torch.utils.data.DataLoader(samples, batch_size=batch_size, shuffle=True, drop_last=True,
                                       generator=torch.Generator().manual_seed(1))
