"""Arize Phoenix as the mesh's OTLP collector: one trace per request, with the
spans of every service on its path, read back through Phoenix's REST API.

Every span batch the mesh's services export reaches Phoenix's OTLP/gRPC port
as sent (through the session's relay, tests/e2e/small_mesh.py), as it would
reach Jaeger, Tempo or an OpenTelemetry Collector. The mesh is the session's
small one (tests/e2e/small_mesh.py) with the whole chat path (Envoy, the
orchestrator with its HTTP front door, tokenizer, engine, detokenizer) but a
stand-in engine in place of vLLM, whose start-up would cost more than the rest
of this test; the image path is the real MobileNetV2.
Phoenix runs from its own venv (``make phoenix``).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from deploy.local.supervisor import free_port
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.sources import sample_image
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import cache_dir
from tests.e2e.conftest import streamed_chat
from tests.e2e.small_mesh import OtlpRelay
from tests.harness import RUNNING, new_log

pytestmark = pytest.mark.e2e

PHOENIX = cache_dir() / "venvs" / "phoenix" / "bin" / "phoenix"
CHAT_PATH = {
    "envoy": None,
    "http_front_door": None,  # the orchestrator's HTTP server span (its process by default)
    "orchestrator": "llm",
    "tokenizer": "smollm2_tokenizer",
    "inference": "smollm2",
    "postprocess": "smollm2_detokenizer",
}
IMAGE_PATH = {
    "envoy": None,
    "orchestrator": "image_classifier",
    "preprocess": "image_preprocess",
    "inference": "mobilenet_v2_onnx",
    "postprocess": "imagenet_top5",
}


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Phoenix on free ports, starting (it takes a while); (its HTTP URL, its OTLP/gRPC address)."""
    if not PHOENIX.exists():
        pytest.skip(f"Arize Phoenix is not installed at {PHOENIX} (make phoenix)")
    http_port, grpc_port = free_port(), free_port()
    environment = {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(http_port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": str(tmp_path_factory.mktemp("phoenix")),
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    log = new_log("phoenix")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(PHOENIX), "serve"], env=environment, stdout=out, stderr=subprocess.STDOUT
        )
    RUNNING[proc.pid] = ("phoenix", log)
    try:
        yield f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        proc.wait(30)
        RUNNING.pop(proc.pid, None)


def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "Phoenix did not start"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def traced_mesh(
    phoenix: tuple[str, str], small_mesh: dict[str, Any], otlp_relay: OtlpRelay
) -> Iterator[dict[str, Any]]:
    """The chat and image paths, every service's span batches reaching Phoenix."""
    # Once Phoenix listens: a channel that found nobody there backs off for a while.
    wait_ready(phoenix[0], 180)
    otlp_relay.add(phoenix[1])
    try:
        yield small_mesh
    finally:
        otlp_relay.remove(phoenix[1])


def phoenix_spans(url: str) -> list[dict[str, Any]]:
    """Every span Phoenix holds in its default project (all pages)."""
    spans: list[dict[str, Any]] = []
    cursor = ""
    while True:
        query = urllib.parse.urlencode({"limit": 1000, **({"cursor": cursor} if cursor else {})})
        with urllib.request.urlopen(f"{url}/v1/projects/default/spans?{query}", timeout=10) as r:
            page = json.load(r)
        spans += page["data"]
        cursor = page.get("next_cursor") or ""
        if not cursor:
            return spans


def flat(attributes: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Phoenix nests dotted attribute names ({"rpc": {"method": ...}}): flatten them."""
    found: dict[str, Any] = {}
    for key, value in attributes.items():
        if isinstance(value, dict):
            found.update(flat(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def service_of(span: dict[str, Any], root: str) -> str | None:
    """Which service made ``span``: Phoenix keeps no resource, so tell it by what the
    span says (the root is Envoy's; server spans name the model they serve)."""
    attributes = flat(span.get("attributes") or {})
    if span["parent_id"] == root:
        return "envoy"
    if "http.route" in attributes:
        return "http_front_door"
    model = attributes.get("meshserve.model")
    if model is None or span["name"].startswith("ensemble step"):
        return None  # a client span, or the orchestrator's span around an ensemble step
    for stage, hosted in (*CHAT_PATH.items(), *IMAGE_PATH.items()):
        if hosted == model:
            return stage
    return None


def one_trace(url: str, trace_id: str, root: str, path: dict[str, str | None]) -> list[dict]:  # type: ignore[type-arg]
    """The trace's spans once every service of ``path`` has exported its span (30 s)."""
    deadline = time.monotonic() + 30
    while True:
        spans = [s for s in phoenix_spans(url) if s["context"]["trace_id"] == trace_id]
        services = {service_of(s, root) for s in spans}
        if set(path) <= services:
            return spans
        assert time.monotonic() < deadline, f"missing {set(path) - services}: {spans}"
        time.sleep(1)


def assert_linked(spans: list[dict[str, Any]], root: str) -> None:
    """One tree: Envoy's span hangs under the caller's, every other span under one in
    the trace, and each stage's span under the orchestrator's, under Envoy's."""
    by_id = {s["context"]["span_id"]: s for s in spans}
    roots = [s for s in spans if s["parent_id"] == root]
    assert len(roots) == 1, roots
    orphans = [s["name"] for s in spans if s["parent_id"] != root and s["parent_id"] not in by_id]
    assert not orphans

    def above(span: dict[str, Any]) -> set[str | None]:
        found = set()
        while span["parent_id"] in by_id:
            span = by_id[span["parent_id"]]
            found.add(service_of(span, root))
        return found

    for span in spans:
        if service_of(span, root) in {"tokenizer", "inference", "preprocess", "postprocess"}:
            assert {"orchestrator", "envoy"} <= above(span), span


def test_a_streamed_chat_is_one_trace_in_phoenix(
    traced_mesh: dict[str, Any], phoenix: tuple[str, str]
) -> None:
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    base_url = f"http://{traced_mesh['processes']['envoy']['grpc']}/v1"
    request = streamed_chat(
        base_url, "Say hello.", 6, headers={"traceparent": f"00-{trace_id}-{caller}-01"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        body = response.read().decode()
    assert body.count("data: ") > 3 and body.endswith("data: [DONE]\n\n")
    spans = one_trace(phoenix[0], trace_id, caller, CHAT_PATH)
    assert_linked(spans, caller)


def test_an_image_classification_is_one_trace_in_phoenix(
    traced_mesh: dict[str, Any], phoenix: tuple[str, str]
) -> None:
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    request = pb.ModelInferRequest(model_name="image_classifier")
    image = np.array([[sample_image("coffee.png").read_bytes()]], dtype=object)
    encode_inputs(request, {"IMAGE": image})
    with grpc.insecure_channel(traced_mesh["processes"]["envoy"]["grpc"]) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=60, metadata=[("traceparent", f"00-{trace_id}-{caller}-01")]
        )
    assert decode_outputs(response)["LABELS"][0][0] == b"espresso"
    spans = one_trace(phoenix[0], trace_id, caller, IMAGE_PATH)
    assert_linked(spans, caller)
