"""The Backend interface: load a model version, execute a batch, unload.

A backend is small. ``Backend.create_instance`` builds one execution instance
of a model version (called in a worker thread; it may be slow); the instance's
``execute`` runs a list of requests in its own thread and returns one response
(or exception) per request. ``TensorInstance`` adds what tensor backends share:
requests are concatenated along the batch dimension, run once, and the outputs
split back per caller.

Decoupled models (Triton's ``model_transaction_policy { decoupled: true }``, an
LLM streaming tokens) are served by a ``StreamingBackend`` instead: its
``StreamingInstance`` is asynchronous, schedules its own work (vLLM batches
continuously, so no DynamicBatcher sits in front of it) and answers one request
with a stream of responses, the last one ``final``.
"""

from __future__ import annotations

import abc
import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from inference import model_config_pb2 as mc
from shared import jsontext
from shared.errors import ConfigError, InvalidArgument
from shared.request import InferRequest, InferResponse

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Settings = TypeVar("Settings", bound="DataclassInstance")


@dataclass(frozen=True)
class InstanceSpec:
    """Where and how one execution instance runs."""

    name: str
    """``<model>_<group>_<index>``, as Triton names instances."""
    kind: str
    """``KIND_CPU`` or ``KIND_GPU``."""
    device: str
    """``cpu`` or ``cuda:<n>``."""
    intra_op_threads: int
    """Threads this instance's framework may use for one operator."""


@dataclass(frozen=True)
class ModelSpec:
    """One model version as a backend sees it."""

    name: str
    version: int
    path: Path
    """The version folder (``<repo>/<model>/<version>``)."""
    config: mc.ModelConfig
    parameters: dict[str, str] = field(default_factory=dict)
    """The config's ``parameters`` as plain strings."""

    @property
    def model_dir(self) -> Path:
        """The model folder (parent of the version folder)."""
        return self.path.parent

    def model_file(self, default: str) -> Path:
        """The model file: ``default_model_filename`` or ``default`` in the version folder."""
        return self.path / (self.config.default_model_filename or default)


class BackendInstance(Protocol):
    """One loaded copy of a model; ``execute`` runs in the instance's own thread."""

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """One response (or a per-request exception) for each request, in order."""
        ...

    def close(self) -> None:
        """Release what the instance holds."""
        ...


@runtime_checkable
class QuickInstance(Protocol):
    """A backend instance whose small requests may run on the event loop.

    Handing a batch to the instance's thread and back costs a fixed latency
    (docs/performance.md); for work smaller than that (a short chat
    template, a detokenizer step) the hop is most of the request. Only the
    project's own bounded stage backends implement this; model code (pytorch,
    onnxruntime, python) always runs in its thread.
    """

    def runs_inline(self, requests: list[InferRequest]) -> bool:
        """True when ``requests`` are cheap enough to execute on the event loop."""
        ...


class Backend(Protocol):
    """A kind of model (``pytorch``, ``onnxruntime``, ``python``...)."""

    name: str

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> BackendInstance:
        """Load one instance (blocking; called in a worker thread)."""
        ...


@runtime_checkable
class CompletingBackend(Protocol):
    """A backend that completes a model's config at load (Triton's auto-complete):
    a minimal or missing config.pbtxt gets its tensors and batching from the model."""

    def complete_config(self, config: mc.ModelConfig, version_path: Path) -> mc.ModelConfig:
        """The completed config (blocking; called in a worker thread)."""
        ...


class StreamingInstance(Protocol):
    """One loaded copy of a decoupled model; every method runs on the event loop."""

    async def start(self) -> None:
        """Load (e.g. start the engine) without blocking the event loop."""
        ...

    def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """The responses to one request, the last with ``final=True``.

        Closing or cancelling the iterator must stop the work it started.
        """
        ...

    @property
    def ready(self) -> bool:
        """True while the instance can take requests (False once its engine died)."""
        ...

    async def close(self) -> None:
        """Stop and release what the instance holds."""
        ...


@runtime_checkable
class StreamingBackend(Protocol):
    """A backend that serves decoupled models."""

    name: str

    def create_streaming_instance(
        self, model: ModelSpec, instance: InstanceSpec
    ) -> StreamingInstance:
        """Build one instance (blocking, in a worker thread); ``start`` loads it."""
        ...


class LoopModel(Protocol):
    """A loaded model whose requests run on the event loop, each as it comes: no
    batcher and no instance thread in front of it (an ensemble of the stage's own
    models, whose steps queue at their own models' batchers)."""

    async def infer(self, request: InferRequest) -> InferResponse:
        """The answer to one (validated) request."""
        ...

    async def close(self) -> None:
        """Release what the model holds."""
        ...


@runtime_checkable
class LoopBackend(Protocol):
    """A backend whose models are ``LoopModel``s; they load after every other model
    of the stage (they may use them)."""

    name: str

    def claims(self, config: mc.ModelConfig) -> bool:
        """True when this stage should host the model of ``config`` (a backend may
        run only some models of its kind)."""
        ...

    async def open(self, model: ModelSpec) -> LoopModel:
        """Load one version (on the event loop: it must not block)."""
        ...


def is_decoupled(config: mc.ModelConfig) -> bool:
    """True for models that answer a request with a stream of responses."""
    return config.model_transaction_policy.decoupled


class TensorInstance(abc.ABC):
    """Shared batching logic for backends whose models map tensors to tensors."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model
        self.batched = model.config.max_batch_size > 0
        self.output_names = [output.name for output in model.config.output]

    @abc.abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the model once on (possibly concatenated) inputs."""

    def close(self) -> None:  # noqa: B027 - most tensor backends hold nothing to free
        """Release resources (default: nothing)."""

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Concatenate along dim 0, run once, split the outputs back per request.

        When one request's data fails the merged run (``run`` raised
        InvalidArgument), each request runs alone, so only its caller gets the error.
        """
        if len(requests) == 1 or not self.batched:
            return [self._one(request) for request in requests]
        try:
            outputs = self.run(stacked_inputs(requests))
        except InvalidArgument:
            return [self._one(request) for request in requests]
        return list(split_rows(outputs, requests))

    def _one(self, request: InferRequest) -> InferResponse | Exception:
        try:
            return InferResponse(outputs=_select(self.run(request.inputs), request))
        except InvalidArgument as exc:
            return exc


def stacked_inputs(requests: Sequence[InferRequest]) -> dict[str, np.ndarray]:
    """The requests' inputs concatenated along dim 0 (a batcher gave them the same
    names, types and shapes past dim 0)."""
    names = list(requests[0].inputs)
    return {name: np.concatenate([r.inputs[name] for r in requests]) for name in names}


def split_rows(
    outputs: dict[str, np.ndarray], requests: Sequence[InferRequest]
) -> list[InferResponse]:
    """Each request's rows of a stacked run's outputs, only the outputs it asked for."""
    rows = np.cumsum([r.batch_size(True) for r in requests])[:-1]
    pieces = {name: np.split(array, rows) for name, array in outputs.items()}
    return [
        InferResponse(
            outputs=_select({name: parts[index] for name, parts in pieces.items()}, request)
        )
        for index, request in enumerate(requests)
    ]


def _select(outputs: dict[str, np.ndarray], request: InferRequest) -> dict[str, np.ndarray]:
    if request.requested_outputs is None:
        return outputs
    return {name: outputs[name] for name in request.requested_outputs}


def default_intra_op_threads(total_instances: int) -> int:
    """Threads per CPU instance so that all instances together fit the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, total_instances))


def config_parameters(config: mc.ModelConfig) -> dict[str, str]:
    """The ``parameters`` map of a model config as plain strings."""
    return {key: value.string_value for key, value in config.parameters.items()}


def parameter(spec: ModelSpec, key: str, default: Any, kind: type = str) -> Any:
    """One config parameter converted to ``kind``; a bad value names the key."""
    raw = spec.parameters.get(key)
    if raw is None or raw == "":
        return default
    try:
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return kind(raw)
    except ValueError as exc:
        raise InvalidArgument(
            f"model '{spec.name}': parameter '{key}' = {raw!r} is not a {kind.__name__}"
        ) from exc


def parameter_settings(
    cls: type[Settings], spec: ModelSpec, bounds: Mapping[str, tuple[float, float]]
) -> Settings:
    """A dataclass of config parameters, one per field (read by the field's name,
    converted to its default's type, the default when absent), each value in
    ``bounds`` checked; a bad value is a ConfigError naming the parameter."""
    try:
        settings = cls(
            **{f.name: parameter(spec, f.name, f.default, type(f.default)) for f in fields(cls)}
        )
    except InvalidArgument as exc:
        raise ConfigError(str(exc)) from exc
    for key, (low, high) in bounds.items():
        if not low <= getattr(settings, key) <= high:
            raise ConfigError(f"model '{spec.name}': parameter '{key}' must be in {low}..{high}")
    return settings


def json_object(raw: Any, where: str) -> dict[str, Any]:
    """One JSON object from a BYTES element; errors name ``where``."""
    try:
        value = jsontext.parse(raw)
    except (ValueError, TypeError) as exc:  # TypeError: not bytes or str
        raise InvalidArgument(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object")
    return value
