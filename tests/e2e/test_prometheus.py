"""A real Prometheus scrapes every process of a running mesh; the dashboards'
queries and the rules run on what it collected, and the latency histograms
link to traces through their exemplars.

Prometheus is Debian's package (``make system-packages``). Most panels read a
small mesh without vLLM (tests/e2e/small_mesh.py); the LLM panels read the
session's whole mesh (tests/e2e/conftest.py), whose engine is vLLM.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from deploy.grafana.dashboards import FOLDER, queries
from deploy.local.prometheus_config import (
    RULES,
    Target,
    render,
    scrape_config,
    targets_from_ready,
)
from deploy.local.supervisor import free_port
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.sources import sample_image
from shared.tensors import encode_inputs
from tests.e2e.conftest import streamed_chat
from tests.harness import RUNNING, log_tail, new_log
from tests.otlp import OtlpReceiver

pytestmark = pytest.mark.e2e

PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 1.0
LLM_DASHBOARD = "meshserve-llm"


@contextlib.contextmanager
def prometheus(targets: list[Target], folder: Path) -> Iterator[str]:
    """Prometheus (exemplar storage on) scraping ``targets`` every second; its base URL."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian package prometheus: make system-packages)")
    config = folder / "prometheus.yml"
    config.write_text(render(scrape_config(targets, [RULES], SCRAPE_S)))
    address = f"127.0.0.1:{free_port()}"
    log = new_log("prometheus")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address={address}",
                "--enable-feature=exemplar-storage",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    RUNNING[proc.pid] = ("prometheus", log)
    base = f"http://{address}"
    try:
        until(lambda: _get(f"{base}/-/ready", raw=True), 15, f"not ready:\n{log_tail(log)}")
        expected = {t.address for t in targets}

        def all_up() -> bool:
            active = (api(base, "targets") or {}).get("activeTargets", [])
            return {t["scrapeUrl"].split("/")[2] for t in active if t["health"] == "up"} == expected

        until(all_up, 20, f"not every target is up: {api(base, 'targets')}")
        yield base
    finally:
        proc.terminate()
        proc.wait(15)
        RUNNING.pop(proc.pid, None)


def _get(url: str, raw: bool = False) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
    except OSError:
        return None
    return body if raw else json.loads(body)["data"]


def api(base: str, path: str, **params: str) -> Any:
    """GET ``/api/v1/<path>`` with ``params``; its ``data``."""
    return _get(f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}")


def until(check: Callable[[], Any], timeout_s: float, message: str) -> Any:
    """Call ``check`` until it returns something truthy; fail with ``message`` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, message
        time.sleep(0.5)
    return result


def chat(mesh: dict[str, Any]) -> None:
    """A short streamed chat through Envoy."""
    base_url = f"http://{mesh['processes']['envoy']['grpc']}/v1"
    with urllib.request.urlopen(streamed_chat(base_url, "Name a colour.", 6), timeout=120) as r:
        assert r.read().decode().endswith("data: [DONE]\n\n")


def load(mesh: dict[str, Any]) -> None:
    """Two classifications, one of a broken image, and a streamed chat."""
    image = np.array([[sample_image("coffee.png").read_bytes()]], dtype=object)
    with grpc.insecure_channel(mesh["orchestrator"]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for data in (image, image, np.array([[b"not an image"]], dtype=object)):
            request = pb.ModelInferRequest(model_name="image_classifier")
            encode_inputs(request, {"IMAGE": data})
            try:
                stub.ModelInfer(request, timeout=60)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    chat(mesh)


def dashboard_queries(llm: bool) -> dict[str, str]:
    """{dashboard: panel -> PromQL} of the LLM dashboard or of the others, Grafana's
    variables filled in."""
    found = {}
    for path in sorted(FOLDER.glob("*.json")):
        if (path.stem == LLM_DASHBOARD) != llm:
            continue
        for index, (title, expr) in enumerate(queries(path.read_text())):
            promql = expr.replace("$__rate_interval", "1m").replace("$model", ".+")
            found[f"{path.stem}: {title} [{index}]"] = promql
    return found


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


def settle(load_once: Callable[[], None]) -> None:
    """Load in two rounds a few scrapes apart: the first creates the series a
    counter starts with, the second moves them (rate() needs both)."""
    load_once()
    time.sleep(2 * SCRAPE_S)
    load_once()
    time.sleep(2 * SCRAPE_S)


def assert_data(base: str, pending: dict[str, str]) -> None:
    """Each query has a finite value (within 20 s: rules and scrapes catch up)."""

    def remaining() -> bool:
        for name, promql in list(pending.items()):
            if finite(api(base, "query", query=promql)["result"]):
                del pending[name]
        return not pending

    until(remaining, 20, f"queries without data: {json.dumps(pending, indent=1)}")


def exemplar_trace_ids(base: str, metric: str, model: str) -> list[str]:
    """The trace ids of the exemplars Prometheus keeps on ``metric`` of ``model``."""

    def found() -> list[str]:
        series = api(base, "query_exemplars", query=f'{metric}{{model="{model}"}}', start="0")
        return [e["labels"]["trace_id"] for s in series or [] for e in s["exemplars"]]

    trace_ids: list[str] = until(found, 20, f"no exemplar on {metric} of {model}")
    assert all(len(t) == 32 and int(t, 16) for t in trace_ids)
    return trace_ids


@pytest.fixture(scope="module")
def small(small_mesh: dict[str, Any]) -> dict[str, Any]:
    return small_mesh


@pytest.fixture(scope="module")
def loaded(small: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus scraping the small mesh, every target up, after the load."""
    with prometheus(targets_from_ready(small), tmp_path_factory.mktemp("prometheus")) as base:
        settle(lambda: load(small))
        yield base


def test_every_process_of_the_mesh_is_a_target_and_up(loaded: str) -> None:
    def jobs_up() -> set[str]:
        """The jobs whose every target is up, by the target list and by ``up``."""
        targets = api(loaded, "targets")["activeTargets"]
        down = {t["labels"]["job"] for t in targets if t["health"] != "up"}
        up = {s["metric"]["job"] for s in api(loaded, "query", query="up == 1")["result"]}
        return ({t["labels"]["job"] for t in targets} - down) & up

    stages = {"orchestrator", "inference", "tokenizer", "preprocess", "postprocess"}
    wanted = stages | {"supervisor", "envoy"}
    targets = api(loaded, "targets")["activeTargets"]
    assert wanted <= {t["labels"]["job"] for t in targets}
    # A scrape may time out on a busy machine (its timeout is the 1 s interval): retry.
    every = {t["labels"]["job"] for t in targets}
    until(lambda: jobs_up() == every, 20, f"not every target up: {targets}")
    # The orchestrator serves REST itself (http_front_door's default): the HTTP front
    # door's metrics come with its job, and no adapter process is left to scrape.
    assert "http_adapter" not in every
    chats = 'meshserve_http_requests_total{job="orchestrator", route="/v1/chat/completions"}'
    until(lambda: api(loaded, "query", query=chats)["result"], 20, "no HTTP metrics")


def test_every_serving_process_froze_its_heap_once_ready(loaded: str) -> None:
    """Each stage and the orchestrator keeps what it loaded out of the collector's
    full passes (shared/gc_heap.py); the gauge says how many objects that is."""
    serving = {"orchestrator", "inference", "tokenizer", "preprocess", "postprocess"}

    def frozen() -> set[str]:
        result = api(loaded, "query", query="meshserve_gc_frozen_objects > 1000")["result"]
        return {s["metric"]["job"] for s in result}

    until(lambda: serving <= frozen(), 20, f"not frozen: {serving - frozen()}")


def test_envoy_shows_its_statistics_and_nothing_else_of_its_admin(
    loaded: str, small: dict[str, Any]
) -> None:
    """Envoy's own counters reach Prometheus through its metrics listener, which
    passes only reads of the statistics to the admin interface."""
    requests = 'envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="edge"}'
    until(lambda: api(loaded, "query", query=requests)["result"], 20, "no Envoy request count")
    port = small["processes"]["envoy"]["metrics_port"]
    for method, path in (("POST", "/quitquitquit"), ("GET", "/config_dump"), ("POST", "/metrics")):
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 404, (method, path)
    assert small["processes"]["envoy"]["pid"] in {p["pid"] for p in small["processes"].values()}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert b"envoy_server_live" in response.read()


def test_every_dashboard_query_returns_data(loaded: str) -> None:
    """Each panel's PromQL (but the LLM's) has a finite value after the load."""
    pending = dashboard_queries(llm=False)
    assert len(pending) >= 20
    assert_data(loaded, pending)


def test_rules_load_and_evaluate_on_the_mesh(loaded: str) -> None:
    groups = api(loaded, "rules")["groups"]
    assert {g["name"] for g in groups} == {"meshserve.recording", "meshserve.alerts"}
    broken = [r["name"] for g in groups for r in g["rules"] if r.get("health") == "err"]
    assert not broken
    ratio = until(
        lambda: api(loaded, "query", query="model:request_errors:ratio_rate5m")["result"],
        20,
        "no error ratio recorded",
    )
    assert "image_classifier" in {s["metric"]["model"] for s in ratio}


def test_latency_buckets_link_to_the_traces_of_their_requests(
    loaded: str, otlp: OtlpReceiver
) -> None:
    metric = "meshserve_request_duration_seconds_bucket"
    trace_ids = set(exemplar_trace_ids(loaded, metric, "image_classifier"))
    # The trace an exemplar names is one the mesh exported: a click on the bucket finds it.
    spans = otlp.wait_for(lambda spans: {s.trace_id for s in spans} & trace_ids)
    assert {s.trace_id for s in spans} & trace_ids


def test_the_llm_dashboard_has_data_from_vllm(
    mesh: dict[str, Any], otlp: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """On the session's mesh (vLLM): every LLM panel has data after two chats, and
    the time-to-first-token buckets link to the chats' traces."""
    folder = tmp_path_factory.mktemp("prometheus-llm")
    with prometheus(targets_from_ready(mesh), folder) as base:
        settle(lambda: chat(mesh))
        pending = dashboard_queries(llm=True)
        assert len(pending) >= 10
        assert_data(base, pending)
        metric = "meshserve_llm_time_to_first_token_seconds_bucket"
        trace_ids = set(exemplar_trace_ids(base, metric, "smollm2"))
    spans = otlp.wait_for(lambda spans: {s.trace_id for s in spans} & trace_ids)
    assert {s.trace_id for s in spans} & trace_ids


def test_a_crashed_stage_counts_as_a_restart_and_raises_its_alert(
    small: dict[str, Any], loaded: str
) -> None:
    """SIGKILL a stage: the supervisor restarts it, its restart counter moves, and
    StageRestarting fires (it has no ``for``). Last in the module: the stage comes back."""
    os.kill(small["processes"]["postprocess-0"]["pid"], signal.SIGKILL)
    restarts = 'meshserve_process_restarts_total{process="postprocess-0"}'
    until(
        lambda: [s for s in api(loaded, "query", query=restarts)["result"] if s["value"][1] == "1"],
        30,
        "the restart was not counted",
    )
    firing = 'ALERTS{alertname="StageRestarting", alertstate="firing"}'
    alerts = until(lambda: api(loaded, "query", query=firing)["result"], 20, "no alert")
    assert {a["metric"]["process"] for a in alerts} == {"postprocess-0"}
