"""The ``image_preprocess`` backend: encoded images (IMAGE) -> float32 pixels (PIXELS).

Each element of ``IMAGE`` (TYPE_STRING, dims [ 1 ]) is decoded and transformed by
``transform.preprocess`` in the instance's thread; ``PIXELS`` (TYPE_FP32, dims
[ 3, crop, crop ]) has the input's shape with its last dim replaced by the image.
An undecodable image fails only its own request, naming the element.

Config parameters: ``resize`` (short side, default 256), ``crop`` (default 224),
``mean`` and ``std`` (three comma-separated floats each, ImageNet's by default).
"""

from __future__ import annotations

import numpy as np

from inference import model_config_pb2 as mc
from services.preprocess.transform import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TransformConfig,
    preprocess,
)
from shared.backend import InstanceSpec, ModelSpec, parameter
from shared.errors import ConfigError, InvalidArgument
from shared.request import InferRequest, InferResponse

IMAGE = "IMAGE"
PIXELS = "PIXELS"


def transform_config(spec: ModelSpec) -> TransformConfig:
    """The transform from the config parameters; a bad value is a ConfigError naming it."""
    try:
        resize = parameter(spec, "resize", 256, int)
        crop = parameter(spec, "crop", 224, int)
        mean = _triple(spec, "mean", IMAGENET_MEAN)
        std = _triple(spec, "std", IMAGENET_STD)
        return TransformConfig(resize_short_side=resize, crop_size=crop, mean=mean, std=std)
    except (InvalidArgument, ValueError) as exc:
        raise ConfigError(f"model '{spec.name}': {exc}") from exc


def _triple(
    spec: ModelSpec, key: str, default: tuple[float, float, float]
) -> tuple[float, float, float]:
    raw = spec.parameters.get(key, "")
    if not raw.strip():
        return default
    try:
        values = tuple(float(part) for part in raw.split(","))
    except ValueError as exc:
        raise ValueError(f"parameter '{key}' = {raw!r}: {exc}") from exc
    if len(values) != 3:
        raise ValueError(f"parameter '{key}' = {raw!r} needs 3 comma-separated values (R,G,B)")
    return values[0], values[1], values[2]


def _check_tensors(spec: ModelSpec, crop: int) -> None:
    where = f"model '{spec.name}'"
    inputs = {tensor.name: tensor for tensor in spec.config.input}
    outputs = {tensor.name: tensor for tensor in spec.config.output}
    image, pixels = inputs.get(IMAGE), outputs.get(PIXELS)
    if len(inputs) != 1 or image is None or image.data_type != mc.TYPE_STRING:
        raise ConfigError(f"{where}: declare one input 'IMAGE' of TYPE_STRING, dims [ 1 ]")
    if list(image.dims) != [1]:
        raise ConfigError(f"{where}: input 'IMAGE' must have dims [ 1 ]")
    if len(outputs) != 1 or pixels is None or pixels.data_type != mc.TYPE_FP32:
        raise ConfigError(f"{where}: declare one output 'PIXELS' of TYPE_FP32")
    expected = [3, crop, crop]
    dims = list(pixels.dims)
    if len(dims) != 3 or any(d not in (-1, e) for d, e in zip(dims, expected, strict=True)):
        raise ConfigError(
            f"{where}: output 'PIXELS' dims {dims} do not match the crop: expected {expected}"
        )


class ImagePreprocessInstance:
    """Decodes and transforms images; holds nothing but its settings."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self.spec = spec
        self.transform = transform_config(spec)
        _check_tensors(spec, self.transform.crop_size)

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Each request on its own: one bad image fails only the request that sent it."""
        return [self._one(request) for request in requests]

    def _one(self, request: InferRequest) -> InferResponse | Exception:
        images = request.inputs[IMAGE]
        crop = self.transform.crop_size
        pixels = np.empty((images.size, 3, crop, crop), dtype=np.float32)
        for index, data in enumerate(images.reshape(-1)):
            try:
                pixels[index] = preprocess(bytes(data), self.transform)
            except InvalidArgument as exc:
                return InvalidArgument(f"model '{self.spec.name}': {IMAGE}[{index}]: {exc}")
        return InferResponse(outputs={PIXELS: pixels.reshape(*images.shape[:-1], 3, crop, crop)})

    def close(self) -> None:
        """Nothing to release."""


class ImagePreprocessBackend:
    """Creates ImagePreprocessInstance objects."""

    name = "image_preprocess"

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> ImagePreprocessInstance:
        """Read and check the settings (in the instance's own thread)."""
        return ImagePreprocessInstance(model, instance)
