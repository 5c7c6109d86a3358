"""A real stage, as deploy/k8s runs it: the autoscalers' series and the probes.

The series the Prometheus adapter's rules read must exist on its /metrics.

deploy/k8s/prometheus-adapter/values.yaml turns stage metrics into the
per-pod metrics the HorizontalPodAutoscalers scale on; a renamed metric would
leave every autoscaler without data and no error anywhere. A real inference
stage (the tokenizer: the quickest to start; every stage exports the same
series from the shared batcher) serves a request, its /metrics is scraped,
and every series a rule names must be there. vLLM's own ``vllm:*`` gauges appear only once an engine
runs; they are checked in the installed vLLM's source, where it names them
(the stage relays every ``vllm:*`` family it registers).

The stage speaks mutual TLS, as under deploy/k8s/components/mtls, where the
pods' probes are the image's health check (deploy/k8s/image/healthcheck.py):
it must find the stage SERVING with the pod's certificate and fail without.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from deploy.local.certs import MeshCertificates, make_certificates
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import encode_inputs
from tests.conftest import build_repository
from tests.harness import ServiceProcess

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
HEALTHCHECK = K8S / "image" / "healthcheck.py"


def series_named_by_rules() -> set[str]:
    """Every metric name the adapter's rules select or query."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    names: set[str] = set()
    for rule in rules:
        names |= set(re.findall(r'__name__="([^"]+)"', rule["seriesQuery"]))
        names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]))
        names |= {n for n in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["metricsQuery"])}
    return names - {"by", "sum", "rate", "clamp_min"}


@dataclass(frozen=True)
class Stage:
    """What the tests need of the stage once it has served a request."""

    grpc_port: int
    metrics: str
    certificates: MeshCertificates


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory, prepared_repository: Path) -> Iterator[Stage]:
    """A tokenizer stage with mutual TLS, after one request through its batcher."""
    repository = build_repository(
        tmp_path_factory.mktemp("k8s-stage"), [], ["minilm_tokenizer"], prepared_repository
    )
    certificates = make_certificates(tmp_path_factory.mktemp("k8s-mtls"))
    args = ["--model-repository", str(repository), "--metrics-port", "0", "--grace-period-s", "1"]
    args += ["--mtls-cert", str(certificates.cert), "--mtls-key", str(certificates.key)]
    args += ["--mtls-ca", str(certificates.ca)]
    service = ServiceProcess("services.tokenizer.main", args)
    port = int(service.address.rsplit(":", 1)[1])
    try:
        request = pb.ModelInferRequest(model_name="minilm_tokenizer")
        encode_inputs(request, {"TEXT": np.array([[b"queued, then tokenized"]], dtype=object)})
        credentials = grpc.ssl_channel_credentials(
            certificates.ca.read_bytes(),
            certificates.key.read_bytes(),
            certificates.cert.read_bytes(),
        )
        # The certificate names localhost, not the address the stage printed.
        with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            stub.ModelInfer(request, timeout=30)
        url = f"http://127.0.0.1:{service.info['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            metrics: str = response.read().decode()
        yield Stage(port, metrics, certificates)
    finally:
        service.stop()


def healthcheck(port: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the image's health check as the mtls component's exec probes do."""
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), "--port", str(port)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_every_series_the_autoscalers_read_is_exported(stage: Stage) -> None:
    exported = {line.split("{")[0].split(" ")[0] for line in stage.metrics.splitlines()}
    exported.discard("#")
    ours = {name for name in series_named_by_rules() if not name.startswith("vllm:")}
    assert len(ours) >= 3  # the parse found the rules' names
    assert ours <= exported, f"not on a stage's /metrics: {sorted(ours - exported)}"


def test_vllm_series_are_names_vllm_registers() -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    for name in (n for n in series_named_by_rules() if n.startswith("vllm:")):
        assert f'name="{name}"' in source, f"vLLM registers no {name}"


def test_health_check_probes_a_mutual_tls_stage(stage: Stage) -> None:
    certificates = stage.certificates
    pod = {
        "MESHSERVE_MTLS_CERT": str(certificates.cert),
        "MESHSERVE_MTLS_KEY": str(certificates.key),
        "MESHSERVE_MTLS_CA": str(certificates.ca),
    }
    done = healthcheck(stage.grpc_port, pod)
    assert done.returncode == 0, done.stderr
    # Without the pod's certificate (what kubelet's own gRPC probe has): refused.
    done = healthcheck(stage.grpc_port, {})
    assert done.returncode == 1
    assert "failed" in done.stderr
