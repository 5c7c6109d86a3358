"""Behaviour of the dynamic batcher, with fake model instances (no sockets, no threads)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import numpy as np
import pytest

from shared.batcher import BatchPolicy, BatchRecord, DynamicBatcher, QueuePolicy
from shared.errors import (
    ConfigError,
    InvalidArgument,
    Overloaded,
    RequestTimeout,
    Unavailable,
)
from shared.request import InferRequest, InferResponse

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 5.0) -> T:
    """Run one test coroutine on a fresh loop; a hang fails instead of blocking the suite."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


class FakeInstance:
    """Doubles its input, records every batch, and sleeps to let requests pile up."""

    def __init__(
        self,
        name: str = "fake",
        *,
        delay: float = 0.01,
        batched: bool = True,
        fail_ids: frozenset[str] = frozenset(),
        crash: Exception | None = None,
    ) -> None:
        self.name = name
        self.delay = delay
        self.batched = batched
        self.fail_ids = fail_ids
        self.crash = crash
        self.batches: list[list[str]] = []
        self.rows: list[int] = []
        self.shapes: list[set[tuple[int, ...]]] = []
        self.started: list[float] = []
        self.finished: list[float] = []

    async def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        self.started.append(time.monotonic())
        self.batches.append([request.id for request in requests])
        self.rows.append(sum(request.batch_size(self.batched) for request in requests))
        self.shapes.append({request.inputs["x"].shape[1:] for request in requests})
        await asyncio.sleep(self.delay)
        self.finished.append(time.monotonic())
        if self.crash is not None:
            raise self.crash
        return self._compute(requests)

    def _compute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        if not self.batched:
            return [InferResponse({"y": request.inputs["x"] * 2}) for request in requests]
        # One concatenated batch, split back by rows: a mix-up shows as wrong values.
        stacked = np.concatenate([request.inputs["x"] for request in requests]) * 2
        bounds = np.cumsum([request.batch_size(True) for request in requests])[:-1]
        results: list[InferResponse | Exception] = []
        for request, rows in zip(requests, np.split(stacked, bounds), strict=True):
            if request.id in self.fail_ids:
                results.append(InvalidArgument(f"bad input in {request.id}"))
            else:
                results.append(InferResponse({"y": rows}))
        return results


def make_request(
    request_id: str, rows: int = 1, width: int = 3, *, batched: bool = True, **fields: Any
) -> InferRequest:
    """A request whose values are unique to it, so a caller can spot foreign rows."""
    seed = sum(ord(c) * 31**i for i, c in enumerate(request_id)) % 10_000
    shape = (rows, width) if batched else (width,)
    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + seed * 1000
    return InferRequest("m", "1", {"x": values}, id=request_id, **fields)


@asynccontextmanager
async def serving(batcher: DynamicBatcher) -> AsyncIterator[DynamicBatcher]:
    await batcher.start()
    try:
        yield batcher
    finally:
        await batcher.stop(drain=False)


async def infer_and_check(batcher: DynamicBatcher, request: InferRequest) -> InferResponse:
    response = await batcher.infer(request)
    np.testing.assert_array_equal(response.outputs["y"], request.inputs["x"] * 2)
    return response


def spawn(batcher: DynamicBatcher, *requests: InferRequest) -> list[asyncio.Task[InferResponse]]:
    return [asyncio.create_task(infer_and_check(batcher, request)) for request in requests]


async def settle(seconds: float = 0.02) -> None:
    """Let queued tasks enqueue and workers dispatch."""
    await asyncio.sleep(seconds)


# -- batch formation ---------------------------------------------------------------


def test_concurrent_requests_share_batches_and_each_caller_gets_its_own_rows() -> None:
    instance = FakeInstance(delay=0.02)
    records: list[BatchRecord] = []
    policy = BatchPolicy(max_batch_size=8, dynamic_batching=True, max_queue_delay_us=20_000)
    requests = [make_request(f"r{i}", rows=1 + i % 3) for i in range(24)]

    async def scenario() -> None:
        batcher = DynamicBatcher(policy, [instance], name="m", on_batch=records.append)
        async with serving(batcher):
            await asyncio.gather(*spawn(batcher, *requests))

    run(scenario())
    assert max(len(batch) for batch in instance.batches) > 1
    assert max(instance.rows) <= 8
    assert sorted(i for batch in instance.batches for i in batch) == sorted(r.id for r in requests)
    assert sum(record.request_count for record in records) == len(requests)
    assert [record.batch_size for record in records] == instance.rows
    for request in requests:
        assert 0 < request.queue_start_ns <= request.compute_start_ns


def test_max_batch_size_is_never_exceeded_across_instances() -> None:
    instances = [FakeInstance("a", delay=0.01), FakeInstance("b", delay=0.015)]
    policy = BatchPolicy(max_batch_size=6, dynamic_batching=True, max_queue_delay_us=5_000)
    rng = np.random.default_rng(7)
    requests = [make_request(f"r{i}", rows=int(rng.integers(1, 6))) for i in range(40)]

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, instances, name="m")) as batcher:
            await asyncio.gather(*spawn(batcher, *requests))

    run(scenario())
    rows = instances[0].rows + instances[1].rows
    assert max(rows) <= 6 and sum(rows) == sum(r.batch_size(True) for r in requests)
    assert instances[0].batches and instances[1].batches


def test_request_with_more_rows_than_max_batch_size_is_rejected() -> None:
    policy = BatchPolicy(max_batch_size=4, dynamic_batching=True)

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, [FakeInstance()], name="m")) as batcher:
            with pytest.raises(InvalidArgument, match="batch size 5"):
                await batcher.infer(make_request("big", rows=5))

    run(scenario())


def test_preferred_sizes_are_sent_at_once_and_the_rest_waits_for_the_delay() -> None:
    instance = FakeInstance(delay=0.005)
    policy = BatchPolicy(
        max_batch_size=8,
        dynamic_batching=True,
        preferred_batch_sizes=(2, 4),
        max_queue_delay_us=300_000,
        queue_delay_policy="fixed",
    )

    async def scenario() -> float:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            start = time.monotonic()
            await asyncio.gather(*spawn(batcher, *(make_request(f"r{i}") for i in range(7))))
            return start

    start = run(scenario())
    # 7 queued: the largest preferred size (4) goes at once, then 2; the last one waits.
    assert instance.rows == [4, 2, 1]
    assert instance.started[1] - start < 0.15
    assert instance.started[2] - start >= 0.25


def test_queue_delay_counts_from_the_oldest_request_unless_the_batch_is_full() -> None:
    instance = FakeInstance(delay=0.005)
    policy = BatchPolicy(
        max_batch_size=4,
        dynamic_batching=True,
        max_queue_delay_us=200_000,
        queue_delay_policy="fixed",
    )

    async def scenario() -> float:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            start = time.monotonic()
            first = spawn(batcher, make_request("a"))
            await asyncio.sleep(0.05)
            await asyncio.gather(*first, *spawn(batcher, make_request("b")))
            full_start = time.monotonic()
            await asyncio.gather(*spawn(batcher, *(make_request(f"f{i}") for i in range(4))))
            assert instance.started[1] - full_start < 0.1  # full batch: no waiting
            return start

    start = run(scenario())
    assert instance.batches == [["a", "b"], ["f0", "f1", "f2", "f3"]]
    assert 0.18 <= instance.started[0] - start < 0.4


def test_adaptive_delay_runs_lone_requests_at_once_and_still_batches_overlapping_ones() -> None:
    instance = FakeInstance(delay=0.02)
    # A 30 s delay: a lone request that waited for company would hang the test.
    policy = BatchPolicy(max_batch_size=8, dynamic_batching=True, max_queue_delay_us=30_000_000)
    records: list[BatchRecord] = []

    async def scenario() -> None:
        batcher = DynamicBatcher(policy, [instance], name="m", on_batch=records.append)
        async with serving(batcher):
            for i in range(3):  # one in flight at a time
                await infer_and_check(batcher, make_request(f"lone{i}"))
            # Eight callers at once (all queued before the worker looks): they overlap.
            await asyncio.gather(*spawn(batcher, *(make_request(f"b{i}") for i in range(8))))

    run(scenario(), timeout=2.0)
    assert instance.batches == [["lone0"], ["lone1"], ["lone2"], [f"b{i}" for i in range(8)]]
    assert all(max(record.queue_ns) < 1e9 for record in records)


def test_a_batch_gathered_upstream_goes_at_once_and_takes_the_waiting_along() -> None:
    instance = FakeInstance(delay=0.005)
    # Triton's fixed 30 s delay: an ordinary partial batch sits it out.
    policy = BatchPolicy(
        max_batch_size=8,
        dynamic_batching=True,
        max_queue_delay_us=30_000_000,
        queue_delay_policy="fixed",
    )

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            await infer_and_check(batcher, make_request("g1", rows=3, gathered=True))
            waiting = spawn(batcher, make_request("o"))
            await settle(0.05)
            assert instance.batches == [["g1"]]  # the ordinary one waits for company
            await infer_and_check(batcher, make_request("g2", rows=2, gathered=True))
            await asyncio.gather(*waiting)

    run(scenario(), timeout=2.0)
    assert instance.batches == [["g1"], ["o", "g2"]]
    assert instance.rows == [3, 3]


@pytest.mark.parametrize("instances", [1, 2])
def test_batches_gathered_upstream_run_apart_where_there_are_instances_for_them(
    instances: int,
) -> None:
    """An ensemble's lanes (one per instance of its widest step, and one more) each
    bring a batch: with two instances two lanes' batches merged would leave one
    idle, so each runs as it came; with one instance they still merge."""
    fakes = [FakeInstance(f"i{n}", delay=0.05) for n in range(instances)]
    policy = BatchPolicy(max_batch_size=16, dynamic_batching=True, max_queue_delay_us=1000)
    lanes = [make_request(f"g{i}", rows=3, gathered=True) for i in range(4)]
    ordinary = make_request("o", rows=1)

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, fakes, name="m")) as batcher:
            # All queued before a worker looks: the lanes, an ordinary request among them.
            await asyncio.gather(*spawn(batcher, lanes[0], ordinary, *lanes[1:]))

    run(scenario())
    batches = sorted(batch for fake in fakes for batch in fake.batches)
    if instances == 1:
        assert batches == [["g0", "o", "g1", "g2", "g3"]]
    else:
        # The ordinary request still joins a lane's batch; no two lanes share one.
        assert batches == [["g0", "o"], ["g1"], ["g2"], ["g3"]]
        assert all(fake.batches for fake in fakes)  # both instances ran


def test_incompatible_shapes_never_share_a_batch() -> None:
    instance = FakeInstance(delay=0.01)
    policy = BatchPolicy(max_batch_size=16, dynamic_batching=True, max_queue_delay_us=20_000)
    requests = [make_request(f"r{i}", rows=2, width=3 + i % 2) for i in range(12)]

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            await asyncio.gather(*spawn(batcher, *requests))

    run(scenario())
    assert all(len(shapes) == 1 for shapes in instance.shapes)
    assert sum(len(batch) for batch in instance.batches) == len(requests)


@pytest.mark.parametrize(
    "policy",
    [
        BatchPolicy(max_batch_size=0, dynamic_batching=True, max_queue_delay_us=50_000),
        BatchPolicy(max_batch_size=8, dynamic_batching=False),
    ],
    ids=["max_batch_size_0", "dynamic_batching_off"],
)
def test_without_batching_each_request_runs_alone(policy: BatchPolicy) -> None:
    batched = policy.max_batch_size > 0
    instance = FakeInstance(delay=0.005, batched=batched)
    requests = [make_request(f"r{i}", batched=batched) for i in range(6)]

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            await asyncio.gather(*spawn(batcher, *requests))

    run(scenario())
    assert instance.batches == [[request.id] for request in requests]


class QuickFake(FakeInstance):
    """Runs requests whose id starts with "quick" at once (execute_now); the rest
    the usual way, in execute."""

    def __init__(self) -> None:
        super().__init__(delay=0.05, batched=False)
        self.now: list[list[str]] = []

    def execute_now(self, requests: list[InferRequest]) -> list[InferResponse | Exception] | None:
        if not all(request.id.startswith("quick") for request in requests):
            return None
        self.now.append([request.id for request in requests])
        return self._compute(requests)


def test_a_cheap_request_with_nothing_ahead_runs_at_once_in_the_callers_task() -> None:
    instance = QuickFake()
    records: list[BatchRecord] = []
    policy = BatchPolicy(max_batch_size=0)

    async def scenario() -> None:
        batcher = DynamicBatcher(policy, [instance], name="m", on_batch=records.append)
        async with serving(batcher):
            await infer_and_check(batcher, make_request("quick-1", batched=False))
            # An expensive request goes through the queue; while it runs, the instance
            # is busy, so a cheap one queues behind it instead of cutting in.
            slow = spawn(batcher, make_request("slow", batched=False))
            await settle(0.01)
            quick = spawn(batcher, make_request("quick-2", batched=False))
            await asyncio.gather(*slow, *quick)

    run(scenario())
    assert instance.now == [["quick-1"]]
    assert instance.batches == [["slow"], ["quick-2"]]
    assert [(r.instance, r.request_count, r.batch_size) for r in records] == [("fake", 1, 1)] * 3


# -- priorities, bounds and timeouts -------------------------------------------------


def test_higher_priority_requests_are_served_first() -> None:
    instance = FakeInstance(delay=0.05)
    policy = BatchPolicy(
        max_batch_size=4, dynamic_batching=True, priority_levels=2, default_priority_level=2
    )

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            blocker = spawn(batcher, make_request("blocker", rows=4))
            await settle()
            low = spawn(batcher, *(make_request(f"low{i}", rows=2) for i in range(2)))
            high = spawn(batcher, *(make_request(f"hi{i}", rows=2, priority=1) for i in range(2)))
            await asyncio.gather(*blocker, *low, *high)
            with pytest.raises(InvalidArgument, match="priority"):
                await batcher.infer(make_request("bad", priority=3))

    run(scenario())
    assert instance.batches == [["blocker"], ["hi0", "hi1"], ["low0", "low1"]]


def test_full_queue_rejects_at_once_with_overloaded() -> None:
    policy = BatchPolicy(
        max_batch_size=1,
        dynamic_batching=True,
        default_queue_policy=QueuePolicy(max_queue_size=2),
    )

    async def scenario() -> float:
        batcher = DynamicBatcher(policy, [FakeInstance(delay=0.3)], name="resnet")
        async with serving(batcher):
            spawn(batcher, make_request("running"))
            await settle()
            queued = spawn(batcher, make_request("q1"), make_request("q2"))
            await settle()
            assert batcher.pending == 2 and batcher.in_flight == 3
            start = time.monotonic()
            with pytest.raises(Overloaded, match=r"resnet.*max_queue_size 2"):
                await batcher.infer(make_request("q3"))
            elapsed = time.monotonic() - start
            await asyncio.gather(*queued)  # the queued ones still run
            return elapsed

    assert run(scenario()) < 0.05


def test_a_burst_counts_the_request_an_idle_instance_takes_as_running() -> None:
    # Four requests arrive together, before the worker has taken any: the idle
    # instance takes the first, so two wait and only the fourth is refused.
    policy = BatchPolicy(
        max_batch_size=1,
        dynamic_batching=True,
        default_queue_policy=QueuePolicy(max_queue_size=2),
    )

    async def scenario() -> list[object]:
        batcher = DynamicBatcher(policy, [FakeInstance(delay=0.1)], name="resnet")
        async with serving(batcher):
            names = ("first", "q1", "q2", "over")
            burst = [batcher.infer(make_request(name)) for name in names]
            return await asyncio.gather(*burst, return_exceptions=True)

    outcomes = run(scenario())
    assert [isinstance(o, Overloaded) for o in outcomes] == [False, False, False, True]


def test_timed_out_request_is_rejected_promptly_with_reject() -> None:
    instance = FakeInstance(delay=0.5)
    policy = BatchPolicy(
        max_batch_size=1,
        dynamic_batching=True,
        default_queue_policy=QueuePolicy(default_timeout_us=200_000, allow_timeout_override=True),
    )

    async def scenario() -> tuple[float, float]:
        async with serving(DynamicBatcher(policy, [instance], name="bert")) as batcher:
            spawn(batcher, make_request("running"))
            await settle()
            start = time.monotonic()
            default = asyncio.create_task(batcher.infer(make_request("default")))
            with pytest.raises(RequestTimeout, match=r"bert.*100000 us"):
                await batcher.infer(make_request("short", timeout_us=100_000))
            short = time.monotonic() - start
            with pytest.raises(RequestTimeout, match="200000 us"):
                await default
            return short, time.monotonic() - start

    short, default = run(scenario())
    assert 0.08 <= short < 0.18  # override shortens the timeout, well before the instance frees
    assert 0.18 <= default < 0.4
    assert instance.batches == [["running"]]


def test_timed_out_request_with_delay_moves_last_and_still_runs() -> None:
    # The running batch must still run when "normal" arrives: a wide margin over
    # the 0.06 s wait, since a loaded CI host can stall the loop for a tenth of a second.
    instance = FakeInstance(delay=0.5, batched=True)
    policy = BatchPolicy(
        max_batch_size=1,
        dynamic_batching=True,
        priority_levels=2,
        default_priority_level=2,
        priority_queue_policy={1: QueuePolicy(timeout_action="DELAY", default_timeout_us=30_000)},
    )

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            running = spawn(batcher, make_request("running"))
            await settle()
            urgent = spawn(batcher, make_request("urgent", priority=1))
            await asyncio.sleep(0.06)  # past its timeout: it now ranks behind everything
            normal = spawn(batcher, make_request("normal", priority=2))
            await asyncio.gather(*running, *urgent, *normal)

    run(scenario())
    assert instance.batches == [["running"], ["normal"], ["urgent"]]


# -- delivery --------------------------------------------------------------------------


@pytest.mark.parametrize("preserve", [True, False])
def test_preserve_ordering_across_instances_of_different_speeds(preserve: bool) -> None:
    slow, fast = FakeInstance("slow", delay=0.2), FakeInstance("fast", delay=0.01)
    policy = BatchPolicy(max_batch_size=1, dynamic_batching=True, preserve_ordering=preserve)
    delivered: list[str] = []

    async def call(batcher: DynamicBatcher, request: InferRequest) -> None:
        await infer_and_check(batcher, request)
        delivered.append(request.id)

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, [slow, fast], name="m")) as batcher:
            await asyncio.gather(*(call(batcher, make_request(f"r{i}")) for i in range(4)))

    run(scenario())
    assert slow.batches[0] == ["r0"] and fast.batches  # later requests finished first
    assert fast.finished[0] < slow.finished[0]
    if preserve:
        assert delivered == ["r0", "r1", "r2", "r3"]
    else:
        assert delivered[-1] == "r0"


def test_cancelled_caller_does_not_hold_back_later_ordered_responses() -> None:
    slow, fast = FakeInstance("slow", delay=0.3), FakeInstance("fast", delay=0.01)
    policy = BatchPolicy(max_batch_size=1, dynamic_batching=True, preserve_ordering=True)

    async def scenario() -> float:
        async with serving(DynamicBatcher(policy, [slow, fast], name="m")) as batcher:
            first, second = spawn(batcher, make_request("r0"), make_request("r1"))
            await asyncio.sleep(0.1)
            assert not second.done()  # r1 is computed but waits behind r0
            first.cancel()
            start = time.monotonic()
            await second
            return time.monotonic() - start

    assert run(scenario()) < 0.1


def test_per_request_error_reaches_only_its_caller() -> None:
    instance = FakeInstance(delay=0.02, fail_ids=frozenset({"bad"}))
    policy = BatchPolicy(max_batch_size=8, dynamic_batching=True, max_queue_delay_us=20_000)

    async def scenario() -> list[InferResponse | BaseException]:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            ids = ["ok0", "bad", "ok1"]
            return await asyncio.gather(
                *spawn(batcher, *(make_request(i) for i in ids)), return_exceptions=True
            )

    results = run(scenario())
    assert instance.batches == [["ok0", "bad", "ok1"]]
    assert isinstance(results[0], InferResponse) and isinstance(results[2], InferResponse)
    assert isinstance(results[1], InvalidArgument)


def test_failed_execute_fails_every_request_of_the_batch() -> None:
    instance = FakeInstance(delay=0.01, crash=RuntimeError("GPU fell off"))
    policy = BatchPolicy(max_batch_size=8, dynamic_batching=True, max_queue_delay_us=20_000)

    async def scenario() -> list[InferResponse | BaseException]:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            tasks = spawn(batcher, make_request("a"), make_request("b"))
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(scenario())
    assert instance.batches == [["a", "b"]]
    assert all(isinstance(r, RuntimeError) and "GPU" in str(r) for r in results)


def test_cancelled_queued_request_is_removed_and_never_runs() -> None:
    instance = FakeInstance(delay=0.1)
    policy = BatchPolicy(max_batch_size=1, dynamic_batching=True, preserve_ordering=True)

    async def scenario() -> None:
        async with serving(DynamicBatcher(policy, [instance], name="m")) as batcher:
            running = spawn(batcher, make_request("running"))
            await settle()
            doomed, kept = spawn(batcher, make_request("doomed"), make_request("kept"))
            await settle(0.005)
            assert batcher.pending == 2
            doomed.cancel()
            await settle(0.005)
            assert batcher.pending == 1
            await asyncio.gather(*running, kept)
            assert doomed.cancelled()

    run(scenario())
    assert instance.batches == [["running"], ["kept"]]


# -- lifecycle and parallelism ---------------------------------------------------------


def test_stop_with_drain_finishes_queued_work_then_refuses_new_work() -> None:
    instance = FakeInstance(delay=0.03)
    policy = BatchPolicy(max_batch_size=2, dynamic_batching=True, max_queue_delay_us=500_000)

    async def scenario() -> None:
        batcher = DynamicBatcher(policy, [instance], name="tok")
        await batcher.start()
        tasks = spawn(batcher, *(make_request(f"r{i}") for i in range(5)))
        await settle(0.005)
        await batcher.stop(drain=True)  # also skips the queue delay of the last odd request
        assert batcher.in_flight == 0
        await asyncio.gather(*tasks)  # every queued request got its response
        with pytest.raises(Unavailable, match="'tok' is stopping"):
            await batcher.infer(make_request("late"))

    start = time.monotonic()
    run(scenario())
    assert time.monotonic() - start < 0.4
    assert sorted(i for batch in instance.batches for i in batch) == [f"r{i}" for i in range(5)]


def test_stop_without_drain_fails_queued_and_running_requests() -> None:
    instance = FakeInstance(delay=0.5)
    policy = BatchPolicy(max_batch_size=1, dynamic_batching=True)

    async def scenario() -> list[InferResponse | BaseException]:
        batcher = DynamicBatcher(policy, [instance], name="m")
        await batcher.start()
        tasks = [asyncio.create_task(batcher.infer(make_request(f"r{i}"))) for i in range(3)]
        await settle()
        await batcher.stop(drain=False)
        return await asyncio.gather(*tasks, return_exceptions=True)

    start = time.monotonic()
    results = run(scenario())
    assert time.monotonic() - start < 0.3
    assert all(isinstance(result, Unavailable) for result in results)
    assert instance.batches == [["r0"]]


def test_instances_execute_in_parallel() -> None:
    instances = [FakeInstance("a", delay=0.2), FakeInstance("b", delay=0.2)]
    policy = BatchPolicy(max_batch_size=2, dynamic_batching=True)

    async def scenario() -> float:
        async with serving(DynamicBatcher(policy, instances, name="m")) as batcher:
            start = time.monotonic()
            first = spawn(batcher, make_request("a0", rows=2))
            await asyncio.sleep(0)  # let "a0" take the first instance alone
            await asyncio.gather(*first, *spawn(batcher, make_request("b0", rows=2)))
            return time.monotonic() - start

    elapsed = run(scenario())
    assert 0.19 <= elapsed < 0.35  # two batches in about one batch time, not two
    assert instances[0].batches and instances[1].batches


# -- configuration ---------------------------------------------------------------------

ConfigCase = Callable[[], object]


@pytest.mark.parametrize(
    ("build", "field_name"),
    [
        (lambda: BatchPolicy(max_batch_size=-1), "max_batch_size"),
        (lambda: BatchPolicy(max_batch_size=4, preferred_batch_sizes=(8,)), "preferred"),
        (lambda: BatchPolicy(max_queue_delay_us=-5), "max_queue_delay_us"),
        (lambda: BatchPolicy(queue_delay_policy="triton"), "queue_delay_policy"),  # type: ignore[arg-type]
        (lambda: BatchPolicy(priority_levels=2, default_priority_level=3), "default_priority"),
        (lambda: BatchPolicy(default_priority_level=1), "default_priority_level"),
        (
            lambda: BatchPolicy(
                priority_levels=2,
                default_priority_level=1,
                priority_queue_policy={3: QueuePolicy()},
            ),
            "priority_queue_policy",
        ),
        (lambda: QueuePolicy(timeout_action="DROP"), "timeout_action"),  # type: ignore[arg-type]
        (lambda: QueuePolicy(max_queue_size=-1), "max_queue_size"),
    ],
)
def test_invalid_policy_is_a_config_error_naming_the_field(
    build: ConfigCase, field_name: str
) -> None:
    with pytest.raises(ConfigError, match=field_name):
        build()


def test_policy_is_frozen_and_hashable() -> None:
    policy = BatchPolicy(
        priority_levels=2, default_priority_level=1, priority_queue_policy={2: QueuePolicy()}
    )
    with pytest.raises(TypeError):
        policy.priority_queue_policy[1] = QueuePolicy()  # type: ignore[index]
    assert hash(policy) == hash(
        BatchPolicy(priority_levels=2, default_priority_level=1, priority_queue_policy={})
    )


def test_infer_before_start_is_unavailable() -> None:
    async def scenario() -> None:
        batcher = DynamicBatcher(BatchPolicy(), [FakeInstance()], name="m")
        with pytest.raises(Unavailable, match="not started"):
            await batcher.infer(make_request("r"))

    run(scenario())
