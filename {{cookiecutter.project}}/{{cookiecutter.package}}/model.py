"""Models. `conf/model/*.yaml` names one of these (or any nn.Module) as its `_target_`.

Both use only ops with deterministic CUDA kernels, so `deterministic=true` keeps a resume bit-exact on a GPU too:
global pooling is a mean over H and W, not `nn.AdaptiveAvgPool2d`, whose CUDA backward has no deterministic
kernel (pytorch/pytorch#149130).
"""

from __future__ import annotations

import torch
from torch import nn


class GlobalAvgPool(nn.Module):
    """(N, C, H, W) -> (N, C): the mean over H and W; its backward is deterministic on every device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


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
            GlobalAvgPool(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def resnet18(num_classes: int) -> nn.Module:
    """torchvision's ResNet-18, randomly initialised (no weights are downloaded), its pooling a plain mean."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(weights=None, num_classes=num_classes)
    model.avgpool = KeepDims(GlobalAvgPool())  # torchvision flattens after avgpool: keep (N, C, 1, 1) for it
    return model


class KeepDims(nn.Module):
    """`inner`'s (N, C) output as (N, C, 1, 1), where the surrounding code expects a pooled map."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[:, :, None, None]
