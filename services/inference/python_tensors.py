"""Tensors and config helpers of ``triton_python_backend_utils`` (re-exported there).

A python model's ``Tensor`` is a named numpy array; the helpers find tensors
and config entries by name and convert Triton's type names to numpy's, as
Triton's own module does.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from shared.tensors import CONFIG_TO_V2, DATATYPES, deserialize_bytes, serialize_bytes


class _HasInputs(Protocol):
    """A request (``python_utils.InferenceRequest``), as far as lookups need it."""

    def inputs(self) -> list[Tensor]: ...


class _HasOutputs(Protocol):
    """A response (``python_utils.InferenceResponse``), as far as lookups need it."""

    def output_tensors(self) -> list[Tensor]: ...


class Tensor:
    """A named tensor over a numpy array."""

    def __init__(self, name: str, data: Any) -> None:
        if isinstance(name, bytes):
            name = name.decode()
        self._name = str(name)
        self._array = np.asarray(data)

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The data (BYTES tensors: an object array of ``bytes``)."""
        return self._array

    def shape(self) -> list[int]:
        """The dimensions."""
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        """Tensors here live in host memory."""
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule sharing the data (for torch.from_dlpack and friends)."""
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor over a DLPack-capable object (a torch tensor) or capsule."""
        if hasattr(capsule, "__dlpack__"):
            return Tensor(name, np.from_dlpack(capsule))
        import torch.utils.dlpack

        return Tensor(name, torch.utils.dlpack.from_dlpack(capsule).numpy())


def get_input_tensor_by_name(request: _HasInputs, name: str) -> Tensor | None:
    """The input called ``name``, or None."""
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: _HasOutputs, name: str) -> Tensor | None:
    """The output called ``name``, or None."""
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The config entry of an input (``model_config`` as parsed from args)."""
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The config entry of an output."""
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    """True when the config asks for decoupled responses."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_string_to_numpy(data_type: str) -> Any:
    """``TYPE_FP32`` -> numpy dtype (``TYPE_STRING`` -> object)."""
    return DATATYPES[CONFIG_TO_V2[data_type]].type


_TYPE_ORDER = [name for name in CONFIG_TO_V2 if name != "TYPE_BF16"]
"""Triton's DataType enum values 1..13 in order (TYPE_BOOL = 1 ... TYPE_STRING = 13)."""


def triton_to_numpy_type(data_type: int) -> Any:
    """Triton's DataType enum value -> numpy type."""
    if not 1 <= data_type <= len(_TYPE_ORDER):
        return None
    return triton_string_to_numpy(_TYPE_ORDER[data_type - 1])


def numpy_to_triton_type(data_type: Any) -> int | None:
    """numpy type -> Triton's DataType enum value."""
    if data_type in (np.object_, np.bytes_):
        return _TYPE_ORDER.index("TYPE_STRING") + 1
    for index, name in enumerate(_TYPE_ORDER):
        if name != "TYPE_STRING" and np.dtype(data_type) == np.dtype(triton_string_to_numpy(name)):
            return index + 1
    return None


def serialize_byte_tensor(array: np.ndarray) -> np.ndarray | None:
    """BYTES elements as Triton's length-prefixed buffer (a uint8 array)."""
    if array.size == 0:
        return None
    return np.frombuffer(serialize_bytes(array), dtype=np.uint8)


def deserialize_bytes_tensor(encoded: bytes) -> np.ndarray:
    """Triton's length-prefixed buffer -> an object array of ``bytes``."""
    count, offset = 0, 0
    while offset + 4 <= len(encoded):
        offset += 4 + int.from_bytes(encoded[offset : offset + 4], "little")
        count += 1
    return deserialize_bytes("bytes tensor", bytes(encoded), count)
