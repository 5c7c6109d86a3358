"""A trace as a waterfall with the per-hop breakdown: where each request's time went.

One row per span, in call order (a parent, then its children by start time),
with, where they apply:

- ``queue_us`` / ``compute_us``: what a stage's server span says it spent
  waiting for a batch slot and running the model (``meshserve.queue_us`` /
  ``meshserve.compute_us``, set by the shared model runner);
- ``network_us``, for a server span whose parent belongs to another service:
  for a call that covers the callee's span (unary), the caller's span minus
  the callee's: time on the wire and in (de)serialisation both ways (under
  Envoy, Envoy's own work too), with no clocks compared; for a stream (the
  callee's span outlives the caller's set-up span), the gap from the caller's
  span start to the callee's: the request's way there, which compares two
  processes' clocks (one clock on one host).

No gRPC or HTTP here: the store's page and ``meshserve trace`` both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.tracestore.jaeger import KIND_NAMES
from services.tracestore.spans import SpanRecord

SERVER = 2
QUEUE_ATTRIBUTE = "meshserve.queue_us"
COMPUTE_ATTRIBUTE = "meshserve.compute_us"


@dataclass(frozen=True)
class Row:
    """One span of the waterfall."""

    span_id: str
    parent_id: str
    depth: int
    service: str
    name: str
    kind: str
    offset_us: int
    """Start, from the trace's first span."""
    duration_us: int
    error: bool
    model: str | None
    queue_us: int | None
    compute_us: int | None
    network_us: int | None


@dataclass(frozen=True)
class Waterfall:
    """A whole trace, ready to draw."""

    trace_id: str
    start_us: int
    duration_us: int
    services: list[str]
    rows: list[Row]

    def as_json(self) -> dict[str, Any]:
        """Plain JSON (what ``--json`` prints and the page reads)."""
        return asdict(self)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Waterfall:
        """The inverse of ``as_json``."""
        rows = [Row(**row) for row in document["rows"]]
        fields = {k: v for k, v in document.items() if k != "rows"}
        return cls(**fields, rows=rows)


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _ordered(spans: Sequence[SpanRecord]) -> list[tuple[int, SpanRecord]]:
    """Depth-first, children by start time; spans whose parent is missing are roots."""
    ids = {span.span_id for span in spans}
    children: dict[str, list[SpanRecord]] = {}
    roots = []
    for span in sorted(spans, key=lambda s: (s.start_us, -s.duration_us)):
        if span.parent_id and span.parent_id in ids:
            children.setdefault(span.parent_id, []).append(span)
        else:
            roots.append(span)
    ordered: list[tuple[int, SpanRecord]] = []
    stack = [(0, span) for span in reversed(roots)]
    while stack:
        depth, span = stack.pop()
        ordered.append((depth, span))
        stack += [(depth + 1, child) for child in reversed(children.get(span.span_id, []))]
    return ordered


def _network_us(span: SpanRecord, parent: SpanRecord | None) -> int | None:
    if span.kind != SERVER or parent is None or parent.service == span.service:
        return None
    if parent.duration_us >= span.duration_us:
        return parent.duration_us - span.duration_us
    return max(0, span.start_us - parent.start_us)


def waterfall(spans: Sequence[SpanRecord]) -> Waterfall:
    """The waterfall of one trace's spans (at least one)."""
    by_id = {span.span_id: span for span in spans}
    start = min(span.start_us for span in spans)
    end = max(span.start_us + span.duration_us for span in spans)
    rows = []
    for depth, span in _ordered(spans):
        parent = by_id.get(span.parent_id)
        network = _network_us(span, parent)
        rows.append(
            Row(
                span_id=span.span_id,
                parent_id=span.parent_id,
                depth=depth,
                service=span.service,
                name=span.name,
                kind=KIND_NAMES.get(span.kind, "unspecified"),
                offset_us=span.start_us - start,
                duration_us=span.duration_us,
                error=span.error,
                model=span.model,
                queue_us=_int(span.attributes.get(QUEUE_ATTRIBUTE)),
                compute_us=_int(span.attributes.get(COMPUTE_ATTRIBUTE)),
                network_us=network,
            )
        )
    services = sorted({span.service for span in spans})
    return Waterfall(spans[0].trace_id, start, end - start, services, rows)


def _ms(us: int | None) -> str:
    return "" if us is None else f"{us / 1000:.2f}"


def render(fall: Waterfall, width: int = 40) -> str:
    """The waterfall as terminal text: a bar per span on the trace's time axis."""
    scale = width / max(1, fall.duration_us)
    header = (
        f"trace {fall.trace_id}  {fall.duration_us / 1000:.2f} ms  {len(fall.rows)} spans  "
        f"services: {', '.join(fall.services)}"
    )
    names = [f"{'  ' * row.depth}{row.service}: {row.name}" for row in fall.rows]
    name_width = min(72, max(len(name) for name in names))
    lines = [
        header,
        f"{'SPAN':<{name_width}}  {'TIMELINE':<{width}}  {'TOTAL ms':>9}  {'QUEUE':>7}  "
        f"{'COMPUTE':>7}  {'NETWORK':>7}",
    ]
    for name, row in zip(names, fall.rows, strict=True):
        left = int(row.offset_us * scale)
        bar_len = max(1, int(row.duration_us * scale))
        bar = (" " * left + ("!" if row.error else "=") * bar_len)[:width]
        lines.append(
            f"{name[:name_width]:<{name_width}}  {bar:<{width}}  {_ms(row.duration_us):>9}  "
            f"{_ms(row.queue_us):>7}  {_ms(row.compute_us):>7}  {_ms(row.network_us):>7}"
        )
    return "\n".join(lines)
