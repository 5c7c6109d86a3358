"""The batch worker: claim lines, run them at a bounded concurrency, record each once.

::

    claim     its own unacknowledged lines first (a restart), then new ones;
              every ``sweep_s`` also lines a dead worker left idle (XAUTOCLAIM)
    run       at most ``concurrency`` lines at a time through the orchestrator
    record    result + acknowledgement in one script (services/batch/store.py)
    sweep     finish jobs whose every line is done, expire old files and jobs

A line whose job is being cancelled is acknowledged without running. A line
the mesh cannot take now (UNAVAILABLE: restarting) waits and is tried again,
so a restart of the mesh under a job fails no line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError

from services.batch.runner import Answer, LineRunner, Transient
from services.batch.store import Claimed, JobStore, Outcome

log = logging.getLogger(__name__)

MAX_OWN = 100_000
"""Most own unacknowledged lines taken up at start."""


class WorkerMetrics:
    """The worker's Prometheus series."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lines = Counter(
            "meshserve_batch_lines",
            "Batch lines finished, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.running = Gauge(
            "meshserve_batch_lines_running", "Lines running now", registry=registry
        )
        self.queued = Gauge(
            "meshserve_batch_lines_queued", "Lines waiting in the queue", registry=registry
        )
        self.job_seconds = Histogram(
            "meshserve_batch_job_duration_seconds",
            "From a job's creation to its end",
            buckets=(1, 5, 15, 60, 300, 900, 3600, 14400, 86400),
            registry=registry,
        )


class Worker:
    """Claims lines for consumer ``name`` and runs them until stopped."""

    def __init__(
        self,
        store: JobStore,
        runner: LineRunner,
        name: str,
        concurrency: int,
        claim_idle_s: float,
        metrics: WorkerMetrics,
    ) -> None:
        self.store = store
        self.runner = runner
        self.name = name
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.metrics = metrics
        # A job's files are written at the first sweep after its last line: a
        # second at most, while the sweep's few Redis calls cost nothing much.
        self.sweep_s = min(1.0, claim_idle_s / 2)
        self._slots = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._running: set[asyncio.Task[None]] = set()
        self._held: set[str] = set()
        """Stream entries this worker is running (kept fresh, so no one takes them over)."""
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Serve until ``stop``; lines in flight then finish (or stay claimed for later)."""
        await self.store.ensure_group()
        async with asyncio.TaskGroup() as group:
            group.create_task(self._sweep_forever())
            # A restart under the same name first takes up what it held when it died.
            for item in await self.store.claim(self.name, MAX_OWN, 0, own=True):
                await self._start(item)
            while not self._stopping.is_set():
                await self._slots.acquire()
                try:
                    claimed = await self.store.claim(self.name, 1 + self._free(), 1000, own=False)
                except RedisError as exc:  # Redis restarting: wait for it, lose nothing
                    log.warning("batch queue unreachable (%s); retrying", exc)
                    claimed = []
                    await asyncio.sleep(1.0)
                finally:
                    self._slots.release()
                for item in claimed:
                    await self._start(item)
        await asyncio.gather(*self._running, return_exceptions=True)

    def stop(self) -> None:
        """Claim no more lines."""
        self._stopping.set()

    def _free(self) -> int:
        return max(0, self._concurrency - len(self._running) - 1)

    async def _start(self, item: Claimed) -> None:
        if item.entry_id in self._held:
            return
        await self._slots.acquire()
        self._held.add(item.entry_id)
        task = asyncio.create_task(self._line(item))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _line(self, item: Claimed) -> None:
        self.metrics.running.inc()
        try:
            await self._settle(item)
        except Exception:  # one line's bug must not end the worker: it stays claimed
            log.exception("batch %s line %d failed unexpectedly", item.batch_id, item.index)
        finally:
            self.metrics.running.dec()
            self._held.discard(item.entry_id)
            self._slots.release()

    async def _settle(self, item: Claimed) -> None:
        status = await self.store.status(item.batch_id)
        if status in ("cancelling", "cancelled", ""):
            await self.store.record(item, {}, "skip")
            self.metrics.lines.labels("skipped").inc()
            return
        answer = await self._answer(item)
        if answer is None:
            return
        outcome: Outcome = "ok" if answer.status == 200 else "error"
        row = {
            "id": f"batch_req_{item.batch_id.split('-', 1)[-1]}_{item.index}",
            "custom_id": item.line.custom_id,
            "response": {"status_code": answer.status, "request_id": "", "body": answer.body},
            "error": None,
        }
        if await self.store.record(item, row, outcome):
            self.metrics.lines.labels("completed" if outcome == "ok" else "failed").inc()

    async def _answer(self, item: Claimed) -> Answer | None:
        delay = 0.5
        while not self._stopping.is_set():
            try:
                return await self.runner.run(item.line)
            except Transient as exc:
                log.warning("batch %s line %d: %s; retrying", item.batch_id, item.index, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        return None  # stopping: the line stays claimed; a restart takes it up

    async def _sweep_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._sweep()
            except Exception:  # Redis away for a moment: the next sweep tries again
                log.exception("batch sweep failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.sweep_s)

    async def _sweep(self) -> None:
        for batch_id in await self.store.active():
            if await self.store.finish(batch_id):
                info = await self.store.batch(batch_id)
                self.metrics.job_seconds.observe(max(0, time.time() - info["created_at"]))
                log.info("batch %s %s", batch_id, info["status"])
        await self.store.touch(self.name, sorted(self._held))
        for item in await self.store.take_over(self.name, self.claim_idle_ms, self._concurrency):
            await self._start(item)
        self.metrics.queued.set(await self.store.queued())
        await self.store.expire()
