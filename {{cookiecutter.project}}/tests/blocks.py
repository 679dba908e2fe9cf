"""A model of a user's own blocks, for parallel=fsdp: `parallel.shard_modules=[tests.blocks.ResidualBlock]` makes
each block an FSDP unit. No batch statistics (LayerNorm, not BatchNorm), so another number of processes computes
the same function of the same global batch, up to the order of float sums."""

import torch
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class BlockNet(nn.Module):
    def __init__(self, num_classes: int, image_size: int, width: int = 32, blocks: int = 3):
        super().__init__()
        self.stem = nn.Linear(3 * image_size * image_size, width)
        self.blocks = nn.Sequential(*[ResidualBlock(width) for _ in range(blocks)])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x.flatten(1))))
