"""An ensemble's concurrent requests as one batch through its graph
(services/orchestrator/ensemble_batches.py): which ensembles batch, how their
queue is set, that each caller gets its own rows, and that one caller's bad
data fails only that caller. The graph here is an async function over the
stacked request, the seam through which the colocated stage and the
orchestrator pass their graphs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from google.protobuf import text_format
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inference import model_config_pb2 as mc
from services.orchestrator.ensemble_batches import EnsembleBatches, ensemble_policy
from shared.batcher import BatchPolicy
from shared.errors import InvalidArgument, Unavailable
from shared.request import InferRequest, InferResponse


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


ENSEMBLE = config('name: "pipe" platform: "ensemble" max_batch_size: 16')
WIDE = config(
    'name: "wide" max_batch_size: 32 dynamic_batching { priority_levels: 3 '
    "default_priority_level: 2 }"
)
NARROW = config('name: "narrow" max_batch_size: 4')


def test_an_ensemble_batches_only_when_it_and_every_step_have_a_batch_dimension() -> None:
    assert ensemble_policy(ENSEMBLE, [WIDE, config('name: "flat" max_batch_size: 0')], 2) is None
    assert ensemble_policy(config('name: "p" platform: "ensemble"'), [WIDE], 2) is None
    policy = ensemble_policy(ENSEMBLE, [WIDE, NARROW], 2)
    assert policy is not None
    assert policy.dynamic_batching
    assert policy.max_batch_size == 4  # no more rows than the narrowest step takes
    assert policy.max_queue_delay_us == 0  # a free lane takes what queued meanwhile
    # A request's priority means what it means to the steps.
    assert (policy.priority_levels, policy.default_priority_level) == (3, 2)


def test_the_ensembles_parameters_bound_its_queue_or_turn_batching_off() -> None:
    bounded = config(
        'name: "pipe" platform: "ensemble" max_batch_size: 8 parameters [ '
        '{ key: "max_queue_size" value: { string_value: "5" } }, '
        '{ key: "queue_timeout_us" value: { string_value: "700" } } ]'
    )
    policy = ensemble_policy(bounded, [WIDE], 1)
    assert policy is not None
    queue = policy.default_queue_policy
    assert (queue.max_queue_size, queue.default_timeout_us) == (5, 700)
    off = config(
        'name: "pipe" platform: "ensemble" max_batch_size: 8 parameters '
        '{ key: "ensemble_batching" value: { string_value: "false" } }'
    )
    assert ensemble_policy(off, [WIDE], 1) is None


def request(values: list[float], outputs: list[str] | None = None) -> InferRequest:
    x = np.array(values, dtype=np.float32).reshape(-1, 1)
    return InferRequest("pipe", "", {"X": x}, requested_outputs=outputs)


class Graph:
    """Y = X * 10 and Z = X + 1 on the whole batch; a negative value spoils it."""

    def __init__(self, per_row: bool = True) -> None:
        self.batches: list[int] = []
        self.per_row = per_row
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    async def run(self, request: InferRequest) -> InferResponse:
        x = request.inputs["X"]
        self.batches.append(len(x))
        self.started.set()
        await self.release.wait()
        if (x < 0).any():
            raise InvalidArgument("ensemble 'pipe' step 0 ('checked'): X must not be negative")
        outputs = {"Y": x * 10, "Z": x + 1}
        if not self.per_row:
            outputs["TOTAL"] = x.sum(keepdims=True).reshape(1)
        if request.requested_outputs is not None:
            outputs = {name: outputs[name] for name in request.requested_outputs}
        return InferResponse(outputs=outputs)


def run_waves(graph: Graph, waiting: list[InferRequest]) -> list[InferResponse | BaseException]:
    """One request holds the only lane; ``waiting`` queue behind it and go as one batch."""

    async def scenario() -> list[InferResponse | BaseException]:
        policy = ensemble_policy(ENSEMBLE, [WIDE], 1)
        assert isinstance(policy, BatchPolicy)
        batches = EnsembleBatches("pipe", policy, 1, graph.run, trace.NoOpTracer())
        await batches.start()
        try:
            graph.release.clear()
            first = asyncio.create_task(batches.infer(request([1.0])))
            await graph.started.wait()  # it runs at once: nothing else was in flight
            second = asyncio.create_task(batches.infer(request([1.0])))
            await asyncio.sleep(0.01)  # the lane takes it alone
            rest = [asyncio.create_task(batches.infer(r)) for r in waiting]
            await asyncio.sleep(0.01)
            graph.release.set()
            await asyncio.gather(first, second)
            return list(await asyncio.gather(*rest, return_exceptions=True))
        finally:
            await batches.stop()

    return asyncio.run(scenario())


def test_requests_that_wait_together_run_once_and_each_gets_its_own_rows() -> None:
    graph = Graph()
    answers = run_waves(graph, [request([2.0]), request([3.0, 4.0], ["Z"]), request([5.0], ["Y"])])
    assert graph.batches == [1, 1, 4]
    first, second, third = answers
    assert isinstance(first, InferResponse)
    assert isinstance(second, InferResponse)
    assert isinstance(third, InferResponse)
    np.testing.assert_allclose(first.outputs["Y"], [[20.0]])
    assert sorted(second.outputs) == ["Z"]  # only what it asked for
    np.testing.assert_allclose(second.outputs["Z"], [[4.0], [5.0]])
    assert sorted(third.outputs) == ["Y"]
    np.testing.assert_allclose(third.outputs["Y"], [[50.0]])


def test_one_callers_bad_data_fails_only_that_caller() -> None:
    graph = Graph()
    good, bad, fine = run_waves(graph, [request([2.0]), request([-1.0]), request([3.0])])
    assert graph.batches == [1, 1, 3, 1, 1, 1]  # the batch, then each alone
    assert isinstance(bad, InvalidArgument)
    assert "X must not be negative" in bad.message
    assert isinstance(good, InferResponse) and isinstance(fine, InferResponse)
    np.testing.assert_allclose(good.outputs["Y"], [[20.0]])
    np.testing.assert_allclose(fine.outputs["Y"], [[30.0]])


def test_outputs_that_are_not_per_row_make_each_request_run_alone() -> None:
    graph = Graph(per_row=False)
    one, two = run_waves(graph, [request([2.0]), request([3.0, 4.0])])
    assert graph.batches == [1, 1, 3, 1, 2]
    assert isinstance(one, InferResponse) and isinstance(two, InferResponse)
    np.testing.assert_allclose(one.outputs["TOTAL"], [2.0])
    np.testing.assert_allclose(two.outputs["TOTAL"], [7.0])


def test_a_failure_that_is_not_the_datas_reaches_every_caller_of_the_batch() -> None:
    async def down(request: InferRequest) -> InferResponse:
        raise Unavailable("model 'checked' version 1 is not ready")

    async def scenario() -> list[InferResponse | BaseException]:
        policy = ensemble_policy(ENSEMBLE, [WIDE], 1)
        assert isinstance(policy, BatchPolicy)
        batches = EnsembleBatches("pipe", policy, 1, down, trace.NoOpTracer())
        await batches.start()
        try:
            calls = [batches.infer(request([float(i)])) for i in range(3)]
            return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            await batches.stop()

    assert all(isinstance(answer, Unavailable) for answer in asyncio.run(scenario()))


def test_more_rows_than_the_narrowest_step_takes_are_refused() -> None:
    async def scenario() -> None:
        policy = ensemble_policy(ENSEMBLE, [NARROW], 1)
        assert isinstance(policy, BatchPolicy)
        graph = Graph()
        batches = EnsembleBatches("pipe", policy, 1, graph.run, trace.NoOpTracer())
        await batches.start()
        try:
            graph.release.clear()
            busy = asyncio.create_task(batches.infer(request([1.0])))
            await graph.started.wait()
            with pytest.raises(InvalidArgument, match="max_batch_size 4"):
                await batches.infer(request([1.0] * 5))
            graph.release.set()
            await busy
        finally:
            await batches.stop()

    asyncio.run(scenario())


def test_a_batchs_steps_are_traced_under_the_first_caller_and_linked_to_every_caller() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    graph = Graph()

    async def traced_run(request: InferRequest) -> InferResponse:
        # As the graph's steps do: a span per step, under whatever span is current.
        with tracer.start_as_current_span("ensemble step 0 checked"):
            return await graph.run(request)

    async def caller(batches: EnsembleBatches, name: str, value: float) -> int:
        with tracer.start_as_current_span(name) as span:
            await batches.infer(request([value]))
            return span.get_span_context().span_id

    async def scenario() -> list[int]:
        policy = ensemble_policy(ENSEMBLE, [WIDE], 1)
        assert isinstance(policy, BatchPolicy)
        batches = EnsembleBatches("pipe", policy, 1, traced_run, tracer)
        await batches.start()
        try:
            graph.release.clear()
            first = asyncio.create_task(caller(batches, "alone", 1.0))
            await graph.started.wait()  # runs at once, in its caller's task
            second = asyncio.create_task(caller(batches, "lane", 1.0))
            await asyncio.sleep(0.01)
            rest = [asyncio.create_task(caller(batches, f"waiting {i}", 2.0)) for i in range(3)]
            await asyncio.sleep(0.01)
            graph.release.set()
            return [await task for task in (first, second, *rest)]
        finally:
            await batches.stop()

    alone, lane, *waiting = asyncio.run(scenario())
    assert graph.batches == [1, 1, 3]
    spans = exporter.get_finished_spans()
    steps = [s for s in spans if s.name.startswith("ensemble step")]
    parents = sorted(s.parent.span_id for s in steps if s.parent is not None)
    (batch,) = [s for s in spans if s.name == "ensemble batch"]
    # A request run alone (at once, or alone in its lane): its step under its caller.
    assert len(steps) == 3
    assert parents == sorted([alone, lane, batch.context.span_id])
    # The batch: in the first waiting caller's trace, linked to all three callers.
    assert batch.parent is not None and batch.parent.span_id == waiting[0]
    assert sorted(link.context.span_id for link in batch.links) == sorted(waiting)
    assert batch.attributes is not None and batch.attributes["meshserve.batch_requests"] == 3
