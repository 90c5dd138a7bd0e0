"""A VGG-like CNN for 32x32 images: a features Sequential of conv blocks and a classifier."""

import torch
from torch import nn

CHANNELS = (32, 64, 128, 128)
CLASSES = 10
IMAGE_SIZE = 32


def _conv_block(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    ]


class VGG(nn.Module):
    """features (conv, relu, pool) -> flatten -> classifier (linear, relu, dropout, linear)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for channels in CHANNELS:
            layers += _conv_block(in_channels, channels)
            in_channels = channels
        self.features = nn.Sequential(*layers)
        side = IMAGE_SIZE // 2 ** len(CHANNELS)
        self.classifier = nn.Sequential(
            nn.Linear(in_channels * side * side, 256), nn.ReLU(inplace=True), nn.Dropout(0.1),
            nn.Linear(256, CLASSES),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(images), 1))


def build_model() -> nn.Module:
    """The VGG-like model."""
    return VGG()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 3x32x32 images and class labels."""
    return torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE), torch.randint(0, CLASSES, (batch_size,))
