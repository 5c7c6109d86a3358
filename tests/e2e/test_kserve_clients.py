"""KServe's own Python clients through Envoy: InferenceRESTClient (protocol v2,
JSON and binary tensors) and InferenceGRPCClient get the orchestrator's answers.

kserve runs in its own venv (`make kserve-client`, a prerequisite of `make
test`): its generated gRPC code defines the same `inference` protobuf package
as ours, and its pins would move the main venv's packages.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import cache_dir
from tests.e2e.conftest import post
from tests.harness import ROOT

pytestmark = pytest.mark.e2e

KSERVE_PYTHON = cache_dir() / "venvs" / "kserve-0.21.0" / "bin" / "python"


def run_kserve_client(*args: Any) -> dict[str, Any]:
    """Run tests/clients/kserve_infer.py under the kserve venv; its JSON stdout."""
    assert KSERVE_PYTHON.exists(), "kserve's venv is missing: run `make kserve-client`"
    # Nothing of ours on its path: its `inference` package must be kserve's own.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(KSERVE_PYTHON), str(ROOT / "tests" / "clients" / "kserve_infer.py")]
        + [json.dumps(a) for a in args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert done.returncode == 0, f"kserve_infer.py failed ({done.returncode}):\n{done.stderr}"
    facts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return facts


def test_kserve_rest_and_grpc_clients_through_envoy(mesh: dict[str, Any], tmp_path: Path) -> None:
    address = mesh["processes"]["envoy"]["grpc"]
    inputs = {"INPUT0": np.random.default_rng(7).standard_normal((2, 16)).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **inputs)
    facts = run_kserve_client(address, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))

    direct = pb.ModelInferRequest(model_name="mlp")
    encode_inputs(direct, inputs)
    with grpc.insecure_channel(mesh["orchestrator"]) as channel:
        want = decode_outputs(pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(direct))
    cases = ["rest_json", "rest_binary", "rest_dict_with_version", "grpc_raw", "grpc_typed"]
    with np.load(tmp_path / "out.npz") as got:
        assert sorted(got.files) == sorted(cases)
        for case in cases:
            np.testing.assert_allclose(got[case], want["OUTPUT0"], rtol=1e-5, err_msg=case)

    assert facts["rest_ready"] == [True, True]
    assert facts["grpc_ready"] == [True, True]
    for kind in ("json", "binary", "grpc"):
        embedding = facts[f"embedding_{kind}"]
        assert embedding["shape"] == [2, 384], kind
        assert embedding["cosine"] > 0.5, kind  # two sentences about a guitar

    refused = facts["contradiction"]
    assert refused is not None, "a body naming another model than the URL was answered"
    assert refused["status"] == 400
    assert "model_name 'text_embedding'" in refused["error"]
    assert "model 'mlp' in the URL" in refused["error"]


@pytest.mark.parametrize(
    ("body_fields", "path", "status", "words"),
    [
        ({"model_name": "mlp", "model_version": "1"}, "/v2/models/mlp/infer", 200, None),
        ({"model_name": "mlp"}, "/v2/models/mlp/versions/1/infer", 200, None),
        ({"model_name": "x" * 500}, "/v2/models/mlp/infer", 400, "model_name 'xxx"),
        ({"model_version": "9"}, "/v2/models/mlp/versions/1/infer", 400, "model_version '9'"),
    ],
)
def test_body_model_fields_agree_with_the_url_or_are_400(
    mesh: dict[str, Any], body_fields: dict[str, str], path: str, status: int, words: str | None
) -> None:
    edge = f"http://{mesh['processes']['envoy']['grpc']}"
    body = {
        **body_fields,
        "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}],
    }
    got, _, raw = post(f"{edge}{path}", body)
    assert got == status, raw
    if words is not None:
        error = json.loads(raw)["error"]
        assert words in error
        assert len(error) < 400  # the 500-character name is cut short
