"""Recording spans for the mesh's services without the OpenTelemetry SDK's per-span machinery.

The SDK's tracer costs about 35 µs a span on this kind of CPU (a sampler
object per decision, attributes validated into a locked mapping, a span
processor chain, a batch processor's queue and condition), which is more than
our own OTLP encoder (shared/otlp_export.py) then spends sending it. A traced
``text_embedding`` request records seven spans in Python, so in a CPU-bound
mesh that is a share of the throughput. Here a span is a small object with the
fields the encoder reads, and the provider is the one piece of the pipeline::

    SpanRecorder (a TracerProvider)   the service's resource, its tracers, a batch
    RecordingTracer.start_span        sampling (parent-based, else a ratio by
                                      trace id, as the SDK decides), ids, the span
    RecordedSpan.end                  onto the batch
    _Batches (a thread)               every ``delay_s`` or ``max_batch`` spans, to
                                      the exporter (OtlpGrpcExporter)

Everything else is OpenTelemetry's API: contexts, ``use_span``, W3C
propagation, ``NonRecordingSpan`` for what is not sampled, so the rest of the
mesh (interceptors, logs, exemplars) cannot tell the difference. Attribute
values the OTLP encoder cannot write are dropped, as the SDK drops them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util import types
from opentelemetry.util._decorator import _agnosticcontextmanager

log = logging.getLogger(__name__)

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_SCALARS = (str, bool, int, float)
_SCALAR_TYPES = frozenset(_SCALARS)
_LOW_64 = (1 << 64) - 1
_UNSET = Status(StatusCode.UNSET)


class RecordedSpan(trace.Span):
    """A sampled span: what ``shared.otlp_export.SpanEncoder`` reads, and the API's
    methods to fill it in."""

    __slots__ = (
        "_batches",
        "_context",
        "attributes",
        "end_time",
        "events",
        "instrumentation_scope",
        "kind",
        "links",
        "name",
        "parent",
        "resource",
        "start_time",
        "status",
    )

    dropped_attributes = 0
    dropped_events = 0
    dropped_links = 0

    def __init__(
        self,
        tracer: RecordingTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
    ) -> None:
        self._batches = tracer.batches
        self._context = context
        self.resource = tracer.resource
        self.instrumentation_scope = tracer.scope
        self.name = name
        self.kind = kind
        self.parent = parent
        self.attributes: dict[str, Any] = {}
        self.events: list[Event] = []
        self.links: tuple[Link, ...] = ()
        self.status = _UNSET
        self.start_time = time.time_ns()
        self.end_time: int | None = None

    @property
    def context(self) -> SpanContext:
        """The span's context (the SDK's ReadableSpan has it under this name)."""
        return self._context

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        if self.end_time is not None:
            return
        if type(value) in _SCALAR_TYPES or isinstance(value, _SCALARS):
            self.attributes[key] = value
        elif isinstance(value, Sequence) and all(isinstance(v, _SCALARS) for v in value):
            self.attributes[key] = tuple(value)
        else:
            log.debug("span attribute %r dropped: a %s", key, type(value).__name__)

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: types.Attributes = None, timestamp: int | None = None
    ) -> None:
        if self.end_time is None:
            self.events.append(Event(name, attributes, timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if self.end_time is None and context.is_valid:
            self.links += (Link(context, attributes),)

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: an OK status is final, and only an error has a description.
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            self.status = status
        else:
            self.status = Status(status, description if status is StatusCode.ERROR else None)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        kind = type(exception)
        module = kind.__module__
        described: dict[str, types.AttributeValue] = {
            "exception.type": kind.__qualname__
            if module in ("builtins", "")
            else f"{module}.{kind.__qualname__}",
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        described.update(attributes or {})
        self.add_event("exception", described, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or time.time_ns()
        self._batches.add(self)


class RecordingTracer(trace.Tracer):
    """Starts spans: sampled ones recorded, the others passed on as the API's
    ``NonRecordingSpan`` (their context still travels)."""

    def __init__(
        self, recorder: SpanRecorder, scope: InstrumentationScope, sample_bound: int
    ) -> None:
        self.batches = recorder.batches
        self.resource = recorder.resource
        self.scope = scope
        self._bound = sample_bound

    def start_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        """A new span, the child of the span current in ``context`` (or now)."""
        parent = trace.get_current_span(context).get_span_context()
        span_id = random.getrandbits(64) or 1
        if parent.is_valid:
            trace_id, state = parent.trace_id, parent.trace_state
            sampled = parent.trace_flags.sampled  # the decision made where the trace began
        else:
            trace_id, state = random.getrandbits(128) or 1, None
            sampled = trace_id & _LOW_64 < self._bound
        own = SpanContext(trace_id, span_id, False, _SAMPLED if sampled else _UNSAMPLED, state)
        if not sampled:
            return trace.NonRecordingSpan(own)
        span = RecordedSpan(self, name, own, parent if parent.is_valid else None, kind)
        if start_time is not None:
            span.start_time = start_time
        if attributes:
            span.set_attributes(attributes)
        if links:
            for link in links:
                span.add_link(link.context, link.attributes)
        return span

    @_agnosticcontextmanager
    def start_as_current_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        """``start_span``, current for the block (and ended after it)."""
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


class _Batches:
    """Ended spans, handed to the exporter from a thread of its own every
    ``delay_s`` (sooner once ``max_batch`` wait); beyond ``max_queue`` waiting,
    the oldest are dropped (spans are not worth a backlog)."""

    def __init__(
        self, exporter: SpanExporter, delay_s: float, max_batch: int, max_queue: int
    ) -> None:
        self._exporter = exporter
        self._delay_s = delay_s
        self._max_batch = max_batch
        self._queue: collections.deque[RecordedSpan] = collections.deque(maxlen=max_queue)
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self._thread.start()

    def add(self, span: RecordedSpan) -> None:
        """One ended span (called from any thread)."""
        self._queue.append(span)
        if len(self._queue) >= self._max_batch:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._export_all()
        self._export_all()

    def _export_all(self) -> None:
        while self._queue:
            batch: list[RecordedSpan] = []
            with contextlib.suppress(IndexError):
                while len(batch) < self._max_batch:
                    batch.append(self._queue.popleft())
            try:
                # The exporter reads what a ReadableSpan has, which these have too.
                self._exporter.export(cast("Sequence[ReadableSpan]", batch))
            except Exception:
                log.exception("exporting %d spans failed", len(batch))

    def flush(self, timeout_s: float) -> bool:
        """Wake the thread and wait until nothing is queued (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue

    def stop(self) -> None:
        """Send what is queued, end the thread, shut the exporter down."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._exporter.shutdown()


class SpanRecorder(TracerProvider):
    """A service's tracer provider: its resource (``service.name``), its tracers, and
    the batches its spans are exported in.

    An SDK ``TracerProvider`` by type (the services and their tests pass one
    around as such), but none of its span machinery is used.
    """

    def __init__(
        self,
        resource: Resource,
        exporter: SpanExporter,
        sample_ratio: float = 1.0,
        delay_s: float = 0.2,
        max_batch: int = 512,
    ) -> None:
        super().__init__(resource=resource, shutdown_on_exit=False)
        self.batches = _Batches(exporter, delay_s, max_batch, max_queue=8 * max_batch)
        self._bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self._recording: dict[tuple[str, str | None, str | None], RecordingTracer] = {}
        self._stopped = False

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: types.Attributes = None,
    ) -> RecordingTracer:
        """One tracer per instrumentation scope (made once, then reused)."""
        key = (instrumenting_module_name, instrumenting_library_version, schema_url)
        tracer = self._recording.get(key)
        if tracer is None:
            scope = InstrumentationScope(
                instrumenting_module_name, instrumenting_library_version, schema_url, attributes
            )
            tracer = self._recording[key] = RecordingTracer(self, scope, self._bound)
        return tracer

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Send every ended span now."""
        return self.batches.flush(timeout_millis / 1000)

    def shutdown(self) -> None:
        """Send what is left and stop exporting."""
        if not self._stopped:
            self._stopped = True
            self.batches.stop()
