"""A transformers ViT image classifier (4 layers, width 128, 32x32 images in 8x8 patches, 10 classes; dropout 0),
built from a config as a user writes a model file."""

import torch
import torch.nn.functional as F
import transformers
from torch import nn

IMAGE, CLASSES = 32, 10


class Vit(nn.Module):
    """ViTForImageClassification of a small config, returning its logits (batch, classes)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=128,
                                        num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                                        num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.vit = transformers.ViTForImageClassification(config)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=images).logits


def build_model() -> nn.Module:
    return Vit()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and a class each."""
    return torch.randn(batch_size, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)
