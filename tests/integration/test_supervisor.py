"""The local supervisor: starts the mesh, restarts a crashed stage (by its standby),
stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from deploy.local.procfs import child_pids, start_ticks
from deploy.local.standby import STANDBY_NAME
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import build_repository
from tests.e2e.conftest import start_mesh, stop_mesh
from tests.integration.test_orchestrator import DIAMOND, ensemble, scale_model

MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 3 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1, standby: true }
  restart_backoff_s: [0.2, 2.0]
"""
COLOCATABLE = """stages:
    - { name: postprocess, module: services.postprocess.main, standby: false }
"""
"""One more stage that ``--colocate`` puts in the same process."""


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict]]:  # type: ignore[type-arg]
    repo = build_repository(tmp_path / "repo", ["add_sub"], [])
    config = tmp_path / "mesh.yaml"
    config.write_text(MESH)
    proc, info = start_mesh(repo, config, ["--grace-s", "5"])
    yield proc, info
    stop_mesh(proc)


def add_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="add_sub")
    encode_inputs(
        request, {"INPUT0": np.ones((1, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)}
    )
    return request


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (the test's own repository path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def standby_of(supervisor_pid: int, not_pid: int = 0) -> int:
    """The PID of the supervisor's waiting standby (other than ``not_pid``), once it has one."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in child_pids(supervisor_pid):
            try:
                if pid != not_pid and Path(f"/proc/{pid}/comm").read_text().strip() == STANDBY_NAME:
                    return pid
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError("no standby was started")


def test_crashed_stage_is_restarted_and_sigterm_stops_everything(mesh) -> None:  # type: ignore[no-untyped-def]
    proc, info = mesh
    stage_pid = info["processes"]["inference-0"]["pid"]
    orchestrator_pid = info["processes"]["orchestrator"]["pid"]
    # Once the stage is ready, an imported process waits to take its place.
    standby = standby_of(proc.pid)
    standby_started = start_ticks(standby)
    with grpc.insecure_channel(info["orchestrator"]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert decode_outputs(stub.ModelInfer(add_request()))["OUTPUT0"].tolist() == [[2.0] * 4]

        os.kill(stage_pid, signal.SIGKILL)
        # Until it is back, calls fail UNAVAILABLE naming the stage (clients retry
        # that); a standby may bring it back before the first one is refused.
        deadline = time.monotonic() + 60
        while True:
            try:
                stub.ModelInfer(add_request(), timeout=10)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                assert "stage 'inference'" in (exc.details() or "")
                assert time.monotonic() < deadline, "the stage was not brought back"
                time.sleep(0.1)

    # The standby took over (no new interpreter), and a new one waits once it is ready.
    assert start_ticks(standby) == standby_started
    assert Path(f"/proc/{standby}/comm").read_text().strip() != STANDBY_NAME
    next_standby = standby_of(proc.pid, not_pid=standby)
    repo = str(info["repository"])
    # supervisor, orchestrator, the stage (the standby that took over), the next standby
    assert len(processes_mentioning(repo)) == 4
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not alive(orchestrator_pid)
    assert not alive(stage_pid)
    assert not alive(standby)
    assert not alive(next_standby)
    assert processes_mentioning(repo) == []


def test_colocate_runs_the_stages_in_one_process_which_runs_the_ensemble(
    tmp_path: Path,
) -> None:
    repo = build_repository(tmp_path / "repo", ["add_sub"], [])
    scale_model(repo, "double_slow", 2)
    scale_model(repo, "triple_slow", 3)
    ensemble(repo, "diamond", DIAMOND)
    config = tmp_path / "mesh.yaml"
    config.write_text(MESH.replace("stages:\n", COLOCATABLE))
    proc, info = start_mesh(repo, config, ["--grace-s", "5", "--colocate"])
    try:
        assert sorted(info["processes"]) == ["colocated-0", "orchestrator"]
        request = pb.ModelInferRequest(model_name="diamond")
        encode_inputs(request, {"A": np.ones((1, 4), np.float32), "B": np.ones((1, 4), np.float32)})
        with grpc.insecure_channel(info["orchestrator"]) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answer = decode_outputs(stub.ModelInfer(request, timeout=30))
            assert answer["SUM_X2"].tolist() == [[4.0] * 4]
            stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="diamond"))
        (diamond,) = stats.model_stats
        assert diamond.inference_stats.success.count == 1  # counted where it ran: the stage
        assert diamond.version == "1"
    finally:
        stop_mesh(proc)
