"""A Llama from the `transformers` library, built from a small config (no weights downloaded): copy it for your own model.

The model-file contract (see `planner.profiling.model_file`): `build_model()`, `example_batch(batch_size)`
and, here, `loss_fn` and `data_loader`. A Hugging Face model returns a `ModelOutput`; the small
wrapper below returns the logits, so the pipeline's last stage hands a plain tensor to the loss.
torch.fx cannot trace a transformers model, so the runtime splits it with torch.export at the
example microbatch's shapes: train with batches shaped like `example_batch`'s.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 2048
CONTEXT = 64
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
)


class CausalLM(nn.Module):
    """A causal language model returning next-token logits (batch, steps, vocab) for token ids (batch, steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = LlamaForCausalLM(LlamaConfig(**CONFIG))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=input_ids, use_cache=False).logits


def build_model() -> nn.Module:
    """The model, with transformers' own random initialisation (seeded by the caller)."""
    return CausalLM()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets, (batch_size, CONTEXT) each."""
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def data_loader(batch_size: int) -> torch.utils.data.DataLoader:
    """A seeded stream of synthetic token sequences (every rank sees the same batches in the same order)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (64 * batch_size, CONTEXT + 1), generator=generator)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                                       generator=torch.Generator().manual_seed(1))
