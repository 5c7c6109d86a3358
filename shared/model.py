"""One loaded model version: validation, instances, batcher, warmup, statistics.

The request path inside a stage: ``ModelVersion.infer`` checks the request
against the config (names, datatypes, shapes, batch size), queues it in the
dynamic batcher, and a ``ThreadedInstance`` runs the batch in its own thread so
the event loop never blocks on model compute (a batch measured cheaper than the
hand-off to that thread runs on the loop: ``shared/inline_budget.py``).

A decoupled model takes the other path, ``ModelVersion.stream``: the same
checks, then straight to the least busy ``StreamingInstance`` (which schedules
its own work, so there is no batcher), yielding each response as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import numpy as np
from opentelemetry import trace

from inference import model_config_pb2 as mc
from shared.backend import (
    Backend,
    InstanceSpec,
    LoopBackend,
    LoopModel,
    ModelSpec,
    QuickInstance,
    StreamingBackend,
    StreamingInstance,
    is_decoupled,
)
from shared.batcher import DynamicBatcher
from shared.errors import ConfigError, InvalidArgument, MeshError, Overloaded, Unavailable
from shared.instances import (
    QuickThreadedInstance,
    ThreadedInstance,
    cuda_device_count,
    inline_budget_for,
    instance_specs,
)
from shared.queue_bounds import DEFAULTS, QueueDefaults, batch_policy, stream_limit
from shared.request import InferRequest, InferResponse
from shared.statistics import Metrics, StatsRecorder
from shared.tensors import DATATYPES, config_datatype, datatype_of

log = logging.getLogger(__name__)


def warmup_requests(spec: ModelSpec) -> list[tuple[str, InferRequest, int]]:
    """The config's model_warmup samples as (name, request, repeat count)."""
    samples = []
    batched = spec.config.max_batch_size > 0
    rng = np.random.default_rng(0)
    for warm in spec.config.model_warmup:
        inputs: dict[str, np.ndarray] = {}
        for name, item in warm.inputs.items():
            shape = ([max(1, warm.batch_size)] if batched else []) + list(item.dims)
            dtype = DATATYPES[config_datatype(item.data_type)]
            if item.HasField("random_data") and dtype.kind in "fiu":
                inputs[name] = rng.random(shape).astype(dtype)
            elif dtype.kind == "O":
                inputs[name] = np.full(shape, b"", dtype=object)
            else:
                inputs[name] = np.zeros(shape, dtype=dtype)
        request = InferRequest(model_name=spec.name, model_version=str(spec.version), inputs=inputs)
        samples.append((warm.name or "warmup", request, max(1, warm.count)))
    return samples


@runtime_checkable
class ReportsRuntime(Protocol):
    """A backend instance that says how it actually runs once loaded (e.g. the dtype
    its engine resolved); ModelConfig shows these beside the config's parameters."""

    def runtime_parameters(self) -> dict[str, str]:
        """Parameter name -> value, known only after load."""
        ...


class ModelVersion:
    """A model version from load to unload; ``infer`` and ``stream`` are its request paths."""

    def __init__(
        self,
        spec: ModelSpec,
        backend: Backend,
        metrics: Metrics | None,
        queue_defaults: QueueDefaults = DEFAULTS,
    ) -> None:
        self.spec = spec
        self.queue_defaults = queue_defaults
        self.backend = backend
        self.state = "UNAVAILABLE"
        self.reason = ""
        self.stats = StatsRecorder(spec.name, str(spec.version), metrics)
        self.instances: list[ThreadedInstance] = []
        self.batcher: DynamicBatcher | None = None
        self.batched = spec.config.max_batch_size > 0
        self.decoupled = is_decoupled(spec.config)
        self.streaming: list[StreamingInstance] = []
        """A decoupled model's instances (it has neither threaded instances nor a batcher)."""
        self.on_loop: LoopModel | None = None
        """A LoopBackend's model: each request runs on the loop as it comes."""
        self._open_streams: dict[int, int] = {}  # id(streaming instance) -> streams open on it
        self._stream_limit = 0  # most streams open at once; 0: unbounded (set at load)
        self._streams_drained = asyncio.Event()
        self._streams_drained.set()
        config = spec.config
        self._inputs = {tensor.name: tensor for tensor in config.input}
        self._outputs = {tensor.name for tensor in config.output}

    @property
    def name(self) -> str:
        """The model's name."""
        return self.spec.name

    @property
    def version(self) -> int:
        """The version number."""
        return self.spec.version

    @property
    def runtime_parameters(self) -> dict[str, str]:
        """What the loaded instances report about how they run (``ReportsRuntime``)."""
        reported: dict[str, str] = {}
        for instance in [*self.streaming, *(threaded.instance for threaded in self.instances)]:
            if isinstance(instance, ReportsRuntime):
                reported.update(instance.runtime_parameters())
        return reported

    @property
    def ready(self) -> bool:
        """True once loaded and warmed up, until unloading starts (or an engine dies)."""
        return self.state == "READY" and all(instance.ready for instance in self.streaming)

    async def load(self) -> None:
        """Create the instances, warm them up, start batching (decoupled: start streaming)."""
        self.state = "LOADING"
        try:
            if isinstance(self.backend, LoopBackend):
                self.on_loop = await self.backend.open(self.spec)  # no instances to lay out
            else:
                # Off the loop: it may import torch, seconds in which no RPC would be answered.
                cuda_devices = await asyncio.to_thread(cuda_device_count)
                specs = instance_specs(self.spec.config, cuda_devices)
                if self.decoupled:
                    await self._load_streaming(specs)
                else:
                    await self._load_threaded(specs)
            await self._warmup()
            if self.batcher is not None:
                await self.batcher.start()
        except BaseException as exc:
            self.state = "UNAVAILABLE"
            self.reason = str(exc) if isinstance(exc, MeshError) else f"load failed: {exc!r}"
            await self._close_instances()
            raise
        self.state = "READY"
        self.reason = ""

    async def _load_threaded(self, specs: list[InstanceSpec]) -> None:
        loop = asyncio.get_running_loop()
        for instance_spec in specs:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=instance_spec.name)
            backend_instance = await loop.run_in_executor(
                executor, self.backend.create_instance, self.spec, instance_spec
            )
            budget = inline_budget_for(self.spec.config, backend_instance)
            kind = (
                QuickThreadedInstance
                if isinstance(backend_instance, QuickInstance) or budget is not None
                else ThreadedInstance
            )
            threaded = kind(
                instance_spec, backend_instance, executor, self.stats, self.batched, budget
            )
            self.instances.append(threaded)
        policy = batch_policy(self.spec.config, len(self.instances), self.queue_defaults)
        self.stats.set_queue_capacity(policy.default_queue_policy.max_queue_size)
        self.batcher = DynamicBatcher(
            policy,
            self.instances,
            name=f"{self.name}:{self.version}",
            on_pending=self.stats.set_pending,
        )

    async def _load_streaming(self, specs: list[InstanceSpec]) -> None:
        backend = self.backend
        if not isinstance(backend, StreamingBackend):
            raise ConfigError(
                f"model '{self.name}': backend '{backend.name}' cannot serve decoupled models "
                "(model_transaction_policy { decoupled: true } is set)"
            )
        self._stream_limit = stream_limit(self.spec.config, len(specs), self.queue_defaults)
        loop = asyncio.get_running_loop()
        for instance_spec in specs:
            # Building an instance may import heavy modules: a worker thread, not the loop.
            instance = await loop.run_in_executor(
                None, backend.create_streaming_instance, self.spec, instance_spec
            )
            self.streaming.append(instance)
            await instance.start()

    async def _warmup(self) -> None:
        for name, request, count in warmup_requests(self.spec):
            for index in range(len(self.streaming) or len(self.instances)):
                for _ in range(count):
                    try:
                        await self._warm_once(index, request)
                    except Exception as exc:
                        raise ConfigError(
                            f"model '{self.name}': warmup '{name}' failed: {exc}"
                        ) from exc

    async def _warm_once(self, index: int, request: InferRequest) -> None:
        if self.streaming:
            async with contextlib.aclosing(self.streaming[index].stream(request)) as responses:
                async for _ in responses:
                    pass
            return
        (result,) = await self.instances[index].execute([request])
        if isinstance(result, Exception):
            raise result

    async def unload(self) -> None:
        """Stop taking requests, finish the queued (and streaming) ones, release the instances."""
        self.state = "UNLOADING"
        if self.batcher is not None:
            await self.batcher.stop(drain=True)
        await self._streams_drained.wait()
        await self._close_instances()
        self.state = "UNAVAILABLE"
        self.reason = "unloaded"

    async def _close_instances(self) -> None:
        loop = asyncio.get_running_loop()
        while self.instances:
            # Handed over in a list the call empties: an executor's thread keeps its work
            # item (the call and its arguments) for a moment after the result is back, and
            # an instance still held then would outlive the collection after the unload.
            held = [self.instances.pop(0)]
            await loop.run_in_executor(None, _close_held, held)
        for streaming in self.streaming:
            try:
                await streaming.close()
            except Exception:
                log.exception("model '%s': closing a streaming instance failed", self.name)
        self.streaming = []
        if self.on_loop is not None:
            await self.on_loop.close()
            self.on_loop = None

    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate, queue, execute; records success or failure statistics."""
        started = time.monotonic_ns()
        try:
            if self.decoupled:
                raise InvalidArgument(f"model '{self.name}' is decoupled; use ModelStreamInfer")
            if self.on_loop is not None and self.ready:
                self.validate(request)
                response = await self.on_loop.infer(request)
                request.queue_start_ns = request.compute_start_ns = started
                # One execution per request, as the orchestrator counts its ensembles'.
                rows = request.batch_size(self.batched)
                self.stats.batch_done(rows, 0, time.monotonic_ns() - started, 0)
            elif not self.ready or self.batcher is None:
                raise Unavailable(f"model '{self.name}' version {self.version} is not ready")
            else:
                self.validate(request)
                response = await self.batcher.infer(request)
        except BaseException as exc:
            self.stats.request_done(time.monotonic_ns() - started, 0, False, _failure(exc))
            if isinstance(exc, asyncio.CancelledError):
                request.cancelled = True  # a model that checks is_cancelled() may stop early
            raise
        finished = time.monotonic_ns()
        queue_ns = max(0, request.compute_start_ns - request.queue_start_ns)
        self.stats.request_done(finished - started, queue_ns, True)
        # Queue and compute time on the RPC's server span, so a trace shows
        # where a stage spent the request's time.
        span = self._label_span()
        span.set_attribute("meshserve.queue_us", queue_ns // 1000)
        span.set_attribute("meshserve.compute_us", (finished - request.compute_start_ns) // 1000)
        return response

    async def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """Every response to ``request`` as it comes, the last ``final``.

        A model that is not decoupled answers once. Closing the iterator (the
        caller went away) closes the instance's stream, which stops its work.
        """
        if not self.decoupled:
            yield await self.infer(request)
            return
        started = time.monotonic_ns()
        failure = "CANCELED"
        try:
            instance = self._choose(request)
            with self._opened(instance):
                async with contextlib.aclosing(instance.stream(request)) as responses:
                    final = False
                    async for response in responses:
                        final = response.final
                        yield _only_requested(response, request.requested_outputs)
                    if not final:  # the instance ended without saying so: say it for it
                        yield InferResponse(outputs={}, final=True)
            failure = ""
        except BaseException as exc:
            failure = _failure(exc)
            raise
        finally:
            elapsed = time.monotonic_ns() - started
            self.stats.request_done(elapsed, 0, not failure, failure)
            if not failure:
                self.stats.batch_done(1, 0, elapsed, 0)

    def _choose(self, request: InferRequest) -> StreamingInstance:
        """Validate, then pick the streaming instance with the fewest open streams."""
        if not self.ready or not self.streaming:
            raise Unavailable(f"model '{self.name}' version {self.version} is not ready")
        self.validate(request)
        self._label_span()
        limit = self._stream_limit
        if limit and sum(self._open_streams.values()) >= limit:
            raise Overloaded(
                f"model '{self.name}': {limit} streams are open (max_queue_size); retry later"
            )
        return min(self.streaming, key=lambda instance: self._open_streams.get(id(instance), 0))

    @contextlib.contextmanager
    def _opened(self, instance: StreamingInstance) -> Iterator[None]:
        """Count a stream open on ``instance`` (unload waits until none is left)."""
        key = id(instance)
        self._open_streams[key] = self._open_streams.get(key, 0) + 1
        self._streams_drained.clear()
        try:
            yield
        finally:
            self._open_streams[key] -= 1
            if not any(self._open_streams.values()):
                self._streams_drained.set()

    def _label_span(self) -> trace.Span:
        span = trace.get_current_span()
        span.set_attribute("meshserve.model", self.name)
        span.set_attribute("meshserve.model_version", self.version)
        return span

    def validate(self, request: InferRequest) -> None:
        """Names, datatypes and shapes against the config; applies ``reshape``."""
        for name in request.inputs:
            if name not in self._inputs:
                raise InvalidArgument(
                    f"model '{self.name}': unknown input '{name}'; expected {sorted(self._inputs)}"
                )
        for name, tensor in self._inputs.items():
            if name not in request.inputs:
                if tensor.optional:
                    continue
                raise InvalidArgument(f"model '{self.name}': missing input '{name}'")
            request.inputs[name] = self._check_tensor(tensor, request.inputs[name])
        if self.batched:
            self._check_rows(request)
        for name in request.requested_outputs or ():
            if name not in self._outputs:
                raise InvalidArgument(
                    f"model '{self.name}': unknown output '{name}'; "
                    f"expected {sorted(self._outputs)}"
                )

    def _check_rows(self, request: InferRequest) -> None:
        """Every input of a request to a batched model brings the same rows (Triton
        refuses it otherwise): a batch is split back among its requests by rows."""
        rows = {name: int(array.shape[0]) for name, array in request.inputs.items()}
        first = next(iter(rows), None)
        for name, count in rows.items():
            if first is not None and count != rows[first]:
                raise InvalidArgument(
                    f"model '{self.name}': input '{name}' has batch size {count}, but input "
                    f"'{first}' has {rows[first]}; every input needs the same batch size"
                )

    def _check_tensor(self, tensor: mc.ModelInput, array: np.ndarray) -> np.ndarray:
        expected_type = config_datatype(tensor.data_type)
        actual_type = datatype_of(array)
        if actual_type != expected_type:
            raise InvalidArgument(
                f"model '{self.name}': input '{tensor.name}' has datatype {actual_type}, "
                f"expected {expected_type}"
            )
        dims = list(tensor.dims)
        expected = ([-1] if self.batched else []) + dims
        shape = list(array.shape)
        if len(shape) != len(expected) or any(
            want not in (-1, got) for want, got in zip(expected, shape, strict=True)
        ):
            raise InvalidArgument(
                f"model '{self.name}': input '{tensor.name}' has shape {shape}, expected "
                f"{expected} (-1 = any)"
            )
        if self.batched:
            rows = shape[0]
            limit = self.spec.config.max_batch_size
            if rows < 1 or rows > limit:
                raise InvalidArgument(
                    f"model '{self.name}': input '{tensor.name}' batch size {rows} is outside "
                    f"1..{limit} (max_batch_size)"
                )
        if tensor.HasField("reshape"):
            target = ([shape[0]] if self.batched else []) + list(tensor.reshape.shape)
            return array.reshape(target)
        return array

    def metadata(self) -> dict[str, Any]:
        """Inputs and outputs with v2 datatypes and shapes (-1 for the batch dim)."""
        prefix = [-1] if self.batched else []

        def describe(tensor: Any) -> tuple[str, str, list[int]]:
            return tensor.name, config_datatype(tensor.data_type), prefix + list(tensor.dims)

        return {
            "inputs": [describe(t) for t in self.spec.config.input],
            "outputs": [describe(t) for t in self.spec.config.output],
        }


def _close_held(held: list[ThreadedInstance]) -> None:
    """Close the one instance in ``held``, taking it out first (see _close_instances)."""
    held.pop().close()


def _failure(exc: BaseException) -> str:
    """The statistics' failure reason for an exception that ended a request."""
    if isinstance(exc, MeshError):
        return "REJECTED"
    return "CANCELED" if isinstance(exc, asyncio.CancelledError | GeneratorExit) else "BACKEND"


def _only_requested(response: InferResponse, names: list[str] | None) -> InferResponse:
    if names is not None:
        response.outputs = {k: v for k, v in response.outputs.items() if k in names}
    return response
