"""Concurrent requests to an ensemble, as one batch through its steps.

Without it every request goes through every step on its own: a sub-request,
a pass through the step's batcher, its statistics and a split of the step's
batch, per step and request, and where the steps are other processes a round
trip to each. When the ensemble and all its steps are batched
(``max_batch_size`` > 0), the requests that arrive together are stacked along
dim 0 and the graph runs once for all of them, as a one-process server runs
its steps on a batch; the ensemble's outputs are then split back by rows. Two
runners use it: a stage that runs an ensemble whole
(services/colocated/local_ensembles.py) and the orchestrator, for an ensemble
whose steps are other stages' models (ensemble_queues.py).

The queue is the shared ``DynamicBatcher`` (priorities, queue bounds and
timeouts, cancellation while queued), with as many lanes (batches at a time)
as its runner gives it, so every instance of the widest step can have a batch.
It waits for nothing: a free lane takes whatever has queued while the lanes
were busy. The ``ensemble_batching: false`` parameter turns it off. A batch
whose data one request spoils (a step answers INVALID_ARGUMENT) runs again one
request at a time, so only that request's caller hears the error.

No gRPC here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import trace
from opentelemetry.context import Context

from inference import model_config_pb2 as mc
from shared.backend import split_rows, stacked_inputs
from shared.batcher import BatchPolicy, DynamicBatcher
from shared.errors import InvalidArgument
from shared.queue_bounds import batch_policy
from shared.request import InferRequest, InferResponse

RunOne = Callable[[InferRequest], Awaitable[InferResponse]]
"""Runs one (possibly stacked) request through the graph."""


def lane_count(widest: int) -> int:
    """Batches an ensemble runs at a time, given the instances of its widest step:
    one per instance and one more, so that while every instance of that step
    runs a batch, another batch crosses the other steps (and, where they are
    other processes, the hops) instead of leaving an instance idle when its
    batch is done (docs/performance.md has the measurements)."""
    return max(1, widest) + 1


def ensemble_policy(
    ensemble: mc.ModelConfig, steps: Sequence[mc.ModelConfig], lanes: int
) -> BatchPolicy | None:
    """How the ensemble's requests are batched; None when one of its steps (or the
    ensemble) has no batch dimension or its ``ensemble_batching`` parameter is
    ``false``, and each request then runs alone."""
    if ensemble.max_batch_size <= 0 or any(step.max_batch_size <= 0 for step in steps):
        return None
    switch = ensemble.parameters.get("ensemble_batching")
    if switch is not None and switch.string_value.strip().lower() in ("false", "0", "off"):
        return None
    # An ensemble's config has no dynamic_batching (Triton's scheduling_choice is
    # one of them), so a copy says how its queue works: no more rows than the
    # narrowest step takes, and the steps' priority levels, so that a request's
    # priority means the same here. Its parameters (max_queue_size,
    # queue_timeout_us, queue_delay_policy) bound the queue as a model's do.
    config = mc.ModelConfig()
    config.CopyFrom(ensemble)
    config.max_batch_size = min([ensemble.max_batch_size, *(s.max_batch_size for s in steps)])
    levels = max(steps, key=lambda step: step.dynamic_batching.priority_levels).dynamic_batching
    config.dynamic_batching.priority_levels = levels.priority_levels
    config.dynamic_batching.default_priority_level = levels.default_priority_level
    return batch_policy(config, lanes)


class EnsembleBatches:
    """Queues an ensemble's requests and runs each batch of them once through the graph."""

    def __init__(
        self, name: str, policy: BatchPolicy, lanes: int, run: RunOne, tracer: trace.Tracer
    ) -> None:
        self._run = run
        self._tracer = tracer
        self._traced = not isinstance(tracer, trace.NoOpTracer)
        self._contexts: dict[int, Context] = {}  # id(request) -> its caller's trace context
        self._alone_now = 0  # requests running outside the batcher (nothing else in flight)
        self.batcher = DynamicBatcher(
            policy, [_Lane(f"lane_{i}", self) for i in range(lanes)], name=name
        )

    async def infer(self, request: InferRequest) -> InferResponse:
        """Queue ``request``; its rows of its batch's answer. A request that finds
        nothing else in flight runs at once: the queue's hand-off would only add time."""
        if self.idle:
            with self.alone():
                return await self._run(request)
        if self._traced:
            self._contexts[id(request)] = trace.set_span_in_context(trace.get_current_span())
        try:
            return await self.batcher.infer(request)
        finally:
            if self._traced:
                del self._contexts[id(request)]

    @property
    def idle(self) -> bool:
        """True when no request of the ensemble is in flight, queued or alone."""
        return self._alone_now == 0 and self.batcher.in_flight == 0

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Count a request that runs outside the queue (it found the ensemble idle),
        so that the next one to come while it runs is queued."""
        self._alone_now += 1
        try:
            yield
        finally:
            self._alone_now -= 1

    async def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """One run for the batch; each request alone when that run fails on bad data."""
        if len(requests) == 1:
            return await self._alone(requests)
        stacked = _stack(requests)
        try:
            with self._batch_span(requests):
                answer = await self._run(stacked)
            return _split(answer, requests)
        except InvalidArgument:
            return await self._alone(requests)
        except Exception as exc:
            return [exc] * len(requests)

    async def _alone(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        async def one(request: InferRequest) -> InferResponse | Exception:
            try:
                with self._request_context(request):
                    return await self._run(request)
            except Exception as exc:
                return exc

        return list(await asyncio.gather(*(one(request) for request in requests)))

    def _request_context(self, request: InferRequest) -> AbstractContextManager[object]:
        """The caller's span current while its request runs alone (step spans are its children)."""
        context = self._contexts.get(id(request))
        if context is None:
            return nullcontext()
        return trace.use_span(trace.get_current_span(context), end_on_exit=False)

    def _batch_span(self, requests: list[InferRequest]) -> AbstractContextManager[object]:
        """A span for the batch in the first caller's trace, linked to every caller's."""
        contexts = [self._contexts.get(id(request)) for request in requests]
        if contexts[0] is None:
            return nullcontext()
        links = [
            trace.Link(trace.get_current_span(context).get_span_context())
            for context in contexts
            if context is not None
        ]
        return self._tracer.start_as_current_span(
            "ensemble batch",
            context=contexts[0],
            links=links,
            attributes={"meshserve.batch_requests": len(requests)},
        )

    async def start(self) -> None:
        """Start the lanes."""
        await self.batcher.start()

    async def stop(self) -> None:
        """Finish what is queued, then end the lanes."""
        await self.batcher.stop(drain=True)


class _Lane:
    """One batch at a time through the graph (a ``ModelInstance`` of the batcher)."""

    def __init__(self, name: str, batches: EnsembleBatches) -> None:
        self.name = name
        self._batches = batches

    async def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """The batch, through the graph."""
        return await self._batches.execute(requests)


def _stack(requests: list[InferRequest]) -> InferRequest:
    """The requests as one: inputs concatenated along dim 0 (the batcher gave them
    the same names, types and shapes past dim 0)."""
    first = requests[0]
    return InferRequest(
        first.model_name,
        first.model_version,
        stacked_inputs(requests),
        requested_outputs=_union(requests),
        id=first.id,
        priority=first.priority,
    )


def _union(requests: list[InferRequest]) -> list[str] | None:
    """Every output some request asked for; None (all) when one asked for all."""
    names: list[str] = []
    for request in requests:
        if request.requested_outputs is None:
            return None
        names += [name for name in request.requested_outputs if name not in names]
    return names


def _split(answer: InferResponse, requests: list[InferRequest]) -> list[InferResponse | Exception]:
    """Each request's rows of the batch's outputs, only the outputs it asked for."""
    total = sum(request.batch_size(True) for request in requests)
    for name, array in answer.outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise InvalidArgument(  # not per row: the requests run alone instead
                f"output '{name}' has {array.shape[:1]} rows for a batch of {total}"
            )
    return list(split_rows(answer.outputs, requests))
