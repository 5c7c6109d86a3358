"""Log set-up: plain text lines, or JSON lines that a log store can join to traces.

With ``log_format: json`` every line is one JSON object with ``time``,
``level``, ``logger``, ``service``, ``message``, and the ``trace_id`` /
``span_id`` of the span current where the line was logged (null outside any
trace), so Loki or any log store finds a request's lines from its trace id
(the one its response carried) and a trace's page links back to them.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    """One JSON object per record, with the current trace and span ids."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        context = trace.get_current_span().get_span_context()
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "service": self._service,
            "message": record.getMessage(),
            "trace_id": f"{context.trace_id:032x}" if context.is_valid else None,
            "span_id": f"{context.span_id:016x}" if context.is_valid else None,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str, log_format: str = "text", service: str = "") -> None:
    """The root logger: ``level``, as text lines or (``json``) JSON lines on stderr."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonLines(service))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    # Like basicConfig: a root logger that already has handlers (a test runner's) keeps them.
    logging.basicConfig(level=level, handlers=[handler])
