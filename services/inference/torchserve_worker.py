"""A TorchServe worker inside the inference stage (the ``torchserve`` backend's instances).

Imported on the first archive's load, not at the stage's start: it imports
TorchServe's Python side and points ``ts.handler_utils.utils.create_predict_response``
at the instance's collector (intermediate responses stay here instead of going
to TorchServe's front-end socket), which a stage without archives never needs.
What is served and how: services/inference/torchserve.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from ts.context import Context, RequestProcessor
from ts.handler_utils import utils as ts_utils
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from ts.service import Service
from ts.utils.util import PredictionException, list_classes_from_module

from services.inference import torchserve_vision
from services.inference.torchserve_archive import (
    CONTENT_TYPE,
    HEADER_PREFIX,
    INPUT,
    OUTPUT,
    STATUS,
    read_manifest,
)
from services.inference.torchserve_metrics import TorchServeMetrics
from shared.backend import InstanceSpec, ModelSpec
from shared.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    ModelError,
    NotFound,
    Overloaded,
    Unavailable,
)
from shared.request import InferRequest, InferResponse

log = logging.getLogger(__name__)

_METRICS_YAML = Path(importlib.import_module("ts").__file__ or "").parent / "configs/metrics.yaml"


class _Part:
    """One intermediate response, as ``send_intermediate_predict_response`` sends it."""

    def __init__(self, ret: list[Any]) -> None:
        self.ret = ret


def _intermediate(ret: Any, req_id_map: Any, message: Any, code: Any, *rest: Any) -> Any:
    return _Part(list(ret))


# The worker's socket to TorchServe's front end is not here: intermediate
# responses are collected by the instance instead of framed for that socket,
# and the [METRICS] lines a worker logs for the front end to parse are not
# written (the ts_* metrics are exported by the stage, torchserve_metrics.py).
ts_utils.create_predict_response = _intermediate
logging.getLogger("ts.metrics").setLevel(logging.WARNING)


class _Collector:
    """Stands in for ``context.cl_socket``: keeps the intermediate responses."""

    def __init__(self, size: int) -> None:
        self.parts: list[list[Any]] = [[] for _ in range(size)]

    def sendall(self, message: Any) -> None:
        if isinstance(message, _Part):
            for index, item in enumerate(message.ret[: len(self.parts)]):
                self.parts[index].append(item)


def _handler_module(folder: Path, handler: str, unique: str) -> tuple[Any, str | None]:
    """The handler's module and entry function: a file of the archive (imported
    under a name of its own, so two archives' ``handler.py`` never clash), else a
    module on the path, else one of TorchServe's built-in handlers."""
    module_name, _, function = handler.partition(":")
    stem = module_name.removesuffix(".py").split("/")[-1]
    source = folder / f"{stem}.py"
    if source.is_file():
        spec = importlib.util.spec_from_file_location(unique, source)
        if spec is None or spec.loader is None:
            raise ConfigError(f"handler {handler!r} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique] = module
        spec.loader.exec_module(module)
        return module, function or None
    try:
        return importlib.import_module(f"ts.torch_handler.{stem}"), function or None
    except ModuleNotFoundError as exc:
        if exc.name not in (f"ts.torch_handler.{stem}",):
            raise  # the built-in handler exists but needs a package that is missing
        raise ConfigError(
            f"handler {handler!r} is neither a file of the archive nor a TorchServe handler"
        ) from exc


def _entry_point(module: Any, function: str | None) -> tuple[Any, Any]:
    """(handle, initialize) as TorchServe's model loader finds them."""
    name = function or "handle"
    if hasattr(module, name):
        entry = getattr(module, name)
        return entry, lambda context: entry(None, context)
    classes = list_classes_from_module(module)
    if len(classes) != 1:
        raise ConfigError(
            f"the handler module defines {len(classes)} classes; TorchServe needs exactly one "
            "or a function entry point (handler.py:function)"
        )
    service = classes[0]()
    if not hasattr(service, "handle"):
        raise ConfigError(f"handler class {classes[0].__name__} has no handle method")
    return service.handle, service.initialize


def _body(value: Any) -> tuple[bytes, str]:
    """A handler's answer for one request as bytes, with its content type."""
    if isinstance(value, bytes | bytearray):
        return bytes(value), "application/octet-stream"
    if isinstance(value, str):
        return value.encode(), "text/plain; charset=utf-8"
    return json.dumps(value, default=_plain).encode(), "application/json"


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


_STATUS_ERRORS: dict[int, type[MeshError]] = {
    400: InvalidArgument,
    404: NotFound,
    429: Overloaded,
    503: Unavailable,
    504: DeadlineExceeded,
}


class TorchServeInstance:
    """One TorchServe worker: the handler, initialised, with its context."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec, metrics: TorchServeMetrics) -> None:
        torchserve_vision.install()
        self.spec = spec
        self.metrics = metrics
        folder = spec.path
        manifest = read_manifest(folder)
        self.version = str(manifest["model"].get("modelVersion", spec.version))
        # TorchServe's workers run with the model folder first on the path (a
        # handler imports its archive's other files by name).
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        unique = f"meshserve_torchserve_{spec.name}_{spec.version}_{instance.name}"
        module, function = _handler_module(folder, str(manifest["model"]["handler"]), unique)
        self.handle, initialize = _entry_point(module, function)
        gpu = int(instance.device.split(":")[1]) if instance.device.startswith("cuda") else None
        metrics_cache = MetricsCacheYamlImpl(config_file_path=str(_METRICS_YAML))
        metrics_cache.model_name = spec.name
        service = Service(
            spec.name,
            str(folder),
            manifest,
            self.handle,
            gpu,
            max(spec.config.max_batch_size, 1),
            True,
            metrics_cache,
        )
        self.context: Context = service.context
        initialize(self.context)

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Every request's body to ``handle`` at once; one answer per request (a
        request whose input is not one BYTES element gets its own error)."""
        refused: list[InvalidArgument | None] = []
        rows: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for request in requests:
            try:
                rows.append(self._row(request))
                refused.append(None)
            except InvalidArgument as exc:
                refused.append(exc)
        valid = [r for r, error in zip(requests, refused, strict=True) if error is None]
        answers = iter(self._handle(valid, rows) if valid else [])
        return [next(answers) if error is None else error for error in refused]

    def _handle(
        self, requests: list[InferRequest], rows: list[tuple[dict[str, Any], dict[str, Any]]]
    ) -> list[InferResponse | Exception]:
        started = time.monotonic_ns()
        collector = _Collector(len(rows))
        context = self.context
        context.request_ids = {i: request.id or str(i) for i, request in enumerate(requests)}
        context.request_processor = [RequestProcessor(headers) for _, headers in rows]
        context.metrics.request_ids = context.request_ids
        context.cl_socket = collector
        try:
            answers = self.handle([data for data, _ in rows], context)
        except PredictionException as exc:
            error = _STATUS_ERRORS.get(int(exc.error_code), ModelError)(str(exc.message))
            return [error for _ in requests]
        except Exception:
            log.warning("model '%s': invoking the handler failed", self.spec.name, exc_info=True)
            return [Unavailable("Prediction failed") for _ in requests]
        if not isinstance(answers, list) or len(answers) != len(requests):
            got = len(answers) if isinstance(answers, list) else type(answers).__name__
            wrong = Unavailable(
                f"model '{self.spec.name}': the handler returned {got} answers for "
                f"{len(requests)} requests (TorchServe: number of batch response mismatched)"
            )
            return [wrong for _ in requests]
        done = time.monotonic_ns()
        results: list[InferResponse | Exception] = []
        for index, request in enumerate(requests):
            results.append(self._response(index, collector.parts[index], answers[index]))
            queue_us = (started - request.arrival_ns) / 1000
            self.metrics.record(
                self.spec.name, self.version, (done - request.arrival_ns) / 1000, queue_us
            )
        return results

    @staticmethod
    def _row(request: InferRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        """TorchServe's request shape and its headers for one mesh request."""
        array = request.inputs.get(INPUT)
        if array is None or array.size != 1:
            raise_for = "none" if array is None else f"{array.size} elements"
            raise InvalidArgument(f"input '{INPUT}' must hold one BYTES element, got {raise_for}")
        item = array.reshape(-1)[0]
        body = item if isinstance(item, bytes) else str(item).encode()
        headers: dict[str, Any] = {
            key.removeprefix(HEADER_PREFIX): str(value)
            for key, value in request.parameters.items()
            if key.startswith(HEADER_PREFIX)
        }
        content_type = headers.get("content-type")
        if content_type:
            headers["body"] = {"content-type": content_type}
            headers.setdefault("Content-Type", content_type)
        return {"body": body}, headers

    def _response(self, index: int, parts: list[Any], answer: Any) -> InferResponse:
        pieces = [_body(part) for part in [*parts, answer]]
        body = b"".join(piece for piece, _ in pieces)
        content_type = self.context.get_response_content_type(index) or pieces[-1][1]
        parameters: dict[str, Any] = {CONTENT_TYPE: content_type}
        status = self.context.get_response_status(index)[0]
        if status != 200:
            parameters[STATUS] = int(status)
        output = np.array([[body]], dtype=np.object_)
        return InferResponse(outputs={OUTPUT: output}, parameters=parameters)

    def close(self) -> None:
        """TorchServe's handlers hold nothing to release beyond their objects."""
