"""A test model that checkpoints its own blocks, shared by the layer finder's and the stage runner's tests."""

from __future__ import annotations

import torch
from torch import nn


class CheckpointedBlocks(nn.Module):
    """Linear 4 -> 8, `count` Sequential blocks the forward checkpoints (torch's reentrant variant or not),
    linear 8 -> `outputs`."""

    def __init__(self, reentrant: bool, count: int = 2, outputs: int = 3) -> None:
        super().__init__()
        self.embed, self.head, self.reentrant = nn.Linear(4, 8), nn.Linear(8, outputs), reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)
