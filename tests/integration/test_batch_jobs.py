"""Batch jobs end to end: the openai SDK through Envoy, Redis, two workers, the orchestrator.

One mesh for the module (MiniLM's text_embedding pipeline, the ``slow`` test
model, Redis, two batch workers). A worker is SIGKILLed mid-job, and Redis is
restarted mid-job: each time every input line gets exactly one result line,
checked by custom_id. (A restart of the whole mesh mid-job, and the 500-line
embeddings batch, run in loadtests/bench_batch.py: they cost too much here.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from openai import OpenAI

from tests.conftest import build_repository
from tests.e2e.conftest import start_mesh, stop_mesh
from tests.harness import ROOT

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="needs Debian's redis-server (make system-packages installs it)",
)

MESH = """
defaults: {{ host: 127.0.0.1, grace_period_s: 3 }}
services:
  batch: {{ concurrency: 4, claim_idle_s: 2 }}
supervisor:
  stages:
    - {{ name: inference, module: services.inference.main, replicas: 1 }}
    - {{ name: tokenizer, module: services.tokenizer.main, replicas: 1 }}
    - {{ name: postprocess, module: services.postprocess.main, replicas: 1 }}
  edge: true
  restart_backoff_s: [0.2, 1.0]
  cpu_placement: off
  jobs: {{ enabled: true, workers: 2, dir: {jobs} }}
"""
EMBEDDINGS = 100
"""Lines of the embeddings batch (loadtests/bench_batch.py runs 500)."""


class Mesh:
    """The module's mesh; a test may stop and start it again (same Redis AOF, same files)."""

    def __init__(self, repository: Path, config: Path) -> None:
        self.repository, self.config = repository, config
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> None:
        self.proc, self.info = start_mesh(self.repository, self.config, ["--grace-s", "5"])

    def stop(self) -> None:
        if self.proc is not None:
            stop_mesh(self.proc)
            self.proc = None

    def client(self) -> OpenAI:
        edge = self.info["processes"]["envoy"]["grpc"]
        return OpenAI(base_url=f"http://{edge}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, prepared_repository: Path) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("batch")
    names = ["minilm", "minilm_tokenizer", "mean_pool", "text_embedding"]
    repository = build_repository(root / "repo", ["slow"], names, prepared_repository)
    config = root / "mesh.yaml"
    config.write_text(MESH.format(jobs=root / "jobs"))
    running = Mesh(repository, config)
    running.start()
    yield running
    running.stop()


def submit(client: OpenAI, lines: list[dict[str, Any]], endpoint: str) -> str:
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("input.jsonl", text), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )
    assert batch.status == "in_progress"
    assert batch.request_counts is not None and batch.request_counts.total == len(lines)
    return batch.id


def wait_done(mesh: Mesh, batch_id: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            batch = mesh.client().batches.retrieve(batch_id)
        except openai.InternalServerError as exc:  # 503 while Redis restarts
            assert exc.status_code == 503, exc
            time.sleep(0.2)
            continue
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not finish: {batch}")


def results(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    text = client.files.content(file_id).text
    return [json.loads(row) for row in text.splitlines() if row.strip()]


def slow_lines(count: int, ms: int) -> list[dict[str, Any]]:
    body = {"inputs": [{"name": "MS", "datatype": "INT32", "shape": [1], "data": [ms]}]}
    return [
        {"custom_id": f"s-{i}", "method": "POST", "url": "/v2/models/slow/infer", "body": body}
        for i in range(count)
    ]


def assert_each_once(rows: list[dict[str, Any]], count: int) -> None:
    ids = [row["custom_id"] for row in rows]
    assert len(ids) == count, f"{len(ids)} result lines for {count} input lines"
    assert set(ids) == {f"s-{i}" for i in range(count)}
    assert all(row["response"]["status_code"] == 200 for row in rows)
    assert all(row["response"]["body"]["outputs"][0]["data"] for row in rows)


def test_embeddings_batch_matches_online(mesh: Mesh) -> None:
    client = mesh.client()
    topics = ("cats", "ships", "rain")
    texts = [f"sentence number {i} is about {topics[i % 3]}" for i in range(EMBEDDINGS)]
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "text_embedding", "input": text},
        }
        for i, text in enumerate(texts)
    ]
    batch = wait_done(mesh, submit(client, lines, "/v1/embeddings"))
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == EMBEDDINGS and batch.request_counts.failed == 0
    rows = {row["custom_id"]: row for row in results(client, batch.output_file_id)}
    assert len(rows) == EMBEDDINGS
    for i in range(0, EMBEDDINGS, 25):
        online = client.embeddings.create(model="text_embedding", input=texts[i])
        offline = rows[f"e-{i}"]["response"]["body"]["data"][0]["embedding"]
        np.testing.assert_allclose(offline, online.data[0].embedding, atol=1e-5)


def test_bad_line_is_named_on_upload(mesh: Mesh) -> None:
    good = slow_lines(2, 1)
    text = json.dumps(good[0]) + "\n" + json.dumps(good[1]) + "\n{not json\n"
    response = mesh.client().files.with_raw_response
    with pytest.raises(Exception) as failure:
        response.create(file=("bad.jsonl", text.encode()), purpose="batch")
    assert "line 3" in str(failure.value) and "400" in str(failure.value)


def test_cancel_skips_the_rest(mesh: Mesh) -> None:
    client = mesh.client()
    batch_id = submit(client, slow_lines(200, 50), "/v2/models/slow/infer")
    time.sleep(0.5)
    assert client.batches.cancel(batch_id).status == "cancelling"
    batch = wait_done(mesh, batch_id)
    assert batch.status == "cancelled"
    assert 0 < batch.request_counts.completed < 200


def test_worker_killed_mid_job_answers_each_line_once(mesh: Mesh) -> None:
    client = mesh.client()
    count = 40
    batch_id = submit(client, slow_lines(count, 100), "/v2/models/slow/infer")
    while client.batches.retrieve(batch_id).request_counts.completed < 5:  # type: ignore[union-attr]
        time.sleep(0.05)
    os.kill(mesh.info["processes"]["batch-0"]["pid"], signal.SIGKILL)
    batch = wait_done(mesh, batch_id)
    assert batch.status == "completed"
    assert_each_once(results(client, batch.output_file_id), count)


def meshserve(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "deploy.cli", *args]
    return subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_cli_submits_v2_requests_and_reads_results(mesh: Mesh, tmp_path: Path) -> None:
    url = f"http://{mesh.info['processes']['envoy']['grpc']}"
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(line["body"]) + "\n" for line in slow_lines(5, 1)))
    submitted = meshserve("job", "submit", str(source), "--model", "slow", "--wait", "--url", url)
    assert submitted.returncode == 0, submitted.stderr
    batch_id, final = submitted.stdout.split()[0], submitted.stdout.strip().splitlines()[-1]
    assert "completed" in final and "5/5 (0 failed)" in final
    answered = meshserve("job", "results", batch_id, "--url", url)
    rows = [json.loads(row) for row in answered.stdout.splitlines()]
    assert sorted(row["custom_id"] for row in rows) == [f"line-{n}" for n in range(1, 6)]
    missing = meshserve("job", "status", "batch-nope", "--url", url)
    assert missing.returncode != 0 and "404" in missing.stderr and "batch-nope" in missing.stderr


def test_meshserve_v1_jobs_transcoded_by_envoy(mesh: Mesh) -> None:
    edge = f"http://{mesh.info['processes']['envoy']['grpc']}"
    lines = "".join(json.dumps(line) + "\n" for line in slow_lines(3, 1))
    body = {"endpoint": "/v2/models/slow/infer", "input_jsonl": lines, "metadata": {"k": "v"}}
    earlier = http_json(f"{edge}/api/v1/jobs", body)["job"]  # made in the same second
    job = http_json(f"{edge}/api/v1/jobs", body)["job"]
    assert job["status"] == "in_progress" and job["counts"]["total"] == 3
    deadline = time.monotonic() + 30
    while job["status"] != "completed" and time.monotonic() < deadline:
        time.sleep(0.1)
        job = http_json(f"{edge}/api/v1/jobs/{job['id']}")["job"]
    assert job["counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert job.get("output_file_id") and job["metadata"] == {"k": "v"}, job
    listed = http_json(f"{edge}/api/v1/jobs?limit=1")  # newest first
    assert listed["jobs"][0]["id"] == job["id"] and listed["has_more"] is True
    after = http_json(f"{edge}/api/v1/jobs?limit=1&after={job['id']}")
    assert after["jobs"][0]["id"] == earlier["id"]
    with pytest.raises(urllib.error.HTTPError) as missing:
        http_json(f"{edge}/api/v1/jobs/batch-nope")
    assert missing.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as bad:
        http_json(f"{edge}/api/v1/jobs", {"endpoint": "/v1/nope", "input_jsonl": lines})
    assert bad.value.code == 400 and "endpoint" in bad.value.read().decode()


def http_json(url: str, body: Any = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as answer:
        document: dict[str, Any] = json.load(answer)
        return document


def test_job_survives_a_restart_of_redis(mesh: Mesh) -> None:
    count = 40
    client = mesh.client()
    batch_id = submit(client, slow_lines(count, 100), "/v2/models/slow/infer")
    while client.batches.retrieve(batch_id).request_counts.completed < 5:  # type: ignore[union-attr]
        time.sleep(0.05)
    # SIGTERM: Redis writes its AOF and exits; the supervisor starts it again on its port.
    os.kill(mesh.info["processes"]["redis"]["pid"], signal.SIGTERM)
    batch = wait_done(mesh, batch_id)
    assert batch.status == "completed"
    assert_each_once(results(client, batch.output_file_id), count)
