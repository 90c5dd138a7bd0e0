"""A multi-layer perceptron as an nn.Sequential: the simplest model the planner splits."""

import torch
from torch import nn

IN_FEATURES = 512
HIDDEN = 1024
CLASSES = 10
HIDDEN_LAYERS = 6


def build_model() -> nn.Module:
    """Linear -> ReLU blocks of width HIDDEN, then a classifier."""
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU()]
    for _ in range(HIDDEN_LAYERS - 1):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    layers.append(nn.Linear(HIDDEN, CLASSES))
    return nn.Sequential(*layers)


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random features and class labels (the default loss is then cross entropy)."""
    return torch.randn(batch_size, IN_FEATURES), torch.randint(0, CLASSES, (batch_size,))
