"""Models. `conf/model/*.yaml` names one of these (or any nn.Module) as its `_target_`."""

from __future__ import annotations

import torch
from torch import nn


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    """Four conv blocks and global average pooling: any input of at least 16x16 pixels works."""

    def __init__(self, num_classes: int, width: int = 32, in_channels: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            conv_block(in_channels, width),
            nn.MaxPool2d(2),
            conv_block(width, 2 * width),
            nn.MaxPool2d(2),
            conv_block(2 * width, 4 * width),
            nn.MaxPool2d(2),
            conv_block(4 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def resnet18(num_classes: int) -> nn.Module:
    """torchvision's ResNet-18, randomly initialised (no weights are downloaded)."""
    from torchvision.models import resnet18 as tv_resnet18

    return tv_resnet18(weights=None, num_classes=num_classes)
