"""A generation's queue and compute time on its stage span, as every stage reports them.

vLLM schedules requests itself, so the shared model runner's queue/compute
split does not see them. vLLM's own per-request stats (engine-core
timestamps, one clock) say when the request was queued, first scheduled and
gave its last token: queue = scheduled - queued, compute = last token -
scheduled. Without those stats, compute is the whole generation as this
service saw it, and no queue time is claimed.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace

QUEUE_ATTRIBUTE = "meshserve.queue_us"
COMPUTE_ATTRIBUTE = "meshserve.compute_us"


def record_times(output: Any, started: float) -> None:
    """Set queue and compute time of a generation (``output``: its last
    ``RequestOutput``; ``started``: its ``time.monotonic()`` start) on the current span."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    stats = getattr(output, "metrics", None)
    queued = float(getattr(stats, "queued_ts", 0.0) or 0.0)
    scheduled = float(getattr(stats, "scheduled_ts", 0.0) or 0.0)
    last = float(getattr(stats, "last_token_ts", 0.0) or 0.0)
    if 0.0 < queued <= scheduled <= last:
        span.set_attribute(QUEUE_ATTRIBUTE, int((scheduled - queued) * 1e6))
        span.set_attribute(COMPUTE_ATTRIBUTE, int((last - scheduled) * 1e6))
    else:
        span.set_attribute(COMPUTE_ATTRIBUTE, int((time.monotonic() - started) * 1e6))
