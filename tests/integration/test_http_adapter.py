"""The KServe v2 REST adapter in front of a real orchestrator and inference stage.

Unmodified ``tritonclient.http`` runs in child processes (its generated
``inference`` package clashes with ours); raw HTTP checks run here with
urllib, so they see exactly the bytes on the wire. What needs no process
boundary (routes, errors, the SSE pump) is tested in-process, in
test_http_rest.py.
"""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from gateway.http import json_tensors, rest
from shared.errors import InvalidArgument
from shared.tensors import decode_raw
from tests.conftest import DATA
from tests.harness import ServiceProcess, orchestrator_with_stage, run_client
from tests.otlp import OtlpReceiver, Span

MAX_BODY = 256 * 1024
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] },
         { name: "LENGTH" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

ECHO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            flat = text.reshape(-1)
            upper = np.empty(flat.size, dtype=object)
            upper[:] = [item.decode().upper().encode() for item in flat]
            length = np.array([len(item) for item in flat], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("UPPER", upper.reshape(text.shape)),
                pb_utils.Tensor("LENGTH", length.reshape(text.shape)),
            ]))
        return responses
"""


@pytest.fixture(scope="module")
def orchestrator(
    tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[ServiceProcess]:
    repo = tmp_path_factory.mktemp("http-repo")
    for name in ("add_sub", "slow"):
        shutil.copytree(DATA / "models" / name, repo / name)
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    with orchestrator_with_stage(repo, "--otlp-endpoint", receiver.endpoint) as service:
        yield service


def start_adapter(orchestrator: str, *extra: str) -> ServiceProcess:
    return ServiceProcess(
        "gateway.http.main",
        [
            *["--http-port", "0", "--orchestrator", orchestrator],
            *["--max-body-bytes", str(MAX_BODY), *extra],
        ],
    )


@pytest.fixture(scope="module")
def adapter(orchestrator: ServiceProcess, receiver: OtlpReceiver) -> Iterator[ServiceProcess]:
    service = start_adapter(
        orchestrator.address, "--otlp-endpoint", receiver.endpoint, "--metrics-port", "0"
    )
    yield service
    assert service.stop() == 0, service.logs()


def url(adapter: ServiceProcess, path: str) -> str:
    return f"http://{adapter.info['http']}{path}"


def http(
    method: str, address: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(address, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def infer_body(first: Any, second: Any = None, shape: list[int] | None = None) -> bytes:
    inputs = [{"name": "INPUT0", "shape": shape or [1, 4], "datatype": "FP32", "data": first}]
    inputs.append(
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": second or [0, 0, 0, 0]}
    )
    return json.dumps({"inputs": inputs}).encode()


# --- tritonclient.http, unmodified ---------------------------------------------


def test_tritonclient_server_and_model_info(adapter: ServiceProcess) -> None:
    info = run_client("http_model_info.py", adapter.info["http"], "add_sub")
    assert info["live"] and info["ready"]
    assert info["server"]["name"] == "meshserve"
    assert "binary_tensor_data" in info["server"]["extensions"]
    assert info["metadata"] == info["metadata_v1"]
    assert info["metadata"]["name"] == "add_sub"
    assert info["metadata"]["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}
    assert info["config"]["max_batch_size"] == 8
    assert info["config"]["input"][0]["dims"] == [4]
    assert info["config"]["input"][0]["data_type"] == "TYPE_FP32"
    assert info["model_ready"] is True
    assert info["missing_ready"] is False
    assert info["missing_metadata"]["status"] == "404"
    assert "no_such_model" in info["missing_metadata"]["message"]
    names = {(m["name"], m["state"]) for m in info["index"]}
    assert {("add_sub", "READY"), ("echo", "READY")} <= names


def test_tritonclient_infer_json_binary_and_compressed(adapter: ServiceProcess) -> None:
    results = run_client("http_infer.py", adapter.info["http"])
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, dtype=np.float32)
    expected_binary = {
        "json": [False, False],
        "binary": [True, True],
        "default_outputs": [True, True],  # no outputs named: binary_data_output
        "mixed": [False, True],
        "gzip": [True, False],
        "deflate": [False, True],
    }
    for case, binary in expected_binary.items():
        result = results[case]
        assert result["id"] == "r1", case
        np.testing.assert_array_equal(result["OUTPUT0"], a + b, err_msg=case)
        np.testing.assert_array_equal(result["OUTPUT1"], a - b, err_msg=case)
        assert result["binary"] == binary, case
    for case in ("echo_json", "echo_binary"):
        assert results[case]["UPPER"] == [["HÉLLO", "WÖRLD"], ["", "X Y"]], case
        assert results[case]["LENGTH"] == [[6, 6], [0, 3]], case
    assert results["unknown_model"]["status"] == "404"
    assert results["wrong_shape"]["status"] == "400"
    assert "INPUT0" in results["wrong_shape"]["message"]


# --- raw HTTP: status codes and error bodies ---------------------------------------


def test_malformed_json_is_400_naming_the_problem(adapter: ServiceProcess) -> None:
    status, headers, body = http(
        "POST", url(adapter, "/v2/models/add_sub/infer"), b'{"inputs": [{"name": '
    )
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    assert "malformed JSON" in json.loads(body)["error"]

    status, _, body = http(
        "POST", url(adapter, "/v2/models/add_sub/infer"), b'{"inputs": [{"name": "X"}]}'
    )
    assert status == 400
    assert "inputs[0].shape" in json.loads(body)["error"]


def test_json_beyond_the_parser_is_400_not_500(adapter: ServiceProcess) -> None:
    # Python's json module takes an escaped lone surrogate (no protobuf string
    # can hold it) and fails deep nesting with RecursionError; neither may reach
    # the handlers as an internal error, on any route that reads JSON.
    lone_surrogate = b'{"model": "llm", "messages": [{"role": "user", "content": "\\udcff"}]}'
    deep = b"[" * 5000 + b"]" * 5000
    routes = [
        ("/v1/chat/completions", "the request body is not valid JSON"),
        ("/v1/embeddings", "the request body is not valid JSON"),
        ("/v2/repository/index", "the request body is not valid JSON"),
        ("/v2/repository/models/add_sub/load", "the request body is not valid JSON"),
        ("/v2/models/add_sub/infer", "malformed JSON"),
    ]
    for route, problem in routes:
        for body, detail in ((lone_surrogate, "surrogate"), (deep, "recursion limit")):
            status, _, answer = http("POST", url(adapter, route), body)
            assert status == 400, (route, answer)
            message = answer.decode()
            assert problem in message and detail in message, (route, message)
    # An escaped surrogate pair is one character, and well-formed.
    emoji = b'{"model": "nope", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    status, _, answer = http("POST", url(adapter, "/v1/chat/completions"), emoji)
    assert status == 404 and "nope" in answer.decode()
    status, _, _ = http("GET", url(adapter, "/v2/health/ready"))
    assert status == 200


def test_vllm_health_path_is_200_without_a_body(adapter: ServiceProcess) -> None:
    status, _, body = http("GET", url(adapter, "/health"))
    assert status == 200 and body == b""


def test_oversized_body_is_413(adapter: ServiceProcess) -> None:
    status, _, body = http(
        "POST", url(adapter, "/v2/models/add_sub/infer"), b" " * (MAX_BODY + 1024)
    )
    assert status == 413
    assert str(MAX_BODY) in json.loads(body)["error"]
    # A small gzip body that inflates past the limit is refused the same way.
    bomb = gzip.compress(b" " * (MAX_BODY * 4))
    status, _, body = http(
        "POST",
        url(adapter, "/v2/models/add_sub/infer"),
        bomb,
        {"Content-Encoding": "gzip"},
    )
    assert status == 413


def test_binary_extension_on_the_wire(adapter: ServiceProcess) -> None:
    first = np.array([[1, 2, 3, 4]], dtype=np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                },
                {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]},
            ],
            "outputs": [{"name": "OUTPUT1", "parameters": {"binary_data": True}}],
        }
    ).encode()
    headers = {rest.HEADER_LENGTH: str(len(header))}
    address = url(adapter, "/v2/models/add_sub/infer")
    status, answer_headers, body = http("POST", address, header + first.tobytes(), headers)
    assert status == 200, body
    length = int(answer_headers[rest.HEADER_LENGTH])
    document = json.loads(body[:length])
    assert [o["name"] for o in document["outputs"]] == ["OUTPUT1"]
    assert document["outputs"][0]["parameters"] == {"binary_data_size": 16}
    np.testing.assert_array_equal(np.frombuffer(body[length:], np.float32), [0, 1, 2, 3])

    # Binary data the header does not account for is an error, not ignored.
    status, _, body = http("POST", address, header + first.tobytes() + b"xx", headers)
    assert status == 400 and "binary" in json.loads(body)["error"]


def test_trace_continues_from_traceparent(adapter: ServiceProcess, receiver: OtlpReceiver) -> None:
    status, _, _ = http(
        "POST",
        url(adapter, "/v2/models/add_sub/infer"),
        infer_body([1, 2, 3, 4]),
        {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"},
    )
    assert status == 200

    def complete(spans: list[Span]) -> bool:
        # Each process exports on its own schedule: wait for all of them.
        kinds = {(s.service, s.kind) for s in spans if s.trace_id == TRACE_ID}
        return {
            ("http_adapter", 2),
            ("http_adapter", 3),
            ("orchestrator", 2),
            ("inference", 2),
        } <= kinds

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == TRACE_ID]
    (server,) = [s for s in spans if s.service == "http_adapter" and s.kind == 2]  # SERVER
    assert server.parent_id == CALLER_SPAN
    assert server.name == "POST /v2/models/{name}/infer"
    assert server.attributes["http.response.status_code"] == 200
    (client,) = [s for s in spans if s.service == "http_adapter" and s.kind == 3]  # CLIENT
    assert client.parent_id == server.span_id
    (orchestrator,) = [s for s in spans if s.service == "orchestrator" and s.kind == 2]
    assert orchestrator.parent_id == client.span_id


def test_tritonclient_statistics_unload_and_load(adapter: ServiceProcess) -> None:
    # One inference of its own, so the statistics have one to count whatever ran before.
    status, _, _ = http("POST", url(adapter, "/v2/models/add_sub/infer"), infer_body([1, 2, 3, 4]))
    assert status == 200
    result = run_client("http_repository.py", adapter.info["http"], "add_sub")
    (stats,) = result["stats"]["model_stats"]
    assert stats["name"] == "add_sub"
    assert isinstance(stats["inference_count"], int) and stats["inference_count"] > 0
    assert stats["inference_stats"]["success"]["count"] > 0
    assert "add_sub" in {m["name"] for m in result["all_stats"]["model_stats"]}
    assert result["ready_after_unload"] is False
    assert result["ready_after_load"] is True


def test_tritonclient_class_count_over_http(adapter: ServiceProcess) -> None:
    # Triton's classification extension (see test_classification.py for labels).
    answer = run_client(
        "classify.py", "http", adapter.info["http"], "add_sub", "OUTPUT0", "OUTPUT1"
    )
    assert answer["OUTPUT0"] == [["4.000000:1", "3.000000:3"], ["5.000000:2", "5.000000:3"]]
    assert answer["OUTPUT1"][0] == ["4.000000:1", "3.000000:3", "2.000000:2", "1.000000:0"]


def test_tritonclient_log_trace_and_shared_memory_settings(adapter: ServiceProcess) -> None:
    result = run_client("http_settings.py", adapter.info["http"], "add_sub")
    assert result["log_before"]["log_verbose_level"] == 0
    assert result["log_before"]["log_info"] is True
    assert result["log_changed"]["log_verbose_level"] == 1
    assert result["log_after"] == result["log_before"]
    assert "unknown log setting 'log_colour'" in result["log_unknown"]
    assert "'log_verbose_level' must be" in result["log_negative"]
    assert result["trace"]["trace_mode"] == "opentelemetry"
    assert result["trace"]["trace_level"] == ["TIMESTAMPS"]
    assert result["trace_model"] == result["trace"]
    # Off unless the orchestrator allows it (tests/integration/test_shared_memory.py).
    assert result["shm_status"] is None
    assert "start it with --allow-client-shm=true" in result["shm_register"]
    assert "CUDA shared memory is not supported" in result["cuda_status"]
    status, _, body = http("GET", url(adapter, "/v2/cudasharedmemory/region/r/status"))
    assert status == 501 and "not supported" in json.loads(body)["error"]


def test_metrics_count_requests_by_route(adapter: ServiceProcess) -> None:
    http("GET", url(adapter, "/v2/health/live"))
    metrics_url = f"http://127.0.0.1:{adapter.info['metrics_port']}/metrics"
    status, _, body = http("GET", metrics_url)
    assert status == 200
    text = body.decode()
    assert 'route="/v2/health/live",status="200"' in text
    assert 'route="/v2/models/{name}/infer",status="404"' in text


# --- the orchestrator slow or gone ---------------------------------------------------


def slow_body(ms: int) -> bytes:
    tensor = {"name": "MS", "shape": [1], "datatype": "INT32", "data": [ms]}
    return json.dumps({"inputs": [tensor]}).encode()


def test_orchestrator_deadline_is_504(orchestrator: ServiceProcess) -> None:
    adapter = start_adapter(orchestrator.address, "--request-timeout-s", "0.3")
    try:
        status, _, body = http("POST", url(adapter, "/v2/models/slow/infer"), slow_body(1500))
    finally:
        adapter.stop()
    assert status == 504, body
    assert "error" in json.loads(body)


def test_orchestrator_down_is_503_and_not_ready() -> None:
    adapter = start_adapter("127.0.0.1:1")
    try:
        live, _, _ = http("GET", url(adapter, "/v2/health/live"))
        ready, _, ready_body = http("GET", url(adapter, "/v2/health/ready"))
        health, _, health_body = http("GET", url(adapter, "/health"))
        status, _, body = http(
            "POST", url(adapter, "/v2/models/add_sub/infer"), infer_body([1] * 4)
        )
    finally:
        adapter.stop()
    assert live == 200
    assert ready == 400 and json.loads(ready_body)["ready"] is False
    # vLLM's /health: 503 while the mesh cannot serve, with the reason.
    assert health == 503 and "127.0.0.1:1" in json.loads(health_body)["error"]
    assert status == 503
    assert "127.0.0.1:1" in json.loads(body)["error"]


# --- shutdown ----------------------------------------------------------------------


def test_sigterm_lets_an_in_flight_request_finish(orchestrator: ServiceProcess) -> None:
    adapter = start_adapter(orchestrator.address)
    answers: list[tuple[int, dict[str, str], bytes]] = []
    caller = threading.Thread(
        target=lambda: answers.append(
            http("POST", url(adapter, "/v2/models/slow/infer"), slow_body(800))
        )
    )
    caller.start()
    threading.Event().wait(0.3)
    adapter.signal(signal.SIGTERM)
    caller.join(30)
    # Wait for the adapter's own exit: stop() would send a second SIGTERM, and
    # one that lands after the drain (handlers already removed) kills it.
    try:
        code = adapter.proc.wait(30)
    finally:
        adapter.stop()
    assert code == 0, adapter.logs()
    ((status, _, answer),) = answers
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["data"] == [800]


# --- gateway.http.json_tensors (no sockets; candidates for tests/unit) ---------


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        ("BOOL", [True, False, True, True]),
        ("UINT8", [0, 1, 254, 255]),
        ("UINT16", [0, 1, 2, 65535]),
        ("UINT32", [0, 1, 2, 2**32 - 1]),
        ("UINT64", [0, 1, 2, 2**64 - 1]),
        ("INT8", [-128, 0, 1, 127]),
        ("INT16", [-(2**15), 0, 1, 2**15 - 1]),
        ("INT32", [-(2**31), 0, 1, 2**31 - 1]),
        ("INT64", [-(2**63), 0, 1, 2**63 - 1]),
        ("FP16", [0.5, -1.0, 2.0, 1024.0]),
        ("FP32", [0.5, -1.0, 2, 3.25]),
        ("FP64", [0.1, -1e300, 2, 3.25]),
        ("BF16", [0.5, -1.0, 2.0, 256.0]),
        ("BYTES", ["a", "", "ü", "four"]),
    ],
)
def test_json_tensor_codec_round_trips(datatype: str, data: list[Any]) -> None:
    nested = [data[:2], data[2:]]
    raw = json_tensors.json_to_raw("T", datatype, [2, 2], nested)
    array = decode_raw("T", datatype, [2, 2], raw)
    if datatype == "BYTES":
        assert [item.decode() for item in array.reshape(-1)] == data
    elif datatype == "BF16":
        assert array.dtype == ml_dtypes.bfloat16
    assert json_tensors.raw_to_json("T", datatype, [2, 2], raw) == data


def test_json_tensor_codec_rejects_naming_the_tensor() -> None:
    cases = [
        ("INT8", [1, 2, 3, 300], "range"),
        ("INT32", [1, 2, 3, 4.5], "integers"),
        ("BOOL", [1, 0, 1, 0], "true/false"),
        ("FP32", [1, 2, 3], "4 elements"),
        ("FP32", [[1, 2], [3]], "rectangular"),
        ("BYTES", ["a", "b", "c", 4], "strings"),
        ("COMPLEX", [1, 2, 3, 4], "unknown datatype"),
    ]
    # An element count past int64 is exact, not wrapped round to a small number.
    with pytest.raises(InvalidArgument, match=f"needs {2**124} elements"):
        json_tensors.json_to_raw("T", "FP32", [2**62, 2**62], [1])
    for datatype, data, problem in cases:
        with pytest.raises(InvalidArgument, match=problem) as caught:
            json_tensors.json_to_raw("T", datatype, [4], data)
        assert "'T'" in str(caught.value)
    with pytest.raises(InvalidArgument, match="UTF-8"):
        json_tensors.raw_to_json("T", "BYTES", [1], struct.pack("<I", 1) + b"\xff")
