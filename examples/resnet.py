"""A ResNet-like CNN for 32x32 images: basic residual blocks with identity and projection skips."""

import torch
from torch import nn

WIDTHS = (16, 32, 64)
BLOCKS_PER_STAGE = 2
CLASSES = 10
IMAGE_SIZE = 32


class BasicBlock(nn.Module):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + skip(x)); skip is a 1x1 conv when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.downsample is None else self.downsample(x)
        return self.relu(out + skip)


class ResNet(nn.Module):
    """stem (conv, bn, relu) -> stages of basic blocks -> global average pool -> fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, WIDTHS[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(WIDTHS[0])
        self.relu = nn.ReLU()
        stages = []
        in_channels = WIDTHS[0]
        for index, width in enumerate(WIDTHS):
            blocks = []
            for block in range(BLOCKS_PER_STAGE):
                stride = 2 if index > 0 and block == 0 else 1
                blocks.append(BasicBlock(in_channels, width, stride))
                in_channels = width
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model() -> nn.Module:
    """The ResNet-like model."""
    return ResNet()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 3x32x32 images and class labels."""
    return torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE), torch.randint(0, CLASSES, (batch_size,))
