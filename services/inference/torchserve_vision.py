"""The part of ``torchvision.transforms`` TorchServe's built-in vision handlers use.

``image_classifier``, ``image_segmenter`` and ``object_detector`` import
``torchvision.transforms`` (``Compose``, ``Resize``, ``CenterCrop``,
``ToTensor``, ``Normalize``); the PyPI torchvision wheels are CUDA builds that
cannot import beside the mesh's CPU torch. Where the real torchvision does not
import, the torchserve backend installs this module under that name, so those
handlers (and a custom handler using these five transforms) load unchanged.
The steps are the mesh's own preprocess transform (services/preprocess/
transform.py), which follows torchvision's rounding on PIL images, so the
results match torchvision's. Anything else of torchvision stays missing and
fails with ImportError naming it.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from services.preprocess.transform import center_crop, resize_short_side

log = logging.getLogger(__name__)


class Compose:
    """Apply transforms in order."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class Resize:
    """Bilinear resize of a PIL image: an int sizes the shorter side, a pair is (h, w)."""

    def __init__(self, size: int | Sequence[int], **_: Any) -> None:
        self.size = size

    def __call__(self, image: Image.Image) -> Image.Image:
        if isinstance(self.size, int):
            return resize_short_side(image, self.size)
        height, width = self.size
        return image.resize((width, height), Image.Resampling.BILINEAR)


class CenterCrop:
    """The centred square (or (h, w)) crop of a PIL image."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = size if isinstance(size, int) else int(size[0])

    def __call__(self, image: Image.Image) -> Image.Image:
        return center_crop(image, self.size)


class ToTensor:
    """PIL image -> float32 CHW tensor in [0, 1]."""

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels = np.asarray(image, dtype=np.float32) / np.float32(255.0)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


class Normalize:
    """``(x - mean) / std`` per channel of a CHW tensor."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std


def _real_torchvision() -> bool:
    try:
        importlib.import_module("torchvision.transforms")
    except Exception:  # a CUDA wheel fails with OSError, RuntimeError...
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]  # a half-imported wheel must not shadow the stand-in
        return False
    return True


def install() -> bool:
    """Make ``torchvision.transforms`` importable; True when this stand-in was installed."""
    if "torchvision" in sys.modules or _real_torchvision():
        return False
    package = types.ModuleType("torchvision")
    package.__doc__ = "meshserve's stand-in: torchvision.transforms' five PIL transforms only"
    package.__path__ = []
    transforms = types.ModuleType("torchvision.transforms")
    for cls in (Compose, Resize, CenterCrop, ToTensor, Normalize):
        setattr(transforms, cls.__name__, cls)
    package.transforms = transforms  # type: ignore[attr-defined]
    sys.modules["torchvision"] = package
    sys.modules["torchvision.transforms"] = transforms
    log.info("torchvision does not import here: TorchServe handlers get meshserve's transforms")
    return True
