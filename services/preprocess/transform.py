"""Image bytes -> normalised float32 CHW tensor, the ImageNet evaluation transform.

Pure numpy + Pillow, no gRPC: the preprocess service's backend calls this from
an executor. The steps follow torchvision's ``Resize(256)``, ``CenterCrop(224)``,
``ToTensor()``, ``Normalize(mean, std)`` on PIL images, including its rounding
of sizes and crop offsets, because the checkpoint's accuracy was measured with
that pipeline.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps

from shared.errors import InvalidArgument

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class TransformConfig:
    """Sizes and statistics of the transform; the defaults are ImageNet's."""

    resize_short_side: int = 256
    """Pixels of the shorter side after the bilinear resize; 1..4096."""
    crop_size: int = 224
    """Side of the square centre crop; 1..resize_short_side."""
    mean: tuple[float, float, float] = IMAGENET_MEAN
    """Per-channel (R, G, B) mean subtracted from pixels scaled to [0, 1]."""
    std: tuple[float, float, float] = IMAGENET_STD
    """Per-channel (R, G, B) standard deviation, each > 0."""
    max_pixels: int = 64_000_000
    """Largest width x height accepted, checked before decoding (decompression bombs)."""

    def __post_init__(self) -> None:
        if not 1 <= self.resize_short_side <= 4096:
            raise ValueError(f"resize_short_side must be in 1..4096, got {self.resize_short_side}")
        if not 1 <= self.crop_size <= self.resize_short_side:
            raise ValueError(
                f"crop_size must be in 1..resize_short_side ({self.resize_short_side}), "
                f"got {self.crop_size}"
            )
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError("mean and std need 3 values each, and std values must be > 0")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")


DEFAULT_CONFIG = TransformConfig()


def preprocess(data: bytes, config: TransformConfig = DEFAULT_CONFIG) -> npt.NDArray[np.float32]:
    """Encoded image bytes (JPEG, PNG, WebP, ...) -> float32 ``[3, crop, crop]``."""
    image = decode_rgb(data, config.max_pixels)
    image = resize_short_side(image, config.resize_short_side)
    image = center_crop(image, config.crop_size)
    return normalize(image, config.mean, config.std)


def decode_rgb(data: bytes, max_pixels: int = DEFAULT_CONFIG.max_pixels) -> Image.Image:
    """Decode bytes to an upright RGB image; InvalidArgument for anything undecodable."""
    image = _open_checked(data, max_pixels)
    try:
        image.load()  # open() is lazy: truncated or corrupt pixel data fails only here
        # Phones store rotation in EXIF instead of rotating pixels; users expect it
        # applied. In place: otherwise an upright image is copied whole.
        ImageOps.exif_transpose(image, in_place=True)
    except _DECODE_ERRORS as exc:
        raise _undecodable(data, exc) from exc
    if image.mode == "RGB":
        return image  # convert() would copy it
    # convert() handles palette, grayscale, CMYK and alpha (alpha is dropped).
    return image.convert("RGB")


# Pillow reports corrupt or unknown data as any of these, depending on the codec.
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def _open_checked(data: bytes, max_pixels: int) -> Image.Image:
    """Read the header only and refuse images over ``max_pixels`` before decoding them."""
    try:
        # Pillow warns on huge images while opening; make that an error we can map.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (*_DECODE_ERRORS, Image.DecompressionBombWarning) as exc:
        raise _undecodable(data, exc) from exc
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidArgument(
            f"image is {width}x{height} pixels; at most {max_pixels} pixels are accepted"
        )
    return image


def _undecodable(data: bytes, exc: BaseException) -> InvalidArgument:
    return InvalidArgument(
        f"image bytes could not be decoded as JPEG, PNG or WebP ({len(data)} bytes): {exc}"
    )


def resize_short_side(image: Image.Image, size: int) -> Image.Image:
    """Bilinear resize so the shorter side is ``size``, keeping the aspect ratio."""
    width, height = image.size
    short, long = min(width, height), max(width, height)
    if short == size:
        return image
    # int() truncation, as torchvision computes the long side.
    new_long = int(size * long / short)
    new_size = (size, new_long) if width <= height else (new_long, size)
    return image.resize(new_size, Image.Resampling.BILINEAR)


def center_crop(image: Image.Image, size: int) -> Image.Image:
    """The centred ``size`` x ``size`` square; offsets rounded as torchvision rounds them."""
    width, height = image.size
    left = round((width - size) / 2.0)
    top = round((height - size) / 2.0)
    return image.crop((left, top, left + size, top + size))


def normalize(
    image: Image.Image, mean: tuple[float, ...], std: tuple[float, ...]
) -> npt.NDArray[np.float32]:
    """RGB pixels -> ``(x / 255 - mean) / std`` as contiguous float32 CHW."""
    pixels = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    pixels -= np.asarray(mean, dtype=np.float32)
    pixels /= np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))
