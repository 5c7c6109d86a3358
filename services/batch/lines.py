"""Batch input files: one request per line, checked line by line before any job runs.

A line is OpenAI's batch request (and vLLM ``run_batch``'s)::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``url`` is one of ``ENDPOINTS``, or ``/v2/models/{model}/infer`` with a KServe
v2 JSON inference request as ``body`` (jobs for any model). Every problem names
the line (1-based) so the uploader can fix the file. No Redis or gRPC here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shared import jsontext
from shared.errors import InvalidArgument

ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
"""The OpenAI endpoints a batch may target."""
V2_URL = re.compile(r"^/v2/models/(?P<model>[A-Za-z0-9_.\-]{1,128})/infer$")
"""A KServe v2 inference request for one model (``url`` of a v2 job line)."""
MAX_LINES = 100_000
"""Most requests in one batch file."""
MAX_CUSTOM_ID = 512
"""Longest ``custom_id``."""


@dataclass(frozen=True)
class BatchLine:
    """One checked request of a batch file."""

    custom_id: str
    url: str
    body: dict[str, Any]


def endpoint_ok(url: str) -> bool:
    """Whether ``url`` is an endpoint a batch may target."""
    return url in ENDPOINTS or V2_URL.match(url) is not None


def parse_line(text: str, number: int) -> BatchLine:
    """The request on line ``number`` (1-based), or InvalidArgument naming the line."""
    where = f"line {number}"
    item = jsontext.parse_object(text, where)
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise InvalidArgument(f"{where}: 'custom_id' must be a string of 1..{MAX_CUSTOM_ID} chars")
    if method != "POST":
        raise InvalidArgument(f"{where}: 'method' must be \"POST\", got {method!r}")
    if not isinstance(url, str) or not endpoint_ok(url):
        raise InvalidArgument(
            f"{where}: 'url' must be one of {sorted(ENDPOINTS)} or /v2/models/<model>/infer,"
            f" got {url!r}"
        )
    if not isinstance(body, dict):
        raise InvalidArgument(f"{where}: 'body' must be a JSON object")
    if body.get("stream"):
        raise InvalidArgument(f"{where}: 'body.stream' is not supported in a batch")
    return BatchLine(custom_id, url, body)


def parse_file(content: bytes) -> list[BatchLine]:
    """Every request of a JSONL batch file; the first problem raises, naming its line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"the file is not UTF-8: {exc}") from exc
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        line = parse_line(raw, number)
        if line.custom_id in seen:
            raise InvalidArgument(f"line {number}: 'custom_id' {line.custom_id!r} repeats")
        seen.add(line.custom_id)
        lines.append(line)
        if len(lines) > MAX_LINES:
            raise InvalidArgument(f"line {number}: a batch holds at most {MAX_LINES} requests")
    if not lines:
        raise InvalidArgument("the file holds no requests")
    return lines
