"""benchmarks/models/gpt2.py at width 1024, 12 layers, context 512, vocabulary 16,384: a GPU's kernels dominate."""

import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a model file is loaded by path, not as a package
import gpt2  # noqa: E402

VOCAB = 16384
CONTEXT = 512
CONFIG = {**gpt2.CONFIG, "vocab_size": VOCAB, "n_positions": CONTEXT, "n_embd": 1024, "n_layer": 12, "n_head": 16}
loss_fn = gpt2.loss_fn


def build_model() -> nn.Module:
    return gpt2.CausalLM(CONFIG)


def example_batch(batch_size: int):
    return gpt2.token_batch(batch_size, VOCAB, CONTEXT)
