"""The trace store as its own process: OTLP in over gRPC and HTTP from the real
OpenTelemetry exporters, Jaeger's query API out, bounded by age and size, and
``meshserve trace`` reading it."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.tracestore.spans import SpanRecord
from services.tracestore.store import WRITE_DELAY_S, Limits, TraceStore
from tests.harness import ROOT, ServiceProcess

JAEGER_SPAN_KEYS = {
    "traceID",
    "spanID",
    "operationName",
    "references",
    "startTime",
    "duration",
    "tags",
    "logs",
    "processID",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    database = tmp_path_factory.mktemp("traces") / "traces.sqlite"
    args = ["--otlp-http-port", "0", "--http-port", "0", "--database", str(database)]
    args += ["--log-format", "json"]
    process = ServiceProcess("services.tracestore.main", args)
    yield process
    process.stop()


def provider(service: str, exporter: SpanExporter) -> TracerProvider:
    made = TracerProvider(resource=Resource.create({"service.name": service}))
    made.add_span_processor(SimpleSpanProcessor(exporter))
    return made


def send_request_trace(store: ServiceProcess, model: str, fail: bool = False) -> str:
    """An orchestrator (over OTLP/gRPC) calling a stage (over OTLP/HTTP); the trace id."""
    caller = provider("orchestrator", GrpcExporter(endpoint=store.address, insecure=True))
    callee = provider("inference", HttpExporter(endpoint=store.info["otlp_http"]))
    outer, inner = caller.get_tracer("test"), callee.get_tracer("test")
    with (
        outer.start_as_current_span(
            "ModelInfer", kind=SpanKind.SERVER, attributes={"meshserve.model": model}
        ) as root,
        outer.start_as_current_span("ModelInfer", kind=SpanKind.CLIENT),
    ):
        time.sleep(0.004)
        stage_attributes = {
            "meshserve.model": model,
            "meshserve.queue_us": 700,
            "meshserve.compute_us": 1500,
        }
        with inner.start_as_current_span(
            "ModelInfer", kind=SpanKind.SERVER, attributes=stage_attributes
        ) as stage:
            stage.add_event("batch", {"size": 2})
            time.sleep(0.003)
            if fail:
                stage.set_status(Status(StatusCode.ERROR, "model failed"))
    caller.shutdown()
    callee.shutdown()
    return f"{root.get_span_context().trace_id:032x}"


def meshserve_trace(store: ServiceProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """The real ``meshserve trace`` command against the store."""
    command = [sys.executable, "-m", "deploy.cli", "trace", "--url", store.info["http"], *args]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=30, check=False
    )


def get(store: ServiceProcess, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://{store.info['http']}{path}", timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_jaeger_api_answers_in_jaegers_shape(store: ServiceProcess) -> None:
    trace_id = send_request_trace(store, "resnet")

    status, services = get(store, "/api/services")
    assert status == 200 and {"orchestrator", "inference"} <= set(services["data"])
    status, body = get(store, f"/api/traces/{trace_id}")
    assert status == 200 and body["errors"] is None
    (trace,) = body["data"]
    assert trace["traceID"] == trace_id and len(trace["spans"]) == 3
    for span in trace["spans"]:
        assert set(span) >= JAEGER_SPAN_KEYS
        assert span["processID"] in trace["processes"]
    names = {p["serviceName"] for p in trace["processes"].values()}
    assert names == {"orchestrator", "inference"}
    by_id = {s["spanID"]: s for s in trace["spans"]}
    (stage,) = [
        s
        for s in trace["spans"]
        if trace["processes"][s["processID"]]["serviceName"] == "inference"
    ]
    (reference,) = stage["references"]
    assert reference["refType"] == "CHILD_OF" and by_id[reference["spanID"]]
    tags = {t["key"]: t for t in stage["tags"]}
    assert tags["meshserve.queue_us"] == {
        "key": "meshserve.queue_us",
        "type": "int64",
        "value": 700,
    }
    assert tags["span.kind"]["value"] == "server"
    assert stage["logs"][0]["fields"][0] == {"key": "event", "type": "string", "value": "batch"}
    assert 3000 <= stage["duration"] < 10**6  # microseconds

    # Search: by service, operation, minimum duration and tag, as Grafana asks.
    query = "/api/traces?service=inference&operation=ModelInfer&minDuration=1ms&limit=5"
    status, found = get(
        store, query + "&lookback=1h&tags=%7B%22meshserve.model%22%3A%22resnet%22%7D"
    )
    assert status == 200 and trace_id in [t["traceID"] for t in found["data"]]
    status, found = get(store, "/api/traces?service=inference&minDuration=10s")
    assert status == 200 and trace_id not in [t["traceID"] for t in found["data"]]
    status, operations = get(store, "/api/services/inference/operations")
    assert operations["data"] == ["ModelInfer"]


def test_unknown_trace_and_bad_parameters_are_named(store: ServiceProcess) -> None:
    status, body = get(store, "/api/traces/" + "ab" * 16)
    assert status == 404 and body["data"] is None and body["errors"][0]["code"] == 404
    status, body = get(store, "/api/traces?minDuration=fast")
    assert status == 400 and "minDuration" in body["error"]
    status, body = get(store, "/api/traces?limit=0")
    assert status == 400 and "limit" in body["error"]
    status, body = get(store, "/api/traces/not-hex")
    assert status == 400 and "trace id" in body["error"]
    request = urllib.request.Request(
        store.info["otlp_http"], data=b"{}", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert (
        refused.value.code == 415 and "application/x-protobuf" in json.load(refused.value)["error"]
    )


def test_cli_shows_queue_compute_and_network_per_hop(store: ServiceProcess) -> None:
    ok = send_request_trace(store, "bert")
    failed = send_request_trace(store, "bert", fail=True)
    shown = meshserve_trace(store, f"00-{ok}-0123456789abcdef-01")
    assert shown.returncode == 0, shown.stderr
    assert f"trace {ok}" in shown.stdout and "inference: ModelInfer" in shown.stdout
    stage_line = shown.stdout.splitlines()[-1]
    assert stage_line.split()[-3:-1] == ["0.70", "1.50"]  # queue, compute (ms)

    listed = meshserve_trace(
        store, "--slowest", "5", "--model", "bert", "--status", "error", "--json"
    )
    assert listed.returncode == 0, listed.stderr
    (fall,) = json.loads(listed.stdout)
    assert fall["trace_id"] == failed
    rows = {row["service"] + "/" + row["kind"]: row for row in fall["rows"]}
    stage, client = rows["inference/server"], rows["orchestrator/client"]
    assert stage["error"] and stage["queue_us"] == 700 and stage["compute_us"] == 1500
    assert stage["network_us"] == client["duration_us"] - stage["duration_us"] >= 0

    missing = meshserve_trace(store, "cd" * 16, "--wait-s", "0")
    assert missing.returncode == 1 and "has no trace" in missing.stderr
    assert "not sampled" not in missing.stderr
    unsampled = meshserve_trace(store, f"00-{'cd' * 16}-{'ef' * 8}-00", "--wait-s", "0")
    assert unsampled.returncode == 1 and "not sampled" in unsampled.stderr


def span(trace_id: str, start_us: int, padding: int = 0) -> SpanRecord:
    return SpanRecord(
        trace_id=trace_id,
        span_id="1" * 16,
        parent_id="",
        service="inference",
        name="ModelInfer",
        kind=2,
        start_us=start_us,
        duration_us=10,
        error=False,
        status_message="",
        attributes={"meshserve.model": "m", "padding": "x" * padding},
        events=[],
        resource={"service.name": "inference"},
        scope="test",
    )


def test_spans_past_the_age_or_size_bound_are_dropped(tmp_path: Path) -> None:
    # The store's core in this process: the bounds are what is tested, not the sockets.
    store = TraceStore(tmp_path / "bounded.sqlite", Limits(max_age_s=1.0, max_bytes=2**20))
    try:
        now_us = int(time.time() * 1e6)
        store.add(span(f"{n:032x}", now_us + n, padding=4096) for n in range(400))
        assert store.stored_bytes > 2**20
        assert store.prune() > 0
        assert store.stored_bytes <= 2**20
        assert store.trace(f"{0:032x}") == [] and store.trace(f"{399:032x}") != []
        time.sleep(1.1)
        store.add([span("f" * 32, now_us)])
        store.prune()
        assert store.trace(f"{399:032x}") == [] and store.trace("f" * 32) != []
    finally:
        store.close()


def test_a_batch_sent_again_is_kept_once(tmp_path: Path) -> None:
    """An exporter that retries a batch the store already took: no span twice, and
    the trace's summary counts each span once."""
    store = TraceStore(tmp_path / "again.sqlite", Limits(max_age_s=60.0, max_bytes=2**20))
    try:
        now_us = int(time.time() * 1e6)
        first = [span("a" * 32, now_us)]
        assert store.add(first) == 1
        size = store.stored_bytes
        again = [*first, span("b" * 32, now_us + 5)]
        assert store.add(again) == 1
        assert store.stored_bytes > size
        assert [len(store.trace(t * 32)) for t in "ab"] == [1, 1]
        assert {s.trace_id: s.spans for s in store.summaries("recent", 5)} == {
            "a" * 32: 1,
            "b" * 32: 1,
        }
    finally:
        store.close()


def test_received_batches_are_written_together_and_seen_by_the_next_query(
    tmp_path: Path,
) -> None:
    """Batches wait up to WRITE_DELAY_S to share a transaction, but a query made
    meanwhile finds them; unqueried, they reach the file on their own."""
    path = tmp_path / "queued.sqlite"
    store = TraceStore(path, Limits(max_age_s=60.0, max_bytes=2**20))
    now_us = int(time.time() * 1e6)

    def on_disk(trace_id: str) -> int:
        with sqlite3.connect(path) as reader:
            query = "SELECT count(*) FROM spans WHERE trace_id = ?"
            return int(reader.execute(query, (trace_id,)).fetchone()[0])

    async def scenario() -> None:
        await store.receive([span("a" * 32, now_us)])
        await store.receive([span("b" * 32, now_us)])
        assert on_disk("a" * 32) == 0  # still queued
        assert len(await store.run(store.trace, "b" * 32)) == 1
        await store.receive([span("c" * 32, now_us)])
        await asyncio.sleep(WRITE_DELAY_S + 0.5)
        assert on_disk("c" * 32) == 1

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_json_log_lines_carry_trace_and_span_ids(store: ServiceProcess) -> None:
    lines = [json.loads(line) for line in store.logs().splitlines() if line.startswith("{")]
    assert lines, store.logs()
    for line in lines:
        assert {"time", "level", "logger", "service", "message", "trace_id", "span_id"} <= set(line)
        assert line["service"] == "tracestore"
