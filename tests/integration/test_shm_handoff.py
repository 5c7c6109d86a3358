"""An ensemble's large tensors between stage processes through shared memory
(``shm_handoff``): the answers are those of messages, the buffers are used and
removed, and a stage without the setting gets messages."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.shared_memory import SHM_ROOT
from shared.tensors import decode_outputs, encode_inputs
from tests.harness import ServiceProcess
from tests.integration.test_orchestrator import ensemble, scale_model

WIDTH = 32768  # 128 KB of FP32 a row: over the handoff's 64 KB threshold
ON = "--shm-handoff=true"
PIPELINE = """
input [ { name: "X" data_type: TYPE_FP32 dims: [ WIDTH ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ WIDTH ] } ]
ensemble_scheduling { step [
  { model_name: "double" model_version: -1
    input_map { key: "X" value: "X" } output_map { key: "Y" value: "doubled" } },
  { model_name: "triple" model_version: -1
    input_map { key: "X" value: "doubled" } output_map { key: "Y" value: "Y" } }
] }
""".replace("WIDTH", str(WIDTH))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("handoff-repo")
    scale_model(root, "double", 2, width=WIDTH)
    scale_model(root, "triple", 3, width=WIDTH)
    ensemble(root, "pipeline", PIPELINE)
    return root


def mesh(repo: Path, stage_args: list[str]) -> tuple[ServiceProcess, ServiceProcess]:
    hosting = ["--model-repository", str(repo)]
    stage = ServiceProcess("services.inference.main", [*hosting, *stage_args])
    orchestrator = ServiceProcess(
        "services.orchestrator.main",
        [*hosting, "--stages", f"inference={stage.address}", "--metrics-port", "-1", ON],
    )
    return stage, orchestrator


@pytest.fixture(scope="module")
def handing_off(repo: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    stage, orchestrator = mesh(repo, [ON])
    yield stage, orchestrator
    orchestrator.stop()
    stage.stop()


def infer(address: str, rows: np.ndarray) -> np.ndarray:
    request = pb.ModelInferRequest(model_name="pipeline")
    encode_inputs(request, {"X": rows})
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return decode_outputs(stub.ModelInfer(request, timeout=60))["Y"]


def buffers(pid: int) -> list[Path]:
    return sorted(SHM_ROOT.glob(f"meshserve-handoff-{pid}-*"))


def opened_by(pid: int) -> list[str]:
    """The files process ``pid`` holds open."""
    folder = Path(f"/proc/{pid}/fd")
    found = []
    for link in folder.iterdir():
        with contextlib.suppress(OSError):
            found.append(os.readlink(link))
    return found


def test_the_answers_are_those_of_messages_and_the_buffers_are_used(
    handing_off: tuple[ServiceProcess, ServiceProcess],
) -> None:
    stage, orchestrator = handing_off
    rng = np.random.default_rng(7)
    batches = [rng.standard_normal((1 + i % 3, WIDTH)).astype(np.float32) for i in range(12)]
    # Concurrent callers: their requests also cross the steps stacked as one batch.
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda rows: infer(orchestrator.address, rows), batches))
    for rows, answer in zip(batches, answers, strict=True):
        np.testing.assert_array_equal(answer, rows * 6)
    # The orchestrator's buffers exist, are only its user's to open, and the stage
    # has them open: the tensors went through them, not only the answers' names.
    made = buffers(orchestrator.proc.pid)
    assert made, "no handoff buffer was made"
    assert all(path.stat().st_mode & 0o077 == 0 for path in made)
    assert set(opened_by(stage.proc.pid)) & {str(path) for path in made}


def test_the_buffers_go_when_the_orchestrator_stops(repo: Path) -> None:
    stage, orchestrator = mesh(repo, [ON])
    try:
        rows = np.ones((2, WIDTH), dtype=np.float32)
        np.testing.assert_array_equal(infer(orchestrator.address, rows), rows * 6)
        pid = orchestrator.proc.pid
        assert buffers(pid)
        assert orchestrator.stop() == 0
        assert buffers(pid) == []
    finally:
        orchestrator.stop()
        stage.stop()


def test_a_stage_without_the_setting_gets_messages(repo: Path) -> None:
    # The orchestrator reads the stage's extensions: no handoff buffers for a stage
    # that does not list the handoff, and so nothing for it to refuse.
    stage, orchestrator = mesh(repo, [])
    try:
        rows = np.full((2, WIDTH), 0.5, dtype=np.float32)
        np.testing.assert_array_equal(infer(orchestrator.address, rows), rows * 6)
        assert buffers(orchestrator.proc.pid) == []
        assert not [f for f in opened_by(stage.proc.pid) if "meshserve-handoff" in f]
    finally:
        orchestrator.stop()
        stage.stop()
