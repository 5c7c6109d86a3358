"""The trace store's settings: one frozen, validated object (shared/config.py)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from shared.config import ServiceConfig

SERVICE = "tracestore"


class TraceStoreConfig(ServiceConfig):
    """Settings of the trace store: OTLP in, Jaeger's query API and the /traces page out."""

    grpc_port: int = Field(4317, ge=0, le=65535)
    """OTLP/gRPC receiver port (0: a free one)."""
    otlp_http_port: int = Field(4318, ge=0, le=65535)
    """OTLP/HTTP receiver port (POST /v1/traces, protobuf; 0: a free one)."""
    http_port: int = Field(16686, ge=0, le=65535)
    """Jaeger query API (/api/...) and the /traces page (0: a free one)."""
    database: Path | None = None
    """SQLite file the spans are kept in (kept across restarts); none: a fresh file in a
    temporary folder, removed at stop."""
    max_age_s: float = Field(3600.0, ge=1.0, le=30 * 86400.0)
    """Spans received longer ago than this are dropped."""
    max_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024, le=2**40)
    """Above this many bytes of spans (as stored), the oldest traces are dropped."""
    prune_interval_s: float = Field(5.0, gt=0.0, le=3600.0)
    """How often the age and size bounds are applied."""
    forward_endpoint: str | None = None
    """Also send every received span batch to this OTLP/gRPC endpoint (host:port)."""
