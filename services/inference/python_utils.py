"""The helper API a ``python``-backend model imports as ``triton_python_backend_utils``.

It offers what Triton's Python backend gives its models, under the same names,
so such a model runs here unmodified:

- tensors, requests and responses (``Tensor``, ``InferenceRequest``,
  ``InferenceResponse``), errors (``TritonError`` with Triton's codes,
  ``TritonModelException``) and the config helpers
  (``get_output_config_by_name``, ``triton_string_to_numpy``...);
- decoupled responses: ``request.get_response_sender().send(response, flags)``;
- BLS: ``InferenceRequest(model_name=..., inputs=...).exec()`` /
  ``async_exec()``, with ``decoupled=True`` for a stream of responses, and the
  model-loading calls (``is_model_ready``, ``load_model``, ``unload_model``);
- ``auto_complete_config``'s ``ModelConfig``, custom metrics
  (``MetricFamily``) and ``Logger``.

BLS requests and metrics need the stage they run in: the python backend binds
this module to it (``bind``) before any model loads, as Triton binds the
module of each model's stub process to its server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from services.inference.python_config import ModelConfig, model_config_dict
from services.inference.python_metrics import Metric, MetricFamily
from services.inference.python_tensors import (
    Tensor,
    deserialize_bytes_tensor,
    get_input_config_by_name,
    get_input_tensor_by_name,
    get_output_config_by_name,
    get_output_tensor_by_name,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
    using_decoupled_model_transaction_policy,
)
from shared import errors
from shared.request import InferRequest, InferResponse

if TYPE_CHECKING:
    from services.inference.bls import ModelCaller

__all__ = [
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "Logger",
    "Metric",
    "MetricFamily",
    "ModelConfig",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "model_config_dict",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "using_decoupled_model_transaction_policy",
]

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2

log = logging.getLogger("meshserve.python_model")

_caller: ModelCaller | None = None


def bind(caller: ModelCaller | None) -> None:
    """Route this module's BLS calls through ``caller`` (the python backend does this)."""
    global _caller  # noqa: PLW0603 - the module is the API models import; it has one server
    _caller = caller


def unbind(caller: ModelCaller) -> None:
    """Forget ``caller`` if it is the bound one (its stage stopped)."""
    if _caller is caller:
        bind(None)


def _bound() -> ModelCaller:
    if _caller is None:
        raise TritonModelException("BLS requests are not available: no server is bound")
    return _caller


# --- errors -----------------------------------------------------------------------


class TritonError(Exception):
    """An error a model reports for one request; its code picks the status."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    _AS_MESH: ClassVar[dict[int, type[errors.MeshError]]] = {
        NOT_FOUND: errors.NotFound,
        INVALID_ARG: errors.InvalidArgument,
        UNAVAILABLE: errors.Unavailable,
        UNSUPPORTED: errors.Unimplemented,
        ALREADY_EXISTS: errors.FailedPrecondition,
        CANCELLED: errors.Cancelled,
    }

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = str(message)
        self._code = code

    def message(self) -> str:
        """The error text."""
        return self._message

    def code(self) -> int:
        """One of the class's codes (INTERNAL unless the model said otherwise)."""
        return self._code

    def as_mesh_error(self) -> errors.MeshError:
        """The mesh error this becomes on the wire (INTERNAL keeps the model's text)."""
        return self._AS_MESH.get(self._code, errors.ModelError)(self._message)

    @classmethod
    def from_mesh_error(cls, error: errors.MeshError) -> TritonError:
        """A failed BLS call as the model sees it."""
        codes = {mesh: code for code, mesh in cls._AS_MESH.items()}
        return cls(error.message, codes.get(type(error), cls.INTERNAL))


class TritonModelException(Exception):
    """Raised by a model: its message reaches the caller (INTERNAL)."""

    def message(self) -> str:
        """The error text."""
        return str(self)


# --- responses --------------------------------------------------------------------


class InferenceResponse:
    """The outputs of one request, or its error."""

    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = _parameters_dict(parameters, "InferenceResponse parameters")

    def output_tensors(self) -> list[Tensor]:
        """Every output tensor."""
        return self._outputs

    def has_error(self) -> bool:
        """True when the request failed."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, if any."""
        return self._error

    def parameters(self) -> str:
        """The response parameters as a JSON string."""
        return json.dumps(self._parameters)

    def to_domain(self, requested: list[str] | None, final: bool = True) -> InferResponse:
        """As the mesh's response (only the outputs the caller asked for)."""
        outputs = {tensor.name(): tensor.as_numpy() for tensor in self._outputs}
        if requested:
            outputs = {name: array for name, array in outputs.items() if name in requested}
        return InferResponse(outputs=outputs, parameters=dict(self._parameters), final=final)

    @classmethod
    def from_domain(cls, response: InferResponse) -> InferenceResponse:
        """A mesh response (of a BLS call) as the model sees it."""
        tensors = [Tensor(name, array) for name, array in response.outputs.items()]
        return cls(tensors, parameters=response.parameters)


def _parameters_dict(parameters: dict[str, Any] | str | None, where: str) -> dict[str, Any]:
    if parameters is None or parameters == "":
        return {}
    if isinstance(parameters, str):
        parameters = json.loads(parameters)
    if not isinstance(parameters, dict):
        raise TritonModelException(f"{where} must be a dict or a JSON object")
    for key, value in parameters.items():
        if not isinstance(value, bool | int | str):
            raise TritonModelException(
                f"{where}: '{key}' must be a bool, int or str, got {type(value).__name__}"
            )
    return dict(parameters)


class InferenceResponseSender:
    """Sends the responses of one request: any number, the last one flagged final.

    Models call ``send`` from any thread; ``deliver`` (given by the backend)
    hands each response to the request's stream.
    """

    def __init__(self, deliver: Any, requested: list[str] | None) -> None:
        self._deliver = deliver
        self._requested = requested
        self._closed = False
        self.cancelled = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send ``response`` (optional with the final flag); after the final one, nothing."""
        if self._closed:
            raise TritonModelException("the response sender is closed: the final flag was sent")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._closed = final
        if response is not None and response.has_error():
            error = response.error()
            assert error is not None
            self._deliver(error.as_mesh_error(), final)
        elif response is not None:
            self._deliver(response.to_domain(self._requested, final), final)
        elif final:
            self._deliver(InferResponse(outputs={}, final=True), final)

    def is_cancelled(self) -> bool:
        """True once the caller went away (send still needs the final flag)."""
        return self.cancelled

    @property
    def closed(self) -> bool:
        """True once the final flag was sent."""
        return self._closed


# --- requests ---------------------------------------------------------------------


class InferenceRequest:
    """A request: one the model is given, or one it makes of another model (BLS)."""

    def __init__(
        self,
        model_name: str | bytes = "",
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str] | None = None,
        request_id: str = "",
        correlation_id: int | str = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._model_name = model_name.decode() if isinstance(model_name, bytes) else model_name
        self._inputs = list(inputs or [])
        self._requested = [
            n.decode() if isinstance(n, bytes) else n for n in requested_output_names or []
        ]
        self._id = request_id
        self._correlation_id = correlation_id
        self._model_version = model_version
        self._flags = flags
        self._timeout_us = timeout
        self._parameters = _parameters_dict(parameters, "InferenceRequest parameters")
        self._sender: InferenceResponseSender | None = None
        self._incoming: InferRequest | None = None

    @classmethod
    def incoming(cls, request: InferRequest, sender: InferenceResponseSender) -> InferenceRequest:
        """A request the stage received, as the model's execute sees it."""
        version = int(request.model_version) if request.model_version.isdigit() else -1
        wrapped = cls(
            request.model_name,
            [Tensor(name, array) for name, array in request.inputs.items()],
            list(request.requested_outputs or []),
            request.id,
            model_version=version,
            timeout=request.timeout_us,
        )
        wrapped._parameters = dict(request.parameters)
        wrapped._sender = sender
        wrapped._incoming = request
        return wrapped

    def inputs(self) -> list[Tensor]:
        """Every input tensor."""
        return self._inputs

    def requested_output_names(self) -> list[str]:
        """Outputs the caller asked for (empty: all)."""
        return self._requested

    def request_id(self) -> str:
        """The caller's request id."""
        return self._id

    def correlation_id(self) -> int | str:
        """The sequence id (0: none)."""
        return self._correlation_id

    def model_name(self) -> str:
        """The model the request is for."""
        return self._model_name

    def model_version(self) -> int:
        """The version asked for (-1: the newest)."""
        return self._model_version

    def flags(self) -> int:
        """Sequence flags."""
        return self._flags

    def timeout(self) -> int:
        """The caller's timeout in microseconds (0: none)."""
        return self._timeout_us

    def parameters(self) -> str:
        """Request parameters as a JSON string."""
        return json.dumps(self._parameters)

    def is_cancelled(self) -> bool:
        """True once the caller went away."""
        cancelled = self._incoming is not None and self._incoming.cancelled
        return cancelled or (self._sender is not None and self._sender.cancelled)

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender of this request's responses (a request the stage received)."""
        if self._sender is None:
            raise TritonModelException("only a request given to execute has a response sender")
        return self._sender

    def set_release_flags(self, flags: int) -> None:
        """Only RELEASE_ALL: rescheduling needs iterative sequence batching (not served)."""
        if flags != TRITONSERVER_REQUEST_RELEASE_ALL:
            raise TritonModelException(
                "request rescheduling (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE) is not supported"
            )

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on its model and wait: the response (or, with
        ``decoupled=True``, an iterator over the responses). Errors come back as a
        response whose ``has_error()`` is true, as in Triton."""
        caller = _bound()
        domain = self._to_domain()
        if decoupled:
            return ResponseIterator(caller, domain, self._timeout_s())
        try:
            return InferenceResponse.from_domain(
                caller.run(caller.infer(domain, self._timeout_s()))
            )
        except errors.MeshError as exc:
            return InferenceResponse(error=TritonError.from_mesh_error(exc))

    async def async_exec(self, decoupled: bool = False) -> Any:
        """``exec`` for an ``async def execute``: awaits without blocking its loop."""
        caller = _bound()
        domain = self._to_domain()
        if decoupled:
            return ResponseIterator(caller, domain, self._timeout_s())
        future = caller.submit(caller.infer(domain, self._timeout_s()))
        try:
            return InferenceResponse.from_domain(await asyncio.wrap_future(future))
        except errors.MeshError as exc:
            return InferenceResponse(error=TritonError.from_mesh_error(exc))

    def _timeout_s(self) -> float | None:
        return self._timeout_us / 1e6 if self._timeout_us > 0 else None

    def _to_domain(self) -> InferRequest:
        if not self._model_name:
            raise TritonModelException("InferenceRequest needs a model_name")
        return InferRequest(
            model_name=self._model_name,
            model_version="" if self._model_version < 0 else str(self._model_version),
            inputs={tensor.name(): tensor.as_numpy() for tensor in self._inputs},
            requested_outputs=self._requested or None,
            id=self._id,
            parameters=dict(self._parameters),
        )


class ResponseIterator:
    """The responses of a decoupled BLS request, as they come; the last is final."""

    _END = object()

    def __init__(self, caller: ModelCaller, request: InferRequest, timeout_s: float | None):
        self._queue: queue.Queue[Any] = queue.Queue()
        self._future = caller.submit(self._pump(caller, request, timeout_s))
        self._done = False

    async def _pump(
        self, caller: ModelCaller, request: InferRequest, timeout_s: float | None
    ) -> None:
        try:
            async for response in caller.stream(request, timeout_s):
                self._queue.put(InferenceResponse.from_domain(response))
        except errors.MeshError as exc:
            self._queue.put(InferenceResponse(error=TritonError.from_mesh_error(exc)))
        finally:
            self._queue.put(self._END)

    def __iter__(self) -> Iterator[InferenceResponse]:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is self._END:
            self._done = True
            raise StopIteration
        response: InferenceResponse = item
        return response

    def cancel(self) -> None:
        """Stop the stream: the model behind it sees its request cancelled."""
        self._future.cancel()


# --- model loading (BLS) -------------------------------------------------------------


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """True when the model (at that version) serves on the mesh."""
    caller = _bound()
    return caller.run(caller.model_ready(model_name, model_version))


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) a model of the repository, optionally with a JSON config."""
    if files:
        raise TritonModelException("load_model with override files is not supported")
    caller = _bound()
    try:
        caller.run(caller.load(model_name, config or None))
    except errors.MeshError as exc:
        raise TritonModelException(exc.message) from exc


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model (``unload_dependents`` is accepted; ensembles unload on their own)."""
    caller = _bound()
    try:
        caller.run(caller.unload(model_name))
    except errors.MeshError as exc:
        raise TritonModelException(exc.message) from exc


# --- logging ------------------------------------------------------------------------


class Logger:
    """A model's log lines, in the stage's log."""

    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    VERBOSE = logging.DEBUG

    @staticmethod
    def log(message: str, level: int = logging.INFO) -> None:
        """Log at ``level`` (one of the class's levels)."""
        log.log(level, "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        """Log at INFO."""
        log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        """Log at WARNING."""
        log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        """Log at ERROR."""
        log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        """Log at VERBOSE (the stage's DEBUG)."""
        log.debug("%s", message)
