"""A multi-layer perceptron as an nn.Sequential: the simplest model the planner splits."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IN_FEATURES = 512
HIDDEN = 1024
CLASSES = 10
HIDDEN_LAYERS = 6
SAMPLES = 2048  # in data_loader's dataset


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



def data_loader(batch_size: int) -> DataLoader:
    """A fixed synthetic dataset of SAMPLES feature vectors labelled by a random linear teacher, shuffled
    each epoch by a seeded generator: every rank gets the same batches in the same order."""
    data = torch.Generator().manual_seed(1234)
    features = torch.randn(SAMPLES, IN_FEATURES, generator=data)
    labels = (features @ torch.randn(IN_FEATURES, CLASSES, generator=data)).argmax(dim=1)
    return DataLoader(TensorDataset(features, labels), batch_size=batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(0))
