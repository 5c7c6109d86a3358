"""The helper API a ``python``-backend model imports.

It offers the names Triton's Python backend models use (``Tensor``,
``InferenceRequest``, ``InferenceResponse``, ``TritonError``,
``get_input_tensor_by_name``...), so such a model runs here unmodified: the
backend makes this module importable as ``triton_python_backend_utils``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from shared.tensors import CONFIG_TO_V2, DATATYPES


class TritonError(Exception):
    """An error a model returns for one request (becomes INVALID_ARGUMENT)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self._message = message
        self.code = code

    def message(self) -> str:
        """The error text."""
        return self._message


class Tensor:
    """A named numpy tensor."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The data."""
        return self._array


class InferenceRequest:
    """One request as a python model sees it."""

    def __init__(
        self,
        inputs: list[Tensor],
        requested_output_names: list[str],
        request_id: str = "",
        parameters: dict[str, Any] | None = None,
    ) -> None:
        self._inputs = inputs
        self._requested = requested_output_names
        self._id = request_id
        self._parameters = parameters or {}

    def inputs(self) -> list[Tensor]:
        """Every input tensor."""
        return self._inputs

    def requested_output_names(self) -> list[str]:
        """Outputs the caller asked for (empty: all)."""
        return self._requested

    def request_id(self) -> str:
        """The caller's request id."""
        return self._id

    def parameters(self) -> str:
        """Request parameters as a JSON string."""
        return json.dumps(self._parameters)


class InferenceResponse:
    """The outputs of one request, or its error."""

    def __init__(
        self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None
    ) -> None:
        self._outputs = output_tensors or []
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        """Every output tensor."""
        return self._outputs

    def has_error(self) -> bool:
        """True when the model reported an error for this request."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, if any."""
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    """The input called ``name``, or None."""
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    """The output called ``name``, or None."""
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The config entry of an input (``model_config`` as parsed from args)."""
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The config entry of an output."""
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def triton_string_to_numpy(data_type: str) -> Any:
    """``TYPE_FP32`` -> numpy dtype (``TYPE_STRING`` -> object)."""
    return DATATYPES[CONFIG_TO_V2[data_type]].type
