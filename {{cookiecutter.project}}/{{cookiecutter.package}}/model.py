"""Models. `conf/model/*.yaml` names one of these (or any nn.Module) as its `_target_`.

All use only ops with deterministic CUDA kernels, so `deterministic=true` keeps a resume bit-exact on a GPU too:
global pooling is a mean over H and W, not `nn.AdaptiveAvgPool2d`, whose CUDA backward has no deterministic
kernel (pytorch/pytorch#149130).
"""

from __future__ import annotations

{% if cookiecutter.with_fsdp == "yes" %}import math

{% endif %}
import torch
import torchvision
from torch import nn
{% if cookiecutter.with_fsdp == "yes" %}
from torch.nn import init
from torchvision.models.vision_transformer import MLPBlock, VisionTransformer
{% endif %}


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
        widths, layers = [width, 2 * width, 4 * width, 4 * width], []
        for c_in, c_out in zip([in_channels, *widths], widths):
            layers += [conv_block(c_in, c_out), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers[:-1], GlobalAvgPool())  # the last block pooled globally, not halved
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def resnet18(num_classes: int) -> nn.Module:
    """torchvision's ResNet-18, randomly initialised (no weights are downloaded), its pooling a plain mean."""
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.avgpool = GlobalAvgPool()  # (N, C): torchvision's flatten after it changes nothing
    return model


{% if cookiecutter.with_fsdp == "yes" %}
class ViT(VisionTransformer):
    """torchvision's VisionTransformer, sized by conf/model/vit.yaml. Its `shard_modules` names its encoder block:
    under parallel=fsdp with shard_modules=null, each block is its own FSDP unit."""

    shard_modules = ["torchvision.models.vision_transformer.EncoderBlock"]

    def init_weights(self) -> None:
        """torchvision's own initialisation of the tensors its constructors set outside any reset_parameters(), the
        same distributions: for parallel=fsdp, which builds the model on the meta device (engine/fsdp.py)."""
        conv = self.conv_proj
        init.trunc_normal_(conv.weight, std=math.sqrt(1 / (conv.in_channels * math.prod(conv.kernel_size))))
        init.zeros_(conv.bias)
        init.zeros_(self.class_token)
        init.normal_(self.encoder.pos_embedding, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.MultiheadAttention):
                init.xavier_uniform_(module.in_proj_weight)
                init.zeros_(module.in_proj_bias)
                init.zeros_(module.out_proj.bias)
            elif isinstance(module, MLPBlock):
                for linear in (m for m in module.modules() if isinstance(m, nn.Linear)):
                    init.xavier_uniform_(linear.weight)
                    init.normal_(linear.bias, std=1e-6)
        init.zeros_(self.heads.head.weight)
        init.zeros_(self.heads.head.bias)


{% endif %}
class UNet(nn.Module):
    """A small U-Net: `levels` resolutions, each two conv blocks, widths doubling per level; (N, C, H, W) in,
    (N, num_classes, H, W) logits out. H and W must be multiples of 2 ** (levels - 1).

    The decoder upsamples with `nn.ConvTranspose2d`, not bilinear interpolation: bilinear upsampling's CUDA
    backward has no deterministic kernel, so `deterministic=true` (needed for a bit-exact resume) would refuse it.
    """

    def __init__(self, num_classes: int, width: int = 16, levels: int = 4, in_channels: int = 3):
        super().__init__()
        widths = [width * 2**i for i in range(levels)]
        pairs = zip([in_channels, *widths], widths)
        self.down = nn.ModuleList(nn.Sequential(conv_block(a, b), conv_block(b, b)) for a, b in pairs)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(nn.ConvTranspose2d(c, c // 2, 2, stride=2) for c in reversed(widths[1:]))
        self.merge = nn.ModuleList(
            nn.Sequential(conv_block(c, c // 2), conv_block(c // 2, c // 2)) for c in reversed(widths[1:])
        )
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 2 ** (len(self.down) - 1)
        if x.shape[-2] % scale or x.shape[-1] % scale:
            raise ValueError(
                f"UNet with {len(self.down)} levels takes sides that are multiples of {scale}, got "
                f"{x.shape[-2]}x{x.shape[-1]}: change data.image_size or model.levels"
            )
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips[:-1])):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.head(x)
