"""A model whose top-level forward branches on tensor values (and routes tokens to experts): no split can capture it."""

import torch
from torch import nn


class Routed(nn.Module):
    """Linear, a data-dependent rescale, mixture-of-experts routing, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.gate = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if x.abs().sum() > 100:  # a branch on tensor values in the forward that must be traced
            x = x / 2
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            mask = choice == index
            if mask.any():
                out[mask] = expert(x[mask])
        return self.head(out)


def build_model() -> nn.Module:
    return Routed()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 8), torch.randint(0, 3, (batch_size,))
