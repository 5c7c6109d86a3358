"""Dynamic batching with NVIDIA Triton's semantics, in pure asyncio.

Every stage service puts the instances of a model behind one ``DynamicBatcher``.
The request path, one line per step::

    infer()      validate priority and rows, bound the level's queue, arm the timeout
    queues       one FIFO per priority level (1 is highest), then the DELAYed requests
    worker       one per instance; a free instance plans the next batch and runs it
    execute()    the instance computes off the event loop, one result per request
    delivery     each caller gets its own result (in arrival order if preserve_ordering)

Without dynamic batching, a request that finds nothing queued and an idle
instance that calls it cheap (an ``ImmediateInstance``: a tokenizer's short text,
a small model measured cheap by ``shared/inline_budget.py``) skips the queue: it
runs at once in the caller's task, which saves the worker's wake-up and the
future's hand-off, a sizeable share of a short stage message (docs/performance.md).

Batch planning follows Triton's ``GetDynamicBatch``: walk the queues in priority
order from the head and keep requests while they have the head's shape key and the
rows fit ``max_batch_size``; the first request that does not fit closes the batch
(requests are never skipped, so nothing behind it overtakes it). Then:

- if the rows of some prefix equal a preferred size, send the largest such prefix now;
- if the rows pass the largest preferred size, send what fits in it now;
- if the batch is closed or holds ``max_batch_size`` rows, send it now;
- otherwise wait for more requests, then send what is there: with the ``fixed``
  queue delay policy (Triton's) until ``max_queue_delay_us`` after the oldest queued
  request's arrival; with ``adaptive`` (the default) only while requests arrive
  together, never longer (``shared/batch_delay.py``). A ``gathered`` request (a
  batch formed upstream: nothing more of its traffic is on the way) goes at once,
  and where there is more than one instance it shares a batch with no other
  gathered one (``_gather``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from shared.batch_delay import BatchDelay
from shared.batch_policy import BatchPolicy, QueuePolicy
from shared.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    Overloaded,
    RequestTimeout,
    Unavailable,
)
from shared.request import InferRequest, InferResponse

__all__ = [
    "BatchPolicy",
    "BatchRecord",
    "DynamicBatcher",
    "ImmediateInstance",
    "ModelInstance",
    "QueuePolicy",
]

_log = logging.getLogger(__name__)

_Outcome: TypeAlias = InferResponse | BaseException


@dataclass(frozen=True)
class BatchRecord:
    """One executed batch, for statistics and metrics."""

    model: str
    instance: str
    batch_size: int
    """Rows in the batch (dim 0 summed over its requests)."""
    request_count: int
    queue_ns: tuple[int, ...]
    """Per request, in batch order: time from enqueue to dispatch."""
    compute_ns: int
    errors: int
    """Requests of the batch that got an exception instead of a response."""


class ModelInstance(Protocol):
    """One copy of a loaded model; ``execute`` keeps heavy compute off the event loop."""

    name: str

    async def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Run one batch: one response, or one per-request error, per request, in order."""
        ...


@runtime_checkable
class ImmediateInstance(Protocol):
    """An instance that can run a cheap batch right away, on the event loop."""

    name: str

    def execute_now(self, requests: list[InferRequest]) -> list[InferResponse | Exception] | None:
        """The batch's results, computed here and now; None when it is not cheap."""
        ...


@dataclass(eq=False)
class _Entry:
    """A queued or executing request and the future its caller awaits."""

    request: InferRequest
    future: asyncio.Future[InferResponse]
    level: int
    """0-based index into the level queues."""
    rows: int
    key: tuple[Any, ...]
    timeout_us: int
    queue: deque[_Entry] | None = None
    """The deque it waits in; None once dispatched or removed."""
    timer: asyncio.TimerHandle | None = None
    outcome: _Outcome | None = None
    """Held result when responses are released in arrival order."""


def _resolve(entry: _Entry, outcome: _Outcome) -> None:
    if entry.future.done():  # the caller went away
        return
    if isinstance(outcome, BaseException):
        entry.future.set_exception(outcome)
    else:
        entry.future.set_result(outcome)


class DynamicBatcher:
    """Queues one model's requests and runs them in batches on its instances."""

    def __init__(
        self,
        policy: BatchPolicy,
        instances: Sequence[ModelInstance],
        *,
        name: str,
        on_batch: Callable[[BatchRecord], None] | None = None,
        on_pending: Callable[[int], None] | None = None,
    ) -> None:
        if not instances:
            raise ConfigError(f"model '{name}': at least one instance is required")
        self.name = name
        self._policy = policy
        self._instances = tuple(instances)
        self._on_batch = on_batch
        self._on_pending = on_pending
        self._batched = policy.max_batch_size > 0
        self._combine = self._batched and policy.dynamic_batching
        self._preferred = frozenset(policy.preferred_batch_sizes)
        self._max_preferred = max(policy.preferred_batch_sizes, default=0)
        self._delay = BatchDelay(policy.queue_delay_policy, policy.max_queue_delay_us)
        # Queues in dispatch order: one per level, then the requests timed out with DELAY.
        self._levels: list[deque[_Entry]] = [deque() for _ in range(policy.level_count)]
        self._delayed: deque[_Entry] = deque()
        self._level_sizes = [0] * policy.level_count
        self._order: deque[_Entry] = deque()  # arrival order, used with preserve_ordering
        self._executing = 0
        self._busy: set[int] = set()  # ids of the instances running a batch
        # Instances a request may run on at once: when nothing waits and, where batches
        # are combined, requests are seen to come alone (BatchDelay.waits_for_company).
        self._immediate = tuple(i for i in self._instances if isinstance(i, ImmediateInstance))
        self._wakeup = asyncio.Event()  # the queue changed: replan
        self._planning = asyncio.Lock()  # one free worker plans at a time
        self._workers: list[asyncio.Task[None]] = []
        self._started = False
        self._stopping = False

    @property
    def pending(self) -> int:
        """Requests queued and not yet executing."""
        return sum(self._level_sizes)

    @property
    def in_flight(self) -> int:
        """Requests queued or executing."""
        return self.pending + self._executing

    async def start(self) -> None:
        """Start one worker task per instance."""
        if self._stopping:
            raise FailedPrecondition(f"model '{self.name}': the batcher was stopped")
        if self._started:
            return
        self._started = True
        for instance in self._instances:
            task = asyncio.create_task(
                self._work(instance), name=f"batcher {self.name}/{instance.name}"
            )
            task.add_done_callback(self._worker_done)
            self._workers.append(task)

    async def infer(self, request: InferRequest) -> InferResponse:
        """Queue ``request``, wait until its batch has run, and return its response."""
        waits = self._combine and self._delay.waits_for_company() and not request.gathered
        if self._immediate and not waits:
            outcome = self._run_now(request)
            if isinstance(outcome, BaseException):
                raise outcome
            if outcome is not None:
                return outcome
        entry = self._admit(request)
        try:
            return await entry.future
        except asyncio.CancelledError:
            self._withdraw(entry)  # a queued request must not execute for nobody
            raise

    async def stop(self, drain: bool = True) -> None:
        """Refuse new requests; finish (drain) or fail the queued ones; end the workers."""
        self._stopping = True
        if not drain:
            self._fail_queued()
        self._wakeup.set()
        try:
            if drain and self._workers:
                await asyncio.wait(self._workers)
        finally:
            for task in self._workers:
                task.cancel()
            if self._workers:
                await asyncio.wait(self._workers)
            self._workers.clear()
            self._fail_queued()

    # -- admission -------------------------------------------------------------

    def _admissible(self, request: InferRequest) -> tuple[int, int]:
        """The request's queue level and rows; raises what a caller must hear."""
        if self._stopping:
            raise Unavailable(f"model '{self.name}' is stopping")
        if not self._started:
            raise Unavailable(f"model '{self.name}' is not started")
        level = self._level_of(request)
        rows = max(1, request.batch_size(self._batched))
        if self._batched and rows > self._policy.max_batch_size:
            raise InvalidArgument(
                f"model '{self.name}': batch size {rows} exceeds max_batch_size "
                f"{self._policy.max_batch_size}"
            )
        return level, rows

    def _run_now(self, request: InferRequest) -> _Outcome | None:
        """Run ``request`` in the caller's task when nothing waits ahead of it and an
        idle instance finds it cheap; None to queue it as usual."""
        if self.pending or self._order:
            return None  # FIFO and arrival order stay as they are
        _, rows = self._admissible(request)
        for instance in self._immediate:
            if id(instance) in self._busy:
                continue
            start_ns = time.monotonic_ns()
            request.queue_start_ns = request.compute_start_ns = start_ns
            try:
                results = instance.execute_now([request])  # type: ignore[attr-defined]
            except Exception as error:
                results = [error]
            if results is None:
                return None
            if self._combine:  # it arrived all the same: the delay learns from it
                self._delay.arrived(start_ns, company=self.in_flight > 0)
            if self._on_batch is not None:
                record = BatchRecord(
                    self.name,
                    instance.name,
                    rows,
                    1,
                    (0,),
                    time.monotonic_ns() - start_ns,
                    sum(isinstance(r, BaseException) for r in results),
                )
                self._record(self._on_batch, record)
            if len(results) != 1:
                return MeshError(
                    f"model '{self.name}': instance {instance.name} returned "
                    f"{len(results)} results for 1 request"
                )
            return results[0]
        return None

    def _admit(self, request: InferRequest) -> _Entry:
        level, rows = self._admissible(request)
        policy = self._policy.queue_policy(level + 1)
        if policy.max_queue_size and self._waiting(level) >= policy.max_queue_size:
            raise Overloaded(
                f"model '{self.name}': queue is full (max_queue_size {policy.max_queue_size}"
                f" at priority level {level + 1})"
            )
        loop = asyncio.get_running_loop()
        key, timeout_us = request.shape_key(self._batched), self._timeout_us(request, policy)
        entry = _Entry(request, loop.create_future(), level, rows, key, timeout_us)
        request.queue_start_ns = time.monotonic_ns()
        if self._combine:
            self._delay.arrived(request.queue_start_ns, company=self.in_flight > 0)
        self._push(self._levels[level], entry)
        self._level_sizes[level] += 1
        self._pending_changed()
        if entry.timeout_us:
            entry.timer = loop.call_later(entry.timeout_us / 1e6, self._on_timeout, entry)
        if self._policy.preserve_ordering:
            self._order.append(entry)
        self._wakeup.set()
        return entry

    def _waiting(self, level: int) -> int:
        """Requests at ``level`` that will wait for an instance: those queued, less the
        ones that idle instances take as soon as their workers run (a burst that
        arrives at once is all queued before any worker has taken its first)."""
        idle = len(self._instances) - len(self._busy)
        taken_first = self.pending - self._level_sizes[level]  # other levels' requests
        return self._level_sizes[level] - max(0, idle - taken_first)

    def _level_of(self, request: InferRequest) -> int:
        """The 0-based queue index of ``request``'s priority."""
        count = self._policy.level_count
        if not 0 <= request.priority <= count:
            raise InvalidArgument(
                f"model '{self.name}': priority {request.priority} is out of range 0..{count}"
                " (1 is the highest, 0 the model's default)"
            )
        level = request.priority or self._policy.default_priority_level or 1
        return level - 1

    @staticmethod
    def _timeout_us(request: InferRequest, policy: QueuePolicy) -> int:
        # Triton: an override may shorten the default timeout, never lengthen it.
        timeout = policy.default_timeout_us
        asked = request.timeout_us
        if policy.allow_timeout_override and asked > 0 and (timeout == 0 or asked < timeout):
            timeout = asked
        return timeout

    # -- queue bookkeeping -----------------------------------------------------

    @staticmethod
    def _push(queue: deque[_Entry], entry: _Entry) -> None:
        queue.append(entry)
        entry.queue = queue

    def _pending_changed(self) -> None:
        if self._on_pending is not None:
            self._on_pending(self.pending)

    def _queued(self) -> Iterator[_Entry]:
        return itertools.chain(*self._levels, self._delayed)

    def _unqueue(self, entry: _Entry) -> None:
        assert entry.queue is not None
        entry.queue.remove(entry)
        entry.queue = None
        self._level_sizes[entry.level] -= 1
        self._pending_changed()
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def _on_timeout(self, entry: _Entry) -> None:
        entry.timer = None
        if entry.queue is None:
            return
        policy = self._policy.queue_policy(entry.level + 1)
        if policy.timeout_action == "DELAY":
            entry.queue.remove(entry)
            self._push(self._delayed, entry)
        else:
            self._unqueue(entry)
            message = f"request timed out after {entry.timeout_us} us in the queue"
            self._fail(entry, RequestTimeout(f"model '{self.name}': {message}"))
        self._wakeup.set()

    def _withdraw(self, entry: _Entry) -> None:
        if entry.future.done() and not entry.future.cancelled():
            entry.future.exception()  # resolved as the caller left: nobody will read it
        if entry.queue is not None:
            self._unqueue(entry)
            self._wakeup.set()
        self._release_in_order()

    def _fail_queued(self) -> None:
        for entry in list(self._queued()):
            self._unqueue(entry)
            self._fail(entry, Unavailable(f"model '{self.name}' is stopping"))

    # -- batch planning --------------------------------------------------------

    async def _next_batch(self) -> list[_Entry] | None:
        """Wait for and take the next batch; None once stopping with nothing queued."""
        async with self._planning:
            while True:
                self._wakeup.clear()
                plan = self._plan(time.monotonic_ns())
                if isinstance(plan, list):
                    self._dispatch(plan)
                    return plan
                if plan is None and self._stopping:
                    return None
                try:
                    async with asyncio.timeout(plan):
                        await self._wakeup.wait()
                except TimeoutError:
                    pass

    def _plan(self, now_ns: int) -> list[_Entry] | float | None:
        """The batch to send now, or seconds to wait for a better one (None: until woken)."""
        # A cancelled caller's entry may linger until its task runs; never send it.
        candidates = (entry for entry in self._queued() if not entry.future.done())
        head = next(candidates, None)
        if head is None:
            return None
        if not self._combine:
            return [head]
        batch, rows, closed = self._gather(head, candidates)
        cut = self._preferred_cut(batch)
        if cut:
            return batch[:cut]
        if closed or self._stopping or rows >= self._policy.max_batch_size:
            return batch
        if any(entry.request.gathered for entry in batch):
            return batch  # a batch formed upstream: what would join it is already in it
        heads = (queue[0] for queue in (*self._levels, self._delayed) if queue)
        oldest_ns = min(entry.request.queue_start_ns for entry in heads)
        wait_ns = self._delay.deadline_ns(oldest_ns) - now_ns
        return batch if wait_ns <= 0 else wait_ns / 1e9

    def _gather(self, head: _Entry, rest: Iterator[_Entry]) -> tuple[list[_Entry], int, bool]:
        """The longest run from ``head`` that shares its shape and fits; closed if cut.

        Where there is more than one instance, a run holds one batch gathered
        upstream at most: an ensemble runs a batch per instance of its widest
        step and one more (services/orchestrator/ensemble_batches.py), and two
        of them merged would run on one instance while another has none.
        """
        batch, rows = [head], head.rows
        apart = len(self._instances) > 1
        gathered = apart and head.request.gathered
        for entry in rest:
            if entry.key != head.key or rows + entry.rows > self._policy.max_batch_size:
                return batch, rows, True
            if apart and entry.request.gathered:
                if gathered:
                    return batch, rows, True
                gathered = True
            batch.append(entry)
            rows += entry.rows
        return batch, rows, False

    def _preferred_cut(self, batch: list[_Entry]) -> int:
        """How many requests to send now for a preferred size; 0 to decide otherwise."""
        if not self._preferred:
            return 0
        rows = best = fits = 0
        for count, entry in enumerate(batch, start=1):
            rows += entry.rows
            if rows in self._preferred:
                best = count
            if rows <= self._max_preferred:
                fits = count
        if best:
            return best
        if rows > self._max_preferred:  # past every preferred size: send what fits the largest
            return max(fits, 1)
        return 0

    def _dispatch(self, batch: list[_Entry]) -> None:
        now_ns = time.monotonic_ns()
        for entry in batch:
            self._unqueue(entry)
            entry.request.compute_start_ns = now_ns
        self._executing += len(batch)

    # -- execution and delivery ------------------------------------------------

    async def _work(self, instance: ModelInstance) -> None:
        while (batch := await self._next_batch()) is not None:
            await self._execute(instance, batch)

    async def _execute(self, instance: ModelInstance, batch: list[_Entry]) -> None:
        start_ns = time.monotonic_ns()
        self._busy.add(id(instance))
        try:
            results = await self._call(instance, batch)
        except asyncio.CancelledError:
            stopped = Unavailable(f"model '{self.name}' stopped before the request finished")
            for entry in batch:
                self._fail(entry, stopped)
            raise
        finally:
            self._busy.discard(id(instance))
            self._executing -= len(batch)
        compute_ns = time.monotonic_ns() - start_ns
        for entry, outcome in zip(batch, results, strict=True):
            self._complete(entry, outcome)
        if self._on_batch is not None:
            self._report(self._on_batch, instance.name, batch, results, compute_ns)

    async def _call(self, instance: ModelInstance, batch: list[_Entry]) -> Sequence[_Outcome]:
        """Run the batch; a failure of the whole call becomes every request's error."""
        try:
            results = await instance.execute([entry.request for entry in batch])
        except Exception as error:
            return [error] * len(batch)
        if len(results) != len(batch):
            mismatch = MeshError(
                f"model '{self.name}': instance {instance.name} returned {len(results)} "
                f"results for {len(batch)} requests"
            )
            return [mismatch] * len(batch)
        return results

    def _complete(self, entry: _Entry, outcome: _Outcome) -> None:
        if self._policy.preserve_ordering:
            entry.outcome = outcome
            self._release_in_order()
        else:
            _resolve(entry, outcome)

    def _fail(self, entry: _Entry, error: BaseException) -> None:
        """Fail at once, even with preserve_ordering: errors are not held back."""
        _resolve(entry, error)
        self._release_in_order()

    def _release_in_order(self) -> None:
        order = self._order
        while order and (order[0].future.done() or order[0].outcome is not None):
            entry = order.popleft()
            if entry.outcome is not None:
                _resolve(entry, entry.outcome)

    def _report(
        self,
        on_batch: Callable[[BatchRecord], None],
        instance: str,
        batch: list[_Entry],
        results: Sequence[_Outcome],
        compute_ns: int,
    ) -> None:
        waits = (entry.request.compute_start_ns - entry.request.queue_start_ns for entry in batch)
        errors = sum(isinstance(outcome, BaseException) for outcome in results)
        rows = sum(entry.rows for entry in batch)
        record = BatchRecord(
            self.name, instance, rows, len(batch), tuple(waits), compute_ns, errors
        )
        self._record(on_batch, record)

    def _record(self, on_batch: Callable[[BatchRecord], None], record: BatchRecord) -> None:
        try:
            on_batch(record)
        except Exception:  # statistics must never break serving
            _log.exception("model %s: on_batch callback failed", self.name)

    def _worker_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            _log.error("model %s: %s died", self.name, task.get_name(), exc_info=error)
