"""What running a model's forward for a trace or a check may change, saved and put back."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ModelState", "model_state", "restore_model_state"]


ModelState = list[tuple[nn.Module, dict[str, Any], dict[str, Any], dict[str, Any], list[tuple[torch.Tensor, int, torch.Tensor]]]]


def model_state(model: nn.Module) -> ModelState:
    """What a traced forward may change: each module's attributes, buffer and parameter slots, buffer values."""
    return [(module, dict(module.__dict__), dict(module._buffers), dict(module._parameters),
             [(buffer, buffer._version, buffer.detach().clone()) for buffer in module._buffers.values()
              if buffer is not None])
            for module in model.modules()]


def restore_model_state(saved: ModelState) -> None:
    """Undo what a forward run for tracing or checking did to the model (counters, cached sizes, statistics)."""
    for module, attributes, buffers, parameters, values in saved:
        module.__dict__.clear()
        module.__dict__.update(attributes)
        module._buffers.clear()
        module._buffers.update(buffers)
        module._parameters.clear()
        module._parameters.update(parameters)
        with torch.no_grad():
            for buffer, version, value in values:
                if buffer._version != version:
                    buffer.copy_(value)
