"""benchmarks/models/gpt2.py fine-tuned: all weights frozen but the last block's and the final norm's (the embedding too)."""

import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a model file is loaded by path, not as a package
import gpt2  # noqa: E402

loss_fn = gpt2.loss_fn
example_batch = gpt2.example_batch
TRAINED = (".h.5.", ".ln_f.")  # the parameters left trainable, by name


def build_model() -> nn.Module:
    model = gpt2.CausalLM()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(any(part in name for part in TRAINED))
    return model
