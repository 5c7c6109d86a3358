"""The span store: SQLite, bounded by age and size. No gRPC or HTTP here.

Every method blocks (SQLite): callers on an event loop run them in the one
thread ``TraceStore`` owns (``TraceStore.run``), which also serialises them.

Received spans are written together: ``receive`` queues a batch, and every
batch that arrived within ``WRITE_DELAY_S`` goes into one transaction. A
transaction's fixed cost (the pages of every index it touches, written to the
log) was most of what a small batch cost, and senders make many (Envoy, five
spans at a time unless told otherwise). Nothing reads around the queue:
``run`` writes what is queued before any other call, so a query sees every
span received before it.

Two tables: ``spans`` (one row per span, its attributes as JSON) and
``traces`` (one row per trace, kept up to date on every insert: first start,
last end, span count, whether any span failed, the root span, and the model
named by the earliest span that names one), so listing recent or slowest
traces reads one small table.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from services.tracestore.spans import SpanRecord

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id TEXT NOT NULL, span_id TEXT NOT NULL, parent_id TEXT NOT NULL,
    service TEXT NOT NULL, name TEXT NOT NULL, kind INTEGER NOT NULL,
    start_us INTEGER NOT NULL, duration_us INTEGER NOT NULL,
    error INTEGER NOT NULL, status_message TEXT NOT NULL,
    attributes TEXT NOT NULL, events TEXT NOT NULL, resource TEXT NOT NULL,
    scope TEXT NOT NULL, received REAL NOT NULL, size INTEGER NOT NULL,
    PRIMARY KEY (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_service ON spans (service, name, duration_us);
DROP INDEX IF EXISTS spans_received;  -- nothing reads spans by arrival: pruning goes by trace
CREATE TABLE IF NOT EXISTS traces (
    trace_id TEXT PRIMARY KEY, start_us INTEGER NOT NULL, end_us INTEGER NOT NULL,
    spans INTEGER NOT NULL, error INTEGER NOT NULL,
    root_service TEXT NOT NULL, root_name TEXT NOT NULL,
    model TEXT, model_start INTEGER, received REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS traces_start ON traces (start_us);
CREATE INDEX IF NOT EXISTS traces_duration ON traces (end_us - start_us);
"""

WRITE_DELAY_S = 0.2
"""How long received spans may wait to be written with the batches that follow."""
MAX_QUEUED = 256
"""Batches queued at most: beyond, a receiver waits for the write (the store is
behind its senders)."""

_INSERT_SPAN = "INSERT OR IGNORE INTO spans VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"

# Values in SET expressions are the row's old ones (SQLite evaluates them all
# before assigning), so each CASE compares with what was there.
_UPSERT_TRACE = """
INSERT INTO traces VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (trace_id) DO UPDATE SET
    start_us = min(start_us, excluded.start_us),
    end_us = max(end_us, excluded.end_us),
    spans = spans + excluded.spans,
    error = max(error, excluded.error),
    root_service = CASE WHEN excluded.start_us < start_us
        THEN excluded.root_service ELSE root_service END,
    root_name = CASE WHEN excluded.start_us < start_us
        THEN excluded.root_name ELSE root_name END,
    model = CASE WHEN excluded.model IS NOT NULL
        AND (model IS NULL OR excluded.model_start < model_start)
        THEN excluded.model ELSE model END,
    model_start = CASE WHEN excluded.model IS NOT NULL
        AND (model IS NULL OR excluded.model_start < model_start)
        THEN excluded.model_start ELSE model_start END,
    received = excluded.received
"""


@dataclass(frozen=True)
class Limits:
    """How much the store keeps."""

    max_age_s: float
    """Spans received longer ago than this are dropped."""
    max_bytes: int
    """Above this many bytes of spans, the oldest traces are dropped."""


@dataclass(frozen=True)
class TraceQuery:
    """A search for traces, as Jaeger's ``/api/traces`` asks it."""

    service: str | None = None
    operation: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    min_duration_us: int = 0
    max_duration_us: int | None = None
    start_us: int | None = None
    end_us: int | None = None
    limit: int = 20


@dataclass(frozen=True)
class TraceSummary:
    """One trace in a listing."""

    trace_id: str
    start_us: int
    duration_us: int
    spans: int
    error: bool
    root_service: str
    root_name: str
    model: str | None


Order = Literal["recent", "slowest"]


class TraceStore:
    """Spans in SQLite, with one thread of its own for every call."""

    def __init__(self, path: Path | str, limits: Limits) -> None:
        self.limits = limits
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracestore")
        self._db = self._executor.submit(self._open, str(path)).result()
        self._bytes = self._executor.submit(self._stored_bytes).result()
        self._queued: collections.deque[Iterable[SpanRecord]] = collections.deque()
        self._write: asyncio.TimerHandle | None = None
        self._writes: set[asyncio.Task[int]] = set()

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` in the store's thread, awaited, after the queued spans
        are written."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._after_queued, call, args)

    def _after_queued(self, call: Callable[..., T], args: tuple[Any, ...]) -> T:
        self.write_queued()
        return call(*args)

    async def receive(self, spans: Iterable[SpanRecord]) -> None:
        """Keep ``spans`` (consumed in the store's thread) within ``WRITE_DELAY_S``,
        in one transaction with the batches received meanwhile."""
        self._queued.append(spans)
        if len(self._queued) >= MAX_QUEUED:
            await self.run(self.write_queued)
        elif self._write is None:
            self._write = asyncio.get_running_loop().call_later(WRITE_DELAY_S, self._write_soon)

    def _write_soon(self) -> None:
        self._write = None
        task = asyncio.get_running_loop().create_task(self.run(self.write_queued))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def write_queued(self) -> int:
        """Keep every queued batch now, in one transaction; how many spans were new."""
        batches = []
        while self._queued:
            batches.append(self._queued.popleft())
        return self.add(itertools.chain.from_iterable(batches)) if batches else 0

    def close(self) -> None:
        """Write what is queued, close the database and end the store's thread."""
        if self._write is not None:
            self._write.cancel()
        self._executor.submit(self.write_queued).result()
        self._executor.submit(self._db.close).result()
        self._executor.shutdown()

    @staticmethod
    def _open(path: str) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=OFF")  # losing the last spans in a crash is fine
        db.executescript(_SCHEMA)
        return db

    def _stored_bytes(self) -> int:
        return int(self._db.execute("SELECT coalesce(sum(size), 0) FROM spans").fetchone()[0])

    @property
    def stored_bytes(self) -> int:
        """Bytes of spans kept now (as the size bound counts them)."""
        return self._bytes

    def add(self, spans: Iterable[SpanRecord]) -> int:
        """Keep ``spans`` (a span received twice is kept once); how many were new."""
        now = time.time()
        batch = list(spans)
        resources: dict[int, str] = {}  # a batch's spans share a few resource dicts
        rows = [_row(span, now, resources) for span in batch]
        with self._db:
            before = self._db.total_changes
            self._db.executemany(_INSERT_SPAN, rows)
            if self._db.total_changes - before == len(rows):
                new = batch  # the usual case: no span came twice
                self._bytes += sum(row[-1] for row in rows)
            else:  # a batch sent again: find which were new, row by row
                self._db.rollback()
                new = []
                for span, row in zip(batch, rows, strict=True):
                    if self._db.execute(_INSERT_SPAN, row).rowcount:
                        new.append(span)
                        self._bytes += row[-1]
            traces: dict[str, _TraceUpdate] = {}
            for span in new:
                update = traces.get(span.trace_id)
                if update is None:
                    traces[span.trace_id] = _TraceUpdate(span)
                else:
                    update.add(span)
            # One summary update per trace and batch: a batch holds many spans of a trace.
            self._db.executemany(_UPSERT_TRACE, [u.row(now) for u in traces.values()])
        return len(new)

    def prune(self) -> int:
        """Drop spans past the age bound, then the oldest traces past the size bound."""
        cutoff = time.time() - self.limits.max_age_s
        dropped = 0
        with self._db:
            old = [
                r[0]
                for r in self._db.execute(
                    "SELECT trace_id FROM traces WHERE received < ?", (cutoff,)
                )
            ]
            dropped += self._drop(old)
            while self._bytes > self.limits.max_bytes:
                # Down to 90%: a store at its bound does not prune on every batch.
                oldest = [
                    r[0]
                    for r in self._db.execute(
                        "SELECT trace_id FROM traces ORDER BY received LIMIT 100"
                    )
                ]
                if not oldest:
                    break
                dropped += self._drop(oldest)
                if self._bytes <= self.limits.max_bytes * 0.9:
                    break
        return dropped

    def _drop(self, trace_ids: Sequence[str]) -> int:
        for trace_id in trace_ids:
            self._db.execute("DELETE FROM spans WHERE trace_id = ?", (trace_id,))
            self._db.execute("DELETE FROM traces WHERE trace_id = ?", (trace_id,))
        self._bytes = self._stored_bytes()
        return len(trace_ids)

    def services(self) -> list[str]:
        """Every service that sent a span still kept."""
        return [r[0] for r in self._db.execute("SELECT DISTINCT service FROM spans ORDER BY 1")]

    def operations(self, service: str) -> list[tuple[str, int]]:
        """Span names (and kinds) of ``service``."""
        rows = self._db.execute(
            "SELECT DISTINCT name, kind FROM spans WHERE service = ? ORDER BY 1", (service,)
        )
        return [(r[0], r[1]) for r in rows]

    def trace(self, trace_id: str) -> list[SpanRecord]:
        """Every span of one trace, by start time (empty if unknown)."""
        rows = self._db.execute(
            "SELECT * FROM spans WHERE trace_id = ? ORDER BY start_us", (trace_id.lower(),)
        )
        return [_record(row) for row in rows]

    def find(self, query: TraceQuery) -> list[list[SpanRecord]]:
        """Traces with a span that matches ``query``, newest first, whole."""
        where: list[str] = ["1"]
        args: list[Any] = []
        for column, value in (("service", query.service), ("name", query.operation)):
            if value:
                where.append(f"{column} = ?")
                args.append(value)
        where.append("duration_us >= ?")
        args.append(query.min_duration_us)
        if query.max_duration_us is not None:
            where.append("duration_us <= ?")
            args.append(query.max_duration_us)
        if query.start_us is not None:
            where.append("start_us >= ?")
            args.append(query.start_us)
        if query.end_us is not None:
            where.append("start_us <= ?")
            args.append(query.end_us)
        for key, value in query.tags:
            where.append("CAST(json_extract(attributes, ?) AS TEXT) = ?")
            args += [f'$."{key}"', value]
        sql = (
            "SELECT trace_id FROM traces WHERE trace_id IN "
            f"(SELECT trace_id FROM spans WHERE {' AND '.join(where)}) "
            "ORDER BY start_us DESC LIMIT ?"
        )
        ids = [r[0] for r in self._db.execute(sql, (*args, query.limit))]
        return [self.trace(trace_id) for trace_id in ids]

    def summaries(
        self, order: Order, limit: int, model: str | None = None, error: bool | None = None
    ) -> list[TraceSummary]:
        """Recent or slowest requests to a model, optionally of one model or one outcome.

        Traces that name no model (health checks, discovery) are left out.
        """
        where: list[str] = ["model IS NOT NULL"]
        args: list[Any] = []
        if model:
            where.append("model = ?")
            args.append(model)
        if error is not None:
            where.append("error = ?")
            args.append(int(error))
        by = "start_us DESC" if order == "recent" else "end_us - start_us DESC"
        rows = self._db.execute(
            "SELECT trace_id, start_us, end_us - start_us, spans, error, root_service, "
            f"root_name, model FROM traces WHERE {' AND '.join(where)} ORDER BY {by} LIMIT ?",
            (*args, limit),
        )
        return [TraceSummary(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6], r[7]) for r in rows]

    def models(self) -> list[str]:
        """Every model a kept trace served."""
        rows = self._db.execute("SELECT DISTINCT model FROM traces WHERE model IS NOT NULL")
        return sorted(r[0] for r in rows)


class _TraceUpdate:
    """What one batch's new spans of a trace change in its summary row."""

    def __init__(self, span: SpanRecord) -> None:
        self.trace_id = span.trace_id
        self.start = span.start_us
        self.end = span.start_us + span.duration_us
        self.spans = 1
        self.error = span.error
        self.root = (span.service, span.name)
        self.model = span.model
        self.model_start = span.start_us if self.model else None

    def add(self, span: SpanRecord) -> None:
        """Fold one more new span of the trace in."""
        if span.start_us < self.start:
            self.start, self.root = span.start_us, (span.service, span.name)
        self.end = max(self.end, span.start_us + span.duration_us)
        self.spans += 1
        self.error = self.error or span.error
        model = span.model
        if model and (self.model_start is None or span.start_us < self.model_start):
            self.model, self.model_start = model, span.start_us

    def row(self, received: float) -> tuple[Any, ...]:
        """The upsert's parameters."""
        return (
            self.trace_id,
            self.start,
            self.end,
            self.spans,
            int(self.error),
            *self.root,
            self.model,
            self.model_start,
            received,
        )


_to_json = json.JSONEncoder(default=str).encode
"""``json.dumps(value, default=str)`` without making an encoder per call."""


def _row(span: SpanRecord, received: float, resources: dict[int, str]) -> tuple[Any, ...]:
    attributes = _to_json(span.attributes)
    events = _to_json(span.events) if span.events else "[]"
    resource = resources.get(id(span.resource))
    if resource is None:
        resource = resources[id(span.resource)] = _to_json(span.resource)
    size = 120 + len(span.name) + len(attributes) + len(events) + len(resource)
    return (
        span.trace_id,
        span.span_id,
        span.parent_id,
        span.service,
        span.name,
        span.kind,
        span.start_us,
        span.duration_us,
        int(span.error),
        span.status_message,
        attributes,
        events,
        resource,
        span.scope,
        received,
        size,
    )


def _record(row: Sequence[Any]) -> SpanRecord:
    return SpanRecord(
        trace_id=row[0],
        span_id=row[1],
        parent_id=row[2],
        service=row[3],
        name=row[4],
        kind=row[5],
        start_us=row[6],
        duration_us=row[7],
        error=bool(row[8]),
        status_message=row[9],
        attributes=json.loads(row[10]),
        events=json.loads(row[11]),
        resource=json.loads(row[12]),
        scope=row[13],
    )
