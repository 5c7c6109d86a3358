"""Find your request: one chat completion through Envoy with curl, its trace id
from the response header, and the whole trace from the mesh's own trace store:
``meshserve trace``, Jaeger's API through Envoy, and the /traces page in a real
browser (Debian's chromium driven by playwright)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from tests.harness import ROOT

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
HOPS = {"envoy", "orchestrator", "tokenizer", "inference", "postprocess"}
FRONT_DOOR = "POST /v1/chat/completions"
"""The HTTP server span: the orchestrator serves REST itself (http_front_door's default)."""
SCREENSHOTS = os.environ.get("MESHSERVE_SCREENSHOTS")
"""A folder to save the page's screenshots in (docs/images when the docs are refreshed)."""


@pytest.fixture(scope="module")
def edge(mesh: dict[str, Any]) -> str:
    return f"http://{mesh['processes']['envoy']['grpc']}"


@pytest.fixture(scope="module")
def chat(edge: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One chat completion with the real curl: its response headers and body."""
    headers = tmp_path_factory.mktemp("chat") / "headers.txt"
    body = {
        "model": "llm",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "-D",
            str(headers),
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
            f"{edge}/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = headers.read_text().splitlines()
    fields = dict(line.lower().split(": ", 1) for line in lines if ": " in line)
    return {"status": lines[0], "headers": fields, "body": json.loads(done.stdout)}


def trace_id_of(chat: dict[str, Any]) -> str:
    traceparent: str = chat["headers"]["traceparent"]
    version, trace_id, span_id, flags = traceparent.split("-")
    assert (version, len(trace_id), len(span_id), flags) == ("00", 32, 16, "01"), traceparent
    return trace_id


def meshserve_trace(edge: str, trace_id: str) -> dict[str, Any]:
    """``meshserve trace ID --json`` once every hop's spans have reached the store."""
    deadline = time.monotonic() + 30
    while True:
        shown = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "trace", trace_id, "--json", "--url", edge],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        fall: dict[str, Any] = json.loads(shown.stdout)
        # Each process exports on its own schedule (every 0.5 s): a hop's server span
        # may arrive after its children's, or after the spans of the hops above it.
        # The orchestrator ends two: the chat's HTTP span, and its meshserve.v1 call.
        servers = [row for row in fall["rows"] if row["kind"] == "server"]
        ended = {row["service"] for row in servers}
        ended |= {row["name"] for row in servers if row["service"] == "orchestrator"}
        if ended >= HOPS | {FRONT_DOOR}:
            return fall
        assert time.monotonic() < deadline, f"server spans missing: {(HOPS | {FRONT_DOOR}) - ended}"
        time.sleep(0.5)


def test_a_chat_is_found_by_the_trace_id_its_response_returned(
    edge: str, chat: dict[str, Any]
) -> None:
    assert " 200" in chat["status"]
    trace_id = trace_id_of(chat)
    assert chat["headers"]["x-request-id"]
    assert chat["body"]["id"] == f"chatcmpl-{trace_id}"

    fall = meshserve_trace(edge, trace_id)
    assert fall["trace_id"] == trace_id
    rows = fall["rows"]
    (envoy,) = [r for r in rows if r["service"] == "envoy" and r["depth"] == 0]
    servers = {r["service"]: r for r in rows if r["kind"] == "server" and r["depth"] > 0}
    assert HOPS - {"envoy"} <= set(servers)
    for stage in ("tokenizer", "inference", "postprocess"):
        served = [r for r in rows if r["service"] == stage and r["kind"] == "server"]
        # Each stage says how long its request queued and computed, and the
        # orchestrator's call to it how long the wire and (de)serialisation took.
        assert any(r["queue_us"] is not None and r["compute_us"] for r in served), stage
        assert all(r["network_us"] is not None and r["network_us"] >= 0 for r in served), stage
    # The HTTP front door's span is the orchestrator's, right under Envoy's.
    (door,) = [r for r in rows if r["kind"] == "server" and r["name"] == FRONT_DOOR]
    assert door["service"] == "orchestrator"
    assert {r["span_id"]: r for r in rows}[door["parent_id"]]["service"] == "envoy"
    assert door["network_us"] is not None  # Envoy -> the orchestrator's HTTP port
    assert all(r["offset_us"] + r["duration_us"] <= fall["duration_us"] + 1000 for r in rows)
    # Envoy's span holds the others; a span another process ends may outlast
    # it by the time that process takes to close it after the last byte left
    # (under 1 ms on a quiet host, a few ms when the CPU is contended).
    assert envoy["duration_us"] + 20_000 >= max(r["duration_us"] for r in rows)

    text = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "trace", trace_id, "--url", edge],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    ).stdout
    assert f"trace {trace_id}" in text and "QUEUE" in text and "NETWORK" in text
    assert all(f"{hop}: " in text for hop in HOPS)


def test_the_same_trace_in_jaegers_shape_through_envoy(edge: str, chat: dict[str, Any]) -> None:
    trace_id = trace_id_of(chat)
    meshserve_trace(edge, trace_id)
    done = subprocess.run(
        ["curl", "-sS", "--fail", f"{edge}/api/traces/{trace_id}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer = json.loads(done.stdout)
    assert answer["errors"] is None and answer["total"] == 1
    (trace,) = answer["data"]
    assert trace["traceID"] == trace_id
    services = {p["serviceName"] for p in trace["processes"].values()}
    assert services >= HOPS
    ids = {s["spanID"] for s in trace["spans"]}
    for span in trace["spans"]:
        assert span["traceID"] == trace_id and span["startTime"] > 0 and span["duration"] >= 0
        assert all(ref["spanID"] in ids for ref in span["references"]) or span is trace["spans"][0]
    done = subprocess.run(
        ["curl", "-sS", "--fail", f"{edge}/api/services"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert set(json.loads(done.stdout)["data"]) >= HOPS


def test_grpc_trailers_carry_the_trace(edge: str) -> None:
    with grpc.insecure_channel(edge.removeprefix("http://")) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        _, call = stub.ModelMetadata.with_call(pb.ModelMetadataRequest(name="llm"), timeout=30)
    trailers = dict(call.trailing_metadata() or ())
    version, trace_id, _, _ = str(trailers["traceparent"]).split("-")
    assert version == "00" and len(trace_id) == 32


def test_the_traces_page_shows_the_chat_in_a_real_browser(edge: str, chat: dict[str, Any]) -> None:
    if not CHROMIUM.exists() or shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (make system-packages installs it)")
    playwright = pytest.importorskip("playwright.sync_api")
    trace_id = trace_id_of(chat)
    meshserve_trace(edge, trace_id)
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM))
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.goto(f"{edge}/traces")
            # The list of recent requests holds the chat, under its model.
            page.select_option("#model", "llm")
            page.wait_for_selector(f"tr.trace[data-trace-id='{trace_id}']", timeout=15_000)
            if SCREENSHOTS:
                page.screenshot(path=f"{SCREENSHOTS}/traces-list.png")
            # Found by the traceparent its response returned.
            page.fill("#trace-id", chat["headers"]["traceparent"])
            page.click("#open")
            page.wait_for_selector("#waterfall tr.span", timeout=15_000)
            shown = page.eval_on_selector_all(
                "#waterfall tr.span",
                "rows => rows.map(r => [r.dataset.service, "
                "r.querySelector('.compute').textContent])",
            )
            assert {service for service, _ in shown} >= HOPS
            assert any(service == "inference" and compute for service, compute in shown)
            assert trace_id in page.inner_text("#detail h2")
            if SCREENSHOTS:
                page.screenshot(path=f"{SCREENSHOTS}/traces-waterfall.png", full_page=True)
        finally:
            browser.close()
