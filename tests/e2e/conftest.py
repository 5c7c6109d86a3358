"""The whole local mesh on the default model repository, once per session."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.lora_repository import with_adapters
from tests.e2e.small_mesh import OtlpRelay, start_small_mesh
from tests.harness import ROOT, RUNNING, log_tail, new_log
from tests.otlp import OtlpReceiver

EDGE_MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 1 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1 }
  edge: true
  trace_store: false
  jobs: { enabled: false }
  restart_backoff_s: [0.2, 2.0]
  cpu_placement: off
"""
"""The smallest mesh with an edge: one inference stage, the orchestrator, Envoy
(start_mesh with a repository of the test's models)."""


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


def start_mesh(
    repository: Path, config: Path, extra: list[str]
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Run the supervisor with free ports; returns it and its ready info.

    Its stderr (its own lines and every service's) goes to a log whose end a
    failed test's report shows while the mesh runs."""
    log = new_log("deploy.local.supervisor")
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deploy.local.supervisor",
                "--model-repository",
                str(repository),
                "--config",
                str(config),
                "--ports",
                "auto",
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    RUNNING[proc.pid] = ("deploy.local.supervisor", log)
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("MESHSERVE_MESH_READY"):
            return proc, json.loads(line.split(" ", 1)[1])
    stop_mesh(proc)
    raise RuntimeError(f"the mesh did not become ready:\n{log_tail(log)}")


def stop_mesh(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the supervisor (it stops its children) and wait."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    RUNNING.pop(proc.pid, None)


@pytest.fixture(scope="session")
def mesh(
    prepared_repository: Path, otlp: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Every service of the default mesh, exporting spans to the mesh's own trace store
    (as by default), which forwards every batch to the test's receiver too; its
    smollm2 serves LoRA adapters, the prepared one among them (lora_repository.py)."""
    document = yaml.safe_load((ROOT / "deploy" / "local" / "mesh.yaml").read_text())
    document["services"].setdefault("tracestore", {})["forward_endpoint"] = otlp.endpoint
    config = tmp_path_factory.mktemp("mesh") / "mesh.yaml"
    config.write_text(yaml.safe_dump(document))
    repository = with_adapters(prepared_repository, tmp_path_factory.mktemp("lora"))
    proc, info = start_mesh(repository, config, [])
    yield info
    stop_mesh(proc)


@pytest.fixture(scope="session")
def otlp_relay(otlp: OtlpReceiver) -> Iterator[OtlpRelay]:
    """Where the small mesh's spans go: on to ``otlp``, and to any collector a test adds."""
    relay = OtlpRelay(otlp.endpoint)
    yield relay
    relay.stop()


@pytest.fixture(scope="session")
def small_mesh(
    prepared_repository: Path, otlp_relay: OtlpRelay, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The mesh without vLLM (tests/e2e/small_mesh.py), started once for the tests
    that need every service but not the engine; its ready info."""
    folder = tmp_path_factory.mktemp("small")
    proc, info = start_small_mesh(prepared_repository, folder, otlp_relay.endpoint)
    yield info
    stop_mesh(proc)


def streamed_chat(
    base_url: str, content: str, max_tokens: int, headers: Mapping[str, str] | None = None
) -> urllib.request.Request:
    """A greedy, streamed POST /v1/chat/completions of one user message to the llm."""
    body = {
        "model": "llm",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    return urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )


_ABORTED = "meshserve_llm_requests_finished_total[abort]"


def llm_metrics(metrics_port: int) -> dict[str, float]:
    """The inference service's ``meshserve_llm_*`` samples, summed over labels but
    ``finish_reason`` (kept as ``name[reason]``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"(meshserve_llm_\w+)(\{[^}]*\})? (\S+)$", line)
        if match:
            reason = re.search(r'finish_reason="(\w+)"', match[2] or "")
            name = f"{match[1]}[{reason[1]}]" if reason else match[1]
            samples[name] = samples.get(name, 0.0) + float(match[3])
    return samples


def aborted_generations(metrics_port: int) -> float:
    """How many generations the inference service has aborted so far."""
    return llm_metrics(metrics_port).get(_ABORTED, 0.0)


def wait_for_abort(metrics_port: int, before: float) -> None:
    """Until the engine has dropped a request (one more aborted than ``before``)
    and holds nothing running, waiting or unfinished; fails after 15 s."""
    names = [f"meshserve_llm_requests_{n}" for n in ("running", "waiting", "unfinished")]
    deadline = time.monotonic() + 15
    while True:  # the abort completes on the server a moment after the client goes
        samples = llm_metrics(metrics_port)
        if samples.get(_ABORTED, 0.0) > before and not any(samples[n] for n in names):
            return
        assert time.monotonic() < deadline, f"the generation was not aborted: {samples}"
        time.sleep(0.2)


def post(url: str, body: Any) -> tuple[int, Message, bytes]:
    """POST JSON (or raw bytes); the status, the headers (case-insensitive), the body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def openai_error(url: str, body: Any, status: int) -> dict[str, Any]:
    """POST ``body``, expecting ``status`` with an error in OpenAI's shape; the error."""
    got, headers, raw = post(url, body)
    assert got == status, raw
    assert headers["Content-Type"].startswith("application/json")
    error: dict[str, Any] = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    return error
