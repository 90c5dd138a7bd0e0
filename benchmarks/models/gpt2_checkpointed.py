"""benchmarks/models/gpt2.py with transformers' gradient checkpointing on (non-reentrant), as users short of memory do."""

import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a model file is loaded by path, not as a package
import gpt2  # noqa: E402

loss_fn = gpt2.loss_fn
example_batch = gpt2.example_batch


def build_model() -> nn.Module:
    model = gpt2.CausalLM()
    model.gpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
