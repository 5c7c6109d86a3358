"""MobileNetV2 (Sandler et al., 2018), written so torchvision's checkpoint loads as is.

torchvision cannot be imported beside our CPU torch, so the architecture lives
here. Module nesting mirrors torchvision's ``mobilenet_v2`` exactly (``features``
as a Sequential of stem, 17 inverted residual blocks and a 1x1 head; each block's
layers in ``conv``; ``classifier`` as Dropout + Linear): the state_dict keys are
the contract that lets ``load_state_dict(strict=True)`` accept
``mobilenet_v2-b0353104.pth``. Only width multiplier 1.0 is supported, the one
the checkpoint was trained with.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# (expansion t, output channels c, repeats n, first stride s), from the paper's Table 2.
_BLOCK_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
_STEM_CHANNELS = 32
_HEAD_CHANNELS = 1280


class ConvBNReLU6(nn.Sequential):
    """Conv (no bias: BatchNorm supplies it) -> BatchNorm -> ReLU6; keys ``0.*``, ``1.*``."""

    def __init__(
        self, in_ch: int, out_ch: int, kernel: int = 3, stride: int = 1, groups: int = 1
    ) -> None:
        super().__init__(
            nn.Conv2d(in_ch, out_ch, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """Expand (1x1) -> depthwise (3x3) -> linear projection (1x1), residual when shapes match."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = in_ch * expand_ratio
        self.use_residual = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        # With t == 1 the expansion would be an identity 1x1 conv; the checkpoint omits it.
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(in_ch, hidden, kernel=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            # No activation after the projection: ReLU on a narrow bottleneck loses information.
            nn.Conv2d(hidden, out_ch, 1, bias=False),
            nn.BatchNorm2d(out_ch),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return x + out if self.use_residual else out


def _feature_layers() -> list[nn.Module]:
    """The stem, the inverted residual stages, and the 1x1 head, in checkpoint order."""
    layers: list[nn.Module] = [ConvBNReLU6(3, _STEM_CHANNELS, stride=2)]
    in_ch = _STEM_CHANNELS
    for expand_ratio, out_ch, repeats, first_stride in _BLOCK_SETTINGS:
        for i in range(repeats):
            stride = first_stride if i == 0 else 1
            layers.append(InvertedResidual(in_ch, out_ch, stride, expand_ratio))
            in_ch = out_ch
    layers.append(ConvBNReLU6(in_ch, _HEAD_CHANNELS, kernel=1))
    return layers


class MobileNetV2(nn.Module):
    """ImageNet classifier: float32 NCHW images (normalised, 224x224) -> class logits."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        self.features = nn.Sequential(*_feature_layers())
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(_HEAD_CHANNELS, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        # Global average pool, written shape-agnostically so traced graphs keep a dynamic batch.
        x = nn.functional.adaptive_avg_pool2d(x, 1)
        logits: torch.Tensor = self.classifier(torch.flatten(x, 1))
        return logits


def load_mobilenet_v2(weights: Path) -> MobileNetV2:
    """A MobileNetV2 in eval mode with torchvision's checkpoint loaded strictly."""
    model = MobileNetV2()
    # weights_only: a checkpoint is data; never let it run pickled code.
    state = torch.load(weights, map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()
