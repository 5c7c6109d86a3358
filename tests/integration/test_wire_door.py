"""The wire door: unary ModelInfer from Envoy to the orchestrator over HTTP/1.1.

First the door alone, on a real socket with raw HTTP/1.1 (what Envoy's
reverse bridge sends it): statuses, limits, malformed input, pipelining and a
closed connection. Then a small mesh (an inference stage with Triton's
``add_sub``, the orchestrator, Envoy): a gRPC caller gets through Envoy what
the orchestrator's own gRPC port answers, for a good request and for each
kind of error, and a caller's deadline holds.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from shared.errors import InvalidArgument
from shared.grpc_headers import grpc_timeout
from shared.interceptors import DrainGate
from shared.wire_door import WireContext, WireDoor
from tests import grpcweb
from tests.e2e.conftest import EDGE_MESH, start_mesh, stop_mesh
from tests.harness import ROOT
from tests.otlp import OtlpReceiver, Span

INFER = "/inference.GRPCInferenceService/ModelInfer"


# ------------------------------------------------------------------ the door


async def _echo(body: bytes, context: WireContext) -> bytes:
    if body == b"bad":
        raise InvalidArgument("input 'x': the request said so")
    if body == b"boom":
        raise RuntimeError("a bug with a secret in it")
    if body.startswith(b"sleep"):
        await asyncio.sleep(float(body[5:]))
    if body == b"headers":
        await context.send_initial_metadata([("x-meshserve-route-target", "a")])
    remaining = context.time_remaining()
    return body + (b"" if remaining is None else b" deadline")


Scenario = Callable[[WireDoor, DrainGate, str], Awaitable[None]]


def _with_door(scenario: Scenario) -> None:
    """Run ``scenario`` against a door serving ``_echo`` (bodies up to 1 KiB)."""

    async def run() -> None:
        gate = DrainGate()
        served = WireDoor({INFER: _echo}, trace.NoOpTracer(), 1024, gate)
        address = await served.start("127.0.0.1", 0)
        try:
            await asyncio.wait_for(scenario(served, gate, address), 30)
        finally:
            served.close()

    asyncio.run(run())


def _request(body: bytes, path: str = INFER, headers: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{headers}\r\n"
    return head.encode() + body


async def _answers(address: str, data: bytes, count: int) -> list[tuple[dict[str, str], bytes]]:
    """``count`` HTTP answers to ``data`` sent on one connection."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    answers = []
    for _ in range(count):
        status = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.lower()] = value.strip()
        headers[":status"] = status.decode().split()[1]
        answers.append((headers, await reader.readexactly(int(headers["content-length"]))))
    writer.close()
    return answers


def test_statuses_travel_in_headers() -> None:
    _with_door(_statuses)


async def _statuses(_: WireDoor, __: DrainGate, address: str) -> None:
    sent = b"".join(
        [
            _request(b"hello"),
            _request(b"bad"),
            _request(b"boom"),
            _request(b"x", path="/inference.GRPCInferenceService/ModelReady"),
            _request(b"y" * 2000),
            _request(b"headers"),
            _request(b"timed", headers="grpc-timeout: 5S\r\n"),
        ]
    )
    answers = await _answers(address, sent, 7)
    codes = [headers["x-grpc-status"] for headers, _ in answers]
    assert codes == ["0", "3", "13", "12", "8", "0", "0"], answers
    assert all(h[":status"] == "200" for h, _ in answers)
    assert all(h["content-type"] == "application/x-protobuf" for h, _ in answers)
    assert answers[0][1] == b"hello"
    assert answers[1][0]["x-grpc-message"] == "input 'x': the request said so"
    assert "secret" not in answers[2][0]["x-grpc-message"], answers[2]
    assert "ModelReady" in answers[3][0]["x-grpc-message"]
    assert "2000 bytes" in answers[4][0]["x-grpc-message"]
    assert answers[5][0]["x-meshserve-route-target"] == "a"
    assert answers[6][1] == b"timed deadline"


def test_a_deadline_ends_the_call() -> None:
    _with_door(_deadline)


async def _deadline(_: WireDoor, __: DrainGate, address: str) -> None:
    [(headers, body)] = await _answers(
        address, _request(b"sleep5", headers="grpc-timeout: 100m\r\n"), 1
    )
    assert headers["x-grpc-status"] == "4" and body == b"", headers


def test_malformed_http_is_refused_and_closed() -> None:
    _with_door(_malformed)


async def _malformed(_: WireDoor, __: DrainGate, address: str) -> None:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /x HTTP/1.1\r\ncontent-length: nope\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)  # the door closes the connection
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    writer.close()
    # The door still serves everyone else.
    assert (await _answers(address, _request(b"ok"), 1))[0][1] == b"ok"


async def _in_flight(gate: DrainGate) -> None:
    """Return once one call is running."""
    for _ in range(500):
        if gate.in_flight:
            break
        await asyncio.sleep(0.01)
    assert gate.in_flight == 1


def test_a_closed_connection_cancels_its_call_and_a_drain_refuses() -> None:
    _with_door(_closed_and_drained)


async def _closed_and_drained(door: WireDoor, gate: DrainGate, address: str) -> None:
    host, port = address.rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(_request(b"sleep30"))
    await writer.drain()
    await _in_flight(gate)
    writer.close()
    await asyncio.wait_for(gate.idle(), 5)  # cancelled, not left running
    # A call still running when the door closes (the grace is over) is cancelled.
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(_request(b"sleep30"))
    await writer.drain()
    await _in_flight(gate)
    gate.close()
    [(headers, _)] = await _answers(address, _request(b"late"), 1)
    assert headers["x-grpc-status"] == "14", headers
    door.close()
    await asyncio.wait_for(gate.idle(), 5)
    writer.close()


def test_grpc_timeout_units() -> None:
    assert grpc_timeout("100m") == pytest.approx(0.1)
    assert grpc_timeout("2S") == 2.0 and grpc_timeout("1H") == 3600.0
    assert grpc_timeout("5x") is None and grpc_timeout("m") is None


# ---------------------------------------------------------- through Envoy


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, otlp: OtlpReceiver) -> Iterator[dict[str, Any]]:
    """The small edge mesh, every process sending its spans to ``otlp``."""
    folder = tmp_path_factory.mktemp("wire")
    shutil.copytree(ROOT / "tests" / "data" / "python_examples" / "add_sub", folder / "add_sub")
    document = yaml.safe_load(EDGE_MESH)
    document["defaults"]["otlp_endpoint"] = otlp.endpoint
    document["services"]["orchestrator"] = {"wire_port": 0}  # the door is opt-in
    config = folder / "mesh.yaml"
    config.write_text(yaml.safe_dump(document))
    proc, info = start_mesh(folder, config, ["--grace-s", "1"])
    yield info
    stop_mesh(proc)


def _add_sub(model: str = "add_sub", values: int = 4) -> bytes:
    request = pb.ModelInferRequest(model_name=model, id="wire-1")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[values])
        request.raw_input_contents.append(np.arange(values, dtype=np.float32).tobytes())
    return request.SerializeToString()


def _call(address: str, body: bytes, timeout: float = 30.0) -> tuple[Any, ...]:
    """(code, details, answer or None, initial metadata keys) of one ModelInfer."""
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary(INFER)
        try:
            answer, call = infer.with_call(body, timeout=timeout)
            keys = {m.key for m in call.initial_metadata()}
            return grpc.StatusCode.OK, "", pb.ModelInferResponse.FromString(answer), keys
        except grpc.RpcError as error:
            keys = {m.key for m in error.initial_metadata() or ()}
            return error.code(), error.details(), None, keys


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_add_sub(), id="good"),
        pytest.param(_add_sub("no_such_model"), id="unknown model"),
        pytest.param(_add_sub(values=3), id="wrong shape"),
        pytest.param(b"\xff\xff\xff", id="not a message"),
    ],
)
def test_envoy_answers_as_the_grpc_port(mesh: dict[str, Any], body: bytes) -> None:
    edge = mesh["processes"]["envoy"]["grpc"]
    code, details, answer, keys = _call(edge, body)
    direct_code, direct_details, direct_answer, _ = _call(mesh["orchestrator"], body)
    assert (code, details) == (direct_code, direct_details)
    assert "x-grpc-status" in keys  # it came through the wire door
    if code == grpc.StatusCode.OK:
        assert answer == direct_answer
        assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [0, 2, 4, 6]
    else:
        assert details and len(details) < 1200


def test_a_trace_continues_through_the_door(mesh: dict[str, Any], otlp: OtlpReceiver) -> None:
    trace_id = "5ee1" + "0" * 24 + "00d1"
    edge = mesh["processes"]["envoy"]["grpc"]
    with grpc.insecure_channel(edge) as channel:
        _, call = channel.unary_unary(INFER).with_call(
            _add_sub(), timeout=30, metadata=[("traceparent", f"00-{trace_id}-{'ab' * 8}-01")]
        )
    # The caller finds its trace in the trailers, as from the gRPC port.
    trailers = dict(call.trailing_metadata() or ())
    assert trailers.get("traceparent", "").startswith(f"00-{trace_id}-"), trailers

    def door_and_stage(spans: list[Span]) -> bool:
        mine = {(s.service, s.kind) for s in spans if s.trace_id == trace_id}
        envoy = any(s.service == "envoy" and s.trace_id == trace_id for s in spans)
        return envoy and {("orchestrator", 2), ("inference", 2)} <= mine

    spans = [s for s in otlp.wait_for(door_and_stage) if s.trace_id == trace_id]
    (door,) = [s for s in spans if s.service == "orchestrator" and s.kind == 2]
    assert door.name == INFER.lstrip("/") and door.attributes["meshserve.model"] == "add_sub"
    envoy = [s for s in spans if s.service == "envoy"]
    assert door.parent_id in {s.span_id for s in envoy}, spans
    # The stage's span hangs under the orchestrator's (its forwarding call).
    orchestrator = {s.span_id for s in spans if s.service == "orchestrator"}
    stage = [s for s in spans if s.service == "inference" and s.kind == 2]
    assert stage and all(s.parent_id in orchestrator for s in stage), spans


def test_a_browser_calls_through_grpc_web(mesh: dict[str, Any]) -> None:
    edge = f"http://{mesh['processes']['envoy']['grpc']}"
    reply = grpcweb.call(edge, INFER, _add_sub())
    assert reply.status == 0, reply.message
    assert "x-grpc-status" in reply.headers  # it came through the wire door
    answer = pb.ModelInferResponse.FromString(reply.payload)
    assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [0, 2, 4, 6]
    refused = grpcweb.call(edge, INFER, _add_sub("no_such_model"))
    code, details, _, _ = _call(mesh["orchestrator"], _add_sub("no_such_model"))
    assert (refused.status, refused.message) == (code.value[0], details)


def test_a_compressed_request_keeps_the_grpc_port(mesh: dict[str, Any]) -> None:
    edge = mesh["processes"]["envoy"]["grpc"]
    with grpc.insecure_channel(edge, compression=grpc.Compression.Gzip) as channel:
        answer, call = channel.unary_unary(INFER).with_call(_add_sub(), timeout=30)
    reply = pb.ModelInferResponse.FromString(answer)
    assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [0, 2, 4, 6]
    assert "x-grpc-status" not in {m.key for m in call.initial_metadata()}


def test_streams_keep_the_grpc_port(mesh: dict[str, Any]) -> None:
    edge = mesh["processes"]["envoy"]["grpc"]
    with grpc.insecure_channel(edge) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        request = pb.ModelInferRequest.FromString(_add_sub())
        answers = list(stream(iter([request.SerializeToString()]), timeout=30))
    answer = pb.ModelStreamInferResponse.FromString(answers[0])
    assert not answer.error_message and answer.infer_response.model_name == "add_sub"
