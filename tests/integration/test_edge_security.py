"""The edge under attack: roles, rate limits that floods cannot spend, timeouts for
slow and idle clients, an admin interface off TCP, and a drain that follows the grace.

Real Envoy in front of a small mesh (the inference stage with add_sub and slow,
the orchestrator serving REST itself, as by default), clients as users call it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest

from gateway.envoy.credentials import issue_token, write_jwt_keys
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import build_repository
from tests.e2e.conftest import start_mesh, stop_mesh
from tests.harness import ServiceProcess
from tests.integration.test_torchserve import management_port

CLIENT_RPS = 5

MESH = """
defaults: {{ host: 127.0.0.1, grace_period_s: 3 }}
services:
  envoy:
    jwks_file: {jwks}
    rate_limit_rps: 100
    client_rate_limit_rps: {client_rps}
    request_headers_timeout_s: 1
    connection_idle_timeout_s: 2
    access_log: false
    torchserve_management_port: 8081
supervisor:
  stages:
    - {{ name: inference, module: services.inference.main, replicas: 1 }}
  edge: true
  cpu_placement: "off"
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("edge-security")
    jwks, pem = write_jwt_keys(root)
    repository = build_repository(root / "repo", ["add_sub", "slow"], [])
    config = root / "mesh.yaml"
    config.write_text(MESH.format(jwks=jwks, client_rps=CLIENT_RPS))
    proc, info = start_mesh(repository, config, ["--grace-s", "5"])
    info["pem"] = pem
    info["edge"] = info["processes"]["envoy"]["grpc"]
    info["supervisor_pid"] = proc.pid
    yield info
    stop_mesh(proc)


def token(mesh: dict[str, Any], subject: str, *roles: str) -> dict[str, str]:
    return {"authorization": f"Bearer {issue_token(mesh['pem'], subject, 1, roles=roles)}"}


def post(edge: str, path: str, headers: dict[str, str], body: Any = None) -> int:
    connection = http.client.HTTPConnection(edge, timeout=30)
    try:
        data = json.dumps(body).encode() if body is not None else b""
        connection.request("POST", path, data, {"content-type": "application/json", **headers})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


ADD_SUB = {
    "inputs": [
        {"name": name, "datatype": "FP32", "shape": [1, 4], "data": [1.0, 1.0, 1.0, 1.0]}
        for name in ("INPUT0", "INPUT1")
    ]
}


def infer(edge: str, headers: dict[str, str]) -> int:
    return post(edge, "/v2/models/add_sub/infer", headers, ADD_SUB)


def grpc_code(call: Any, request: Any, headers: dict[str, str]) -> grpc.StatusCode:
    try:
        call(request, timeout=30, metadata=list(headers.items()))
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_management_needs_the_admin_role(mesh: dict[str, Any]) -> None:
    edge = mesh["edge"]
    user, admin = token(mesh, "alice", "user"), token(mesh, "root", "admin")
    nobody = token(mesh, "mallory")  # a valid token with no role

    assert infer(edge, user) == 200
    assert infer(edge, nobody) == 403
    unload = "/v2/repository/models/add_sub/unload"
    tricks = (
        "/v2//repository/models/add_sub/./unload",
        "/v2/%72epository/models/add_sub/unload",
        "/v2/x/../repository/models/add_sub/unload",
        unload.upper(),
    )
    for path in (unload, *tricks):
        assert post(edge, path, user) == 403, path
    assert post(edge, "/v2/logging", user, {"log_verbose_level": 1}) == 403
    assert post(edge, "/v2/trace/setting", user, {}) == 403

    with grpc.insecure_channel(edge) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        by_name = pb.RepositoryModelUnloadRequest(model_name="add_sub")
        unload_rpc = stub.RepositoryModelUnload
        assert grpc_code(unload_rpc, by_name, user) == grpc.StatusCode.PERMISSION_DENIED
        assert grpc_code(stub.LogSettings, pb.LogSettingsRequest(), user) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert grpc_code(stub.ServerLive, pb.ServerLiveRequest(), user) == grpc.StatusCode.OK
        assert infer(edge, user) == 200  # still loaded: the user could not unload it

        assert post(edge, unload, admin) == 200
        assert infer(edge, user) != 200
        load = pb.RepositoryModelLoadRequest(model_name="add_sub")
        assert grpc_code(stub.RepositoryModelLoad, load, admin) == grpc.StatusCode.OK
    assert infer(edge, user) == 200


def test_torchserve_management_listener_needs_the_admin_role(mesh: dict[str, Any]) -> None:
    """TorchServe's management API, on its own listener, is guarded as the edge's
    management calls are."""
    listener = f"127.0.0.1:{management_port(mesh)}"
    user, admin = token(mesh, "alice", "user"), token(mesh, "root", "admin")
    register = "/models?url=kitten.mar"
    assert post(listener, register, {}) == 401
    assert post(listener, register, user) == 403
    # Past the edge: this mesh's HTTP front door has no model store, and says so.
    assert post(listener, register, admin) == 503


def _flood(edge: str, stop: threading.Event, codes: list[int]) -> None:
    """No token, as fast as one keep-alive connection goes."""
    connection = http.client.HTTPConnection(edge, timeout=10)
    while not stop.is_set():
        try:
            connection.request("POST", "/v2/models/add_sub/infer", json.dumps(ADD_SUB))
            response = connection.getresponse()
            response.read()
            codes.append(response.status)
        except (OSError, http.client.HTTPException):
            connection.close()
            connection = http.client.HTTPConnection(edge, timeout=10)
    connection.close()


def test_an_unauthenticated_flood_does_not_spend_a_valid_clients_budget(
    mesh: dict[str, Any],
) -> None:
    edge = mesh["edge"]
    user = token(mesh, "steady", "user")
    stop = threading.Event()
    flood: list[int] = []
    threads = [threading.Thread(target=_flood, args=(edge, stop, flood)) for _ in range(6)]
    for thread in threads:
        thread.start()
    statuses = []
    started = time.monotonic()
    try:
        # Under its budget: 3 requests a second for 4 seconds.
        for i in range(12):
            time.sleep(max(0.0, started + i / 3 - time.monotonic()))
            statuses.append(infer(edge, user))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    elapsed = time.monotonic() - started
    print(
        f"flood: {len(flood)} requests in {elapsed:.1f} s ({len(flood) / elapsed:.0f}/s),"
        f" {flood.count(401)} answered 401; valid client {statuses.count(200)}/{len(statuses)} OK"
    )
    assert len(flood) / elapsed > 150, "the flood must exceed the listener's ceiling"
    assert set(flood) == {401}
    assert statuses == [200] * len(statuses)


def test_each_identity_has_its_own_budget(mesh: dict[str, Any]) -> None:
    edge = mesh["edge"]
    greedy, other = token(mesh, "greedy", "user"), token(mesh, "other", "user")
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        burst = list(pool.map(lambda _: infer(edge, greedy), range(4 * CLIENT_RPS)))
    others = [infer(edge, other) for _ in range(CLIENT_RPS - 2)]
    print(f"greedy: {burst.count(429)}/{len(burst)} 429; other: {others}")
    assert 429 in burst and 200 in burst
    assert others == [200] * len(others)
    with grpc.insecure_channel(edge) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        request = pb.ServerLiveRequest()
        codes = [grpc_code(stub.ServerLive, request, greedy) for _ in range(4 * CLIENT_RPS)]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closed the connection; None if it stayed open."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_slow_and_idle_connections_are_closed(mesh: dict[str, Any]) -> None:
    host, port = mesh["edge"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: edge\r\n")  # never ends
        waited = _closed_within(slow, 6)
    assert waited is not None and waited < 4, waited
    with socket.create_connection((host, int(port))) as idle:
        waited = _closed_within(idle, 6)
    assert waited is not None and waited < 5, waited


def _envoy_binary(supervisor_pid: int) -> psutil.Process:
    children = psutil.Process(supervisor_pid).children(recursive=True)
    (envoy,) = [child for child in children if child.name() == "envoy"]
    return envoy


def test_admin_interface_is_not_on_tcp(mesh: dict[str, Any]) -> None:
    envoy = _envoy_binary(mesh["supervisor_pid"])
    listening = {
        c.laddr.port for c in envoy.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
    }
    # The edge, TorchServe's management listener and the statistics listener
    # (which passes only /stats/prometheus to the admin); no admin port.
    stats = mesh["processes"]["envoy"]["metrics_port"]
    assert listening == {int(mesh["edge"].rsplit(":", 1)[1]), management_port(mesh), stats}
    # The admin socket lies beside the bootstrap Envoy was started with.
    bootstrap = Path(envoy.cmdline()[envoy.cmdline().index("-c") + 1])
    admin = bootstrap.parent / "admin.sock"
    assert stat.S_ISSOCK(admin.stat().st_mode)
    assert stat.S_IMODE(admin.stat().st_mode) == 0o600


def _own_edge(mesh: dict[str, Any], *options: str) -> ServiceProcess:
    """An edge of the test's own in front of the shared mesh, without access logs."""
    front = ["--orchestrator", mesh["orchestrator"], "--http-adapter", mesh["http_front_door"]]
    return ServiceProcess("gateway.envoy.main", [*front, "--access-log", "false", *options])


def _slow(ms: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="slow")
    encode_inputs(request, {"MS": np.array([ms], np.int32)})
    return request


def test_drain_lets_a_long_request_finish_within_the_grace(mesh: dict[str, Any]) -> None:
    """A request longer than the old 2-s cap completes after SIGTERM."""
    edge = _own_edge(mesh, "--grace-period-s", "10")
    request = _slow(4000)
    try:
        with grpc.insecure_channel(edge.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                reply = pool.submit(stub.ModelInfer, request, timeout=30)
                time.sleep(0.5)
                started = time.monotonic()
                edge.proc.send_signal(signal.SIGTERM)
                answer = decode_outputs(reply.result())
                finished = time.monotonic() - started
        assert answer["MS_OUT"].tolist() == [4000]
        assert finished > 2.5
    finally:
        assert edge.stop() == 0


def _cancelled_calls(stub: pb_grpc.GRPCInferenceServiceStub, count: int) -> list[str]:
    """``count`` calls, each cancelled a few ms after it went out; how each ended."""
    ends = []
    for _ in range(count // 8):
        calls = [stub.ModelInfer.future(_slow(20), timeout=30) for _ in range(8)]
        time.sleep(0.005)
        for call in calls:
            call.cancel()
        ends += ["CANCELLED" if c.cancelled() else f"{c.code().name} {c.details()}" for c in calls]
    return ends


def test_a_client_that_cancels_most_of_its_calls_keeps_its_connection(
    mesh: dict[str, Any],
) -> None:
    """A client that cancels as it types (or whose deadlines pass) is not a Rapid Reset
    attack: with Envoy's own guard (500) its connection, and the call it still waits
    for, would be cut after its 250th cancel; with the nghttp2 codec, after 1000 and
    more than 33 a second."""
    edge = _own_edge(mesh)
    try:
        with grpc.insecure_channel(edge.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            waited = stub.ModelInfer.future(_slow(2000), timeout=30)
            ends = _cancelled_calls(stub, 1200)
            answer = decode_outputs(waited.result())
            after = decode_outputs(stub.ModelInfer(_slow(1), timeout=30))
        assert answer["MS_OUT"].tolist() == [2000]
        assert after["MS_OUT"].tolist() == [1]
        # RESOURCE_EXHAUSTED is the stage's queue, full for a moment: the calls
        # come faster than their cancels take them out of it.
        unavailable = [end for end in ends if end.startswith("UNAVAILABLE")]
        assert not unavailable, collections.Counter(ends)
    finally:
        assert edge.stop() == 0
