"""The ``python`` backend: a user's ``model.py`` with initialize / execute / finalize.

The class is ``TritonPythonModel``, as in Triton's Python backend, and its
helper API is importable as ``triton_python_backend_utils`` (``python_utils``):

- default mode: ``execute(requests)`` returns one response per request (or
  sends each with the request's response sender);
- decoupled mode (``model_transaction_policy { decoupled: true }``): execute
  sends 0..n responses per request through its sender, from any thread, the
  last with ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; requests are served over
  ``ModelStreamInfer``;
- ``async def execute`` runs on the instance's own event loop, so that it may
  ``await request.async_exec()`` (BLS) without blocking the stage;
- ``auto_complete_config`` fills in a minimal or missing ``config.pbtxt``.

A model's faults stay the model's: an exception in ``initialize`` fails that
model's load; ``TritonModelException`` / ``TritonError`` reach the caller with
the model's message; any other exception is INTERNAL with the traceback logged.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import logging
import sys
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from inference import model_config_pb2 as mc
from services.inference import python_utils
from services.inference.bls import ModelCaller
from services.inference.python_config import completed_config, model_config_dict
from services.inference.python_metrics import METRICS
from services.inference.python_utils import (
    InferenceRequest,
    InferenceResponse,
    InferenceResponseSender,
    TritonError,
    TritonModelException,
)
from shared.backend import InstanceSpec, ModelSpec
from shared.errors import GENERIC_INTERNAL_MESSAGE, ConfigError, MeshError, ModelError
from shared.request import InferRequest, InferResponse
from shared.server import Hook
from shared.stage import StageContext

log = logging.getLogger(__name__)

UTILS_MODULE = "triton_python_backend_utils"
MODEL_FILE = "model.py"

Deliver = Callable[[InferResponse | MeshError, bool], None]


def import_model_class(source: Path, module_name: str) -> Any:
    """``TritonPythonModel`` from ``source``; errors name the file."""
    if not source.is_file():
        raise ConfigError(f"{source}: no such file (a python model needs {source.name})")
    sys.modules.setdefault(UTILS_MODULE, python_utils)
    module_spec = importlib.util.spec_from_file_location(module_name, source)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{source}: cannot be imported")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    model_class = getattr(module, "TritonPythonModel", None)
    if model_class is None:
        raise ConfigError(f"{source}: defines no class TritonPythonModel")
    return model_class


class _InstanceLoop:
    """An event loop in its own thread, for a model whose execute is ``async def``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, work: Any) -> Any:
        """Run a coroutine here and wait for it (from another thread)."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def start(self, work: Any) -> None:
        """Run a coroutine here without waiting."""
        asyncio.run_coroutine_threadsafe(work, self.loop)

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class LoadedModel:
    """One ``TritonPythonModel`` object, initialised."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self.spec = spec
        self.instance = instance
        source = spec.model_file(MODEL_FILE)
        module_name = f"meshserve_python_{spec.name}_{spec.version}_{instance.name}"
        self.model = import_model_class(source, module_name)()
        self._loop: _InstanceLoop | None = None
        if hasattr(self.model, "initialize"):
            self.call(self.model.initialize, self._args())

    def _args(self) -> dict[str, str]:
        device = self.instance.device
        return {
            "model_config": json.dumps(model_config_dict(self.spec.config)),
            "model_instance_kind": "GPU" if self.instance.kind == "KIND_GPU" else "CPU",
            "model_instance_name": self.instance.name,
            "model_instance_device_id": device.split(":")[1] if ":" in device else "0",
            "model_repository": str(self.spec.model_dir),
            "model_version": str(self.spec.version),
            "model_name": self.spec.name,
        }

    @property
    def instance_loop(self) -> _InstanceLoop:
        """The instance's event loop (started on first use)."""
        if self._loop is None:
            self._loop = _InstanceLoop(f"{self.instance.name}-loop")
        return self._loop

    def call(self, method: Any, *args: Any) -> Any:
        """Call a model method; a coroutine it returns runs on the instance's loop."""
        result = method(*args)
        return self.instance_loop.run(result) if inspect.iscoroutine(result) else result

    def failure(self, exc: BaseException) -> MeshError:
        """What the caller is told when execute raised ``exc``."""
        if isinstance(exc, TritonError):
            return exc.as_mesh_error()
        if isinstance(exc, TritonModelException):
            return ModelError(
                f"Failed to process the request(s) for model instance "
                f"'{self.instance.name}', message: TritonModelException: {exc}"
            )
        if isinstance(exc, MeshError):
            return exc
        log.error("model '%s' raised in execute", self.spec.name, exc_info=exc)
        return MeshError(GENERIC_INTERNAL_MESSAGE)

    def close(self) -> None:
        """Call the model's finalize, then stop its loop."""
        try:
            if hasattr(self.model, "finalize"):
                self.call(self.model.finalize)
        finally:
            if self._loop is not None:
                self._loop.close()


class PythonInstance:
    """A default-mode instance: one response per request, run in the instance's thread."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self.loaded = LoadedModel(spec, instance)

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Hand the batch to the model's execute and convert its responses."""
        sent: list[list[InferResponse | MeshError]] = [[] for _ in requests]
        wrapped = [
            InferenceRequest.incoming(request, _collecting_sender(sent[index], request))
            for index, request in enumerate(requests)
        ]
        try:
            responses = self.loaded.call(self.loaded.model.execute, wrapped)
        except (Exception, SystemExit) as exc:  # sys.exit() in model code: the model's fault
            failure = self.loaded.failure(exc)
            return [failure for _ in requests]
        if responses is None:  # sent with each request's response sender instead
            return [self._sent(answers) for answers in sent]
        return self._returned(responses, requests)

    def _returned(
        self, responses: Any, requests: list[InferRequest]
    ) -> list[InferResponse | Exception]:
        name = self.loaded.spec.name
        if not isinstance(responses, list | tuple) or len(responses) != len(requests):
            count = len(responses) if isinstance(responses, list | tuple) else type(responses)
            wrong = ModelError(
                f"model '{name}': execute returned {count} responses for {len(requests)} requests"
            )
            return [wrong for _ in requests]
        results: list[InferResponse | Exception] = []
        for response, request in zip(responses, requests, strict=True):
            if not isinstance(response, InferenceResponse):
                results.append(ModelError(f"model '{name}': execute returned {response!r}"))
            elif response.has_error():
                error = response.error()
                assert error is not None
                results.append(error.as_mesh_error())
            else:
                results.append(response.to_domain(request.requested_outputs))
        return results

    def _sent(self, answers: list[InferResponse | MeshError]) -> InferResponse | Exception:
        if len(answers) != 1:
            return ModelError(
                f"model '{self.loaded.spec.name}': a request of a model that is not decoupled "
                f"needs exactly one response, it sent {len(answers)}"
            )
        return answers[0]

    def close(self) -> None:
        """Call the user's finalize."""
        self.loaded.close()


def _collecting_sender(
    into: list[InferResponse | MeshError], request: InferRequest
) -> InferenceResponseSender:
    """A sender that keeps what a default-mode model sends (it must send one response)."""

    def deliver(item: InferResponse | MeshError, final: bool) -> None:
        if isinstance(item, MeshError) or item.outputs or not into:
            into.append(item)

    return InferenceResponseSender(deliver, request.requested_outputs)


class PythonStreamingInstance:
    """A decoupled instance: execute starts the work; responses come through senders."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=instance.name)
        # initialize runs in the instance's own thread, as execute and finalize do.
        self.loaded = self._executor.submit(LoadedModel, spec, instance).result()
        self._closed = False

    async def start(self) -> None:
        """Nothing more to load."""

    @property
    def ready(self) -> bool:
        """True until closed."""
        return not self._closed

    async def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """The responses the model sends for ``request``, up to the final one."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[InferResponse | MeshError, bool]] = asyncio.Queue()

        def deliver(item: InferResponse | MeshError, final: bool) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, (item, final))

        sender = InferenceResponseSender(deliver, request.requested_outputs)
        wrapped = InferenceRequest.incoming(request, sender)
        loop.run_in_executor(self._executor, self._execute, wrapped, sender, deliver)
        finished = False
        try:
            while not finished:
                item, finished = await inbox.get()
                if isinstance(item, MeshError):
                    raise item
                yield item
        finally:
            if not finished:  # the caller went away: the model may stop sending
                sender.cancelled = True
                request.cancelled = True

    def _execute(
        self, request: InferenceRequest, sender: InferenceResponseSender, deliver: Deliver
    ) -> None:
        """Run execute (in the instance's thread); a failure ends the request's stream."""
        loaded = self.loaded
        try:
            result = loaded.model.execute([request])
            if inspect.iscoroutine(result):
                loaded.instance_loop.start(self._guarded(result, sender, deliver))
                return
        except (Exception, SystemExit) as exc:
            deliver(loaded.failure(exc), True)
            return
        if result is not None and not sender.closed:
            deliver(
                ModelError(
                    f"model '{loaded.spec.name}' is decoupled: execute must return None "
                    "and send its responses with request.get_response_sender()"
                ),
                True,
            )

    async def _guarded(self, work: Any, sender: InferenceResponseSender, deliver: Deliver) -> None:
        try:
            await work
        except (Exception, SystemExit) as exc:
            if not sender.closed:
                deliver(self.loaded.failure(exc), True)

    async def close(self) -> None:
        """Finalize in the instance's thread, then release it."""
        self._closed = True
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self.loaded.close)
        finally:
            self._executor.shutdown(wait=False)


class PythonBackend:
    """Creates python model instances; binds the helper API to its stage."""

    name = "python"

    def attach(self, stage: StageContext) -> tuple[list[Hook], list[Hook]]:
        """BLS through ``stage`` (and its orchestrator); custom metrics on its /metrics."""
        caller = ModelCaller(
            stage.manager, stage.config.orchestrator, stage.config.max_message_bytes
        )
        python_utils.bind(caller)
        METRICS.attach(stage.registry)

        async def release() -> None:
            await caller.stop()
            python_utils.unbind(caller)
            METRICS.detach(stage.registry)

        return [caller.start], [release]

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> PythonInstance:
        """Import and initialise one default-mode instance (in its own thread)."""
        return PythonInstance(model, instance)

    def create_streaming_instance(
        self, model: ModelSpec, instance: InstanceSpec
    ) -> PythonStreamingInstance:
        """Import and initialise one decoupled instance."""
        return PythonStreamingInstance(model, instance)

    def complete_config(self, config: mc.ModelConfig, version_path: Path) -> mc.ModelConfig:
        """The config after the model's ``auto_complete_config`` (Triton calls it at load)."""
        source = version_path / (config.default_model_filename or MODEL_FILE)
        model_class = import_model_class(source, f"meshserve_autocomplete_{config.name}")
        return completed_config(config, model_class)
