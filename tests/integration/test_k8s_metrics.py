"""The series the Prometheus adapter's rules read exist on a real stage's /metrics.

deploy/k8s/prometheus-adapter/values.yaml turns stage metrics into the
per-pod metrics the HorizontalPodAutoscalers scale on; a renamed metric would
leave every autoscaler without data and no error anywhere. A real inference
stage serves a request, its /metrics is scraped, and every series a rule
names must be there. vLLM's own ``vllm:*`` gauges appear only once an engine
runs; they are checked in the installed vLLM's source, where it names them
(the stage relays every ``vllm:*`` family it registers).
"""

from __future__ import annotations

import importlib.util
import re
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import encode_inputs
from tests.conftest import build_repository
from tests.harness import ServiceProcess

ADAPTER_VALUES = (
    Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "prometheus-adapter" / "values.yaml"
)


def series_named_by_rules() -> set[str]:
    """Every metric name the adapter's rules select or query."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    names: set[str] = set()
    for rule in rules:
        names |= set(re.findall(r'__name__="([^"]+)"', rule["seriesQuery"]))
        names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]))
        names |= {n for n in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["metricsQuery"])}
    return names - {"by", "sum", "rate", "clamp_min"}


@pytest.fixture(scope="module")
def stage_metrics(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The /metrics text of an inference stage after one request through its batcher."""
    repository = build_repository(tmp_path_factory.mktemp("k8s-metrics"), ["scale"], [])
    stage = ServiceProcess(
        "services.inference.main", ["--model-repository", str(repository), "--metrics-port", "0"]
    )
    try:
        request = pb.ModelInferRequest(model_name="scale")
        encode_inputs(request, {"X": np.ones((1, 4), dtype=np.float32)})
        with grpc.insecure_channel(stage.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            stub.ModelInfer(request, timeout=30)
        url = f"http://127.0.0.1:{stage.info['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text: str = response.read().decode()
        return text
    finally:
        stage.stop()


def test_every_series_the_autoscalers_read_is_exported(stage_metrics: str) -> None:
    exported = {line.split("{")[0].split(" ")[0] for line in stage_metrics.splitlines()}
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
