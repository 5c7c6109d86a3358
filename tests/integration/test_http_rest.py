"""The HTTP adapter's REST layer in-process: the real aiohttp app against a real v2 server.

A stage (the shared v2 server with the python backend) on port 0 answers v2 for
its own models, so it stands in for the orchestrator; the adapter runs in the
same event loop behind aiohttp's ``TestServer``. Nothing is mocked and no
process is spawned; tests/integration/test_http_adapter.py keeps what needs the
process boundary (tritonclient, SIGTERM, the adapter's own flags).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry import trace

from gateway.http import rest
from gateway.http.app import AdapterState, build_app
from gateway.http.main import CUT_REASON, drain
from gateway.http.upstream import Upstream
from services.inference.python import PythonBackend
from shared.server import MeshServer
from shared.stage import StageConfig, build_stage_parts
from tests.conftest import DATA

MAX_BODY = 256 * 1024

# A decoupled LLM pipeline in miniature: each word of PROMPT is a TEXT_DELTA, up
# to SAMPLING's max_tokens; the last response says why it ended, as the mesh's
# LLM pipelines do. A prompt starting "fail" breaks after its first word.
GEN_CONFIG = """
name: "gen"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "SAMPLING" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "TEXT_DELTA" data_type: TYPE_STRING dims: [ 1 ] },
         { name: "FINISH_REASON" data_type: TYPE_STRING dims: [ 1 ] },
         { name: "PROMPT_TOKENS" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "COMPLETION_TOKENS" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

GEN_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def tensor(name, value):
    dtype = np.int32 if isinstance(value, int) else object
    return pb_utils.Tensor(name, np.array([value], dtype=dtype))


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()[0]
            sampling = pb_utils.get_input_tensor_by_name(request, "SAMPLING").as_numpy()[0]
            words = prompt.decode().split()
            limit = json.loads(sampling)["max_tokens"]
            for index, word in enumerate(words[:limit]):
                if index == 1 and words[0] == "fail":
                    error = pb_utils.TritonError("the engine failed midway")
                    sender.send(pb_utils.InferenceResponse(error=error))
                    break
                delta = tensor("TEXT_DELTA", (" " + word).encode())
                sender.send(pb_utils.InferenceResponse([delta]))
            finish = "length" if len(words) > limit else "stop"
            counts = [tensor("PROMPT_TOKENS", len(words)),
                      tensor("COMPLETION_TOKENS", min(limit, len(words)))]
            sender.send(
                pb_utils.InferenceResponse([tensor("FINISH_REASON", finish.encode()), *counts]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
"""


# One request at a time and one more queued (the max_queue_size parameter):
# the rest are refused at once, 429 with Retry-After.
BUSY_CONFIG = """
name: "busy"
backend: "python"
max_batch_size: 0
input [ { name: "MS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "MS_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "max_queue_size" value { string_value: "1" } }
"""

# Like gen, but a word every 0.2 s: a stream still open when the adapter stops.
DRIP_MODEL = GEN_MODEL.replace("import json", "import json\nimport time").replace(
    "            for index, word in enumerate(words[:limit]):\n",
    "            for index, word in enumerate(words[:limit]):\n                time.sleep(0.2)\n",
)


class Adapter:
    """The adapter app on a test server, over a stage on 127.0.0.1:0, in one loop."""

    def __init__(self, repo: Path) -> None:
        self.config = StageConfig(model_repository=repo, grpc_port=0, grace_period_s=1.0)
        self.stage = MeshServer(
            self.config,
            build_stage_parts(self.config, {"python": PythonBackend()}),
        )

    async def start(self) -> None:
        await self.stage.start()
        tracer = trace.NoOpTracer()
        upstream = Upstream(
            self.stage.address, channels=1, max_message_bytes=1 << 24, timeout_s=30, tracer=tracer
        )
        self.state = AdapterState(upstream, tracer, MAX_BODY)
        server = TestServer(build_app(self.state))
        # As gateway.http.main runs it: rest.decode_body inflates under the body limit.
        await server.start_server(auto_decompress=False)
        self.client = TestClient(server)
        await self.client.start_server()

    async def stop(self) -> None:
        await self.client.close()
        await self.state.upstream.close()
        await self.stage.stop()

    async def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        async with self.client.request(method, path, data=data, headers=headers) as response:
            return response.status, dict(response.headers), await response.read()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """Runs a test's coroutine against the adapter; one loop and one stage per module."""
    repo = tmp_path_factory.mktemp("rest-repo")
    shutil.copytree(DATA / "models" / "add_sub", repo / "add_sub")
    (repo / "gen" / "1").mkdir(parents=True)
    (repo / "gen" / "config.pbtxt").write_text(GEN_CONFIG)
    (repo / "gen" / "1" / "model.py").write_text(GEN_MODEL)
    shutil.copytree(DATA / "models" / "slow", repo / "busy")
    (repo / "busy" / "config.pbtxt").write_text(BUSY_CONFIG)
    (repo / "drip" / "1").mkdir(parents=True)
    (repo / "drip" / "config.pbtxt").write_text(GEN_CONFIG.replace('"gen"', '"drip"'))
    (repo / "drip" / "1" / "model.py").write_text(DRIP_MODEL)
    with asyncio.Runner() as runner:
        adapter = Adapter(repo)
        runner.run(adapter.start())

        def run(scenario: Callable[[Adapter], Awaitable[None]]) -> None:
            runner.run(scenario(adapter))

        try:
            yield run
        finally:
            runner.run(adapter.stop())


def infer_body(first: list[Any], shape: list[int] | None = None) -> dict[str, Any]:
    inputs = [
        {"name": "INPUT0", "shape": shape or [1, 4], "datatype": "FP32", "data": first},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]},
    ]
    return {"inputs": inputs}


def sse_events(body: bytes) -> list[Any]:
    """The JSON documents of an SSE body (``[DONE]`` as the string)."""
    events = [chunk for chunk in body.decode().split("\n\n") if chunk]
    assert all(e.startswith("data: ") for e in events), body
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


# --- KServe v2 REST ----------------------------------------------------------------


def test_infer_with_json_tensors(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        status, headers, body = await adapter.call(
            "POST", "/v2/models/add_sub/infer", infer_body([1, 2, 3, 4])
        )
        assert status == 200, body
        assert headers["Content-Type"].startswith("application/json")
        document = json.loads(body)
        assert document["model_name"] == "add_sub"
        outputs = {o["name"]: o for o in document["outputs"]}
        assert outputs["OUTPUT0"] == {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 4],
                                      "data": [2, 3, 4, 5]}  # fmt: skip
        assert outputs["OUTPUT1"]["data"] == [0, 1, 2, 3]

    served(scenario)


def test_infer_with_binary_tensors_both_ways(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        first = np.array([[1, 2, 3, 4]], dtype=np.float32)
        inputs = infer_body([])["inputs"]
        inputs[0] = {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                     "parameters": {"binary_data_size": 16}}  # fmt: skip
        header = json.dumps(
            {
                "inputs": inputs,
                "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
            }
        ).encode()
        status, headers, body = await adapter.call(
            "POST",
            "/v2/models/add_sub/infer",
            header + first.tobytes(),
            {rest.HEADER_LENGTH: str(len(header))},
        )
        assert status == 200, body
        length = int(headers[rest.HEADER_LENGTH])
        output = json.loads(body[:length])["outputs"][0]
        assert output["parameters"] == {"binary_data_size": 16}
        np.testing.assert_array_equal(np.frombuffer(body[length:], np.float32), [2, 3, 4, 5])

    served(scenario)


def test_metadata_config_and_readiness(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        status, _, body = await adapter.call("GET", "/v2/models/add_sub")
        assert status == 200
        metadata = json.loads(body)
        assert metadata["name"] == "add_sub"
        assert [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]
        assert metadata["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}
        status, _, body = await adapter.call("GET", "/v2/models/add_sub/config")
        assert status == 200
        config = json.loads(body)
        assert config["backend"] == "python" and config["max_batch_size"] == 8
        assert config["input"][0]["data_type"] == "TYPE_FP32"
        for path in ("/v2/models/add_sub/ready", "/v2/health/ready"):
            status, _, body = await adapter.call("GET", path)
            assert (status, json.loads(body)) == (200, {"ready": True}), path
        status, _, body = await adapter.call("GET", "/v2/health/live")
        assert (status, json.loads(body)) == (200, {"live": True})

    served(scenario)


def test_unknown_model_is_404_in_tritons_words(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        for method, path, body in (
            ("POST", "/v2/models/nope/infer", infer_body([1, 2, 3, 4])),
            ("GET", "/v2/models/nope", None),
            ("GET", "/v2/models/nope/config", None),
        ):
            status, _, answer = await adapter.call(method, path, body)
            assert status == 404, (path, answer)
            assert json.loads(answer)["error"].startswith(
                "Request for unknown model: 'nope' is not found"
            ), answer

    served(scenario)


def test_bad_tensor_is_400_naming_it(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        path = "/v2/models/add_sub/infer"
        # Data that does not fill its shape: caught in the adapter.
        status, _, body = await adapter.call("POST", path, infer_body([1, 2]))
        assert status == 400 and "'INPUT0'" in json.loads(body)["error"]
        # A shape the model does not take: caught by the server, its status mapped back.
        status, _, body = await adapter.call("POST", path, infer_body([1, 2, 3], shape=[1, 3]))
        assert status == 400 and "'INPUT0'" in json.loads(body)["error"]
        # A field of the wrong type: the pydantic location names it.
        status, _, body = await adapter.call("POST", path, {"inputs": [{"name": "X"}]})
        assert status == 400 and "inputs[0].shape" in json.loads(body)["error"]

    served(scenario)


def test_unknown_route_and_encoding_answer_json(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        status, headers, body = await adapter.call("GET", "/v3/whatever")
        assert status == 404 and headers["Content-Type"].startswith("application/json")
        assert "/v3/whatever" in json.loads(body)["error"]
        status, _, body = await adapter.call(
            "POST", "/v2/models/add_sub/infer", b"{}", {"Content-Encoding": "br"}
        )
        assert status == 415 and "br" in json.loads(body)["error"]
        status, _, body = await adapter.call(
            "POST", "/v2/models/add_sub/infer", b" " * MAX_BODY * 2
        )
        assert status == 413 and str(MAX_BODY) in json.loads(body)["error"]

    served(scenario)


def test_draining_refuses_work_but_readiness_answers(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        adapter.state.draining = True
        try:
            status, _, body = await adapter.call("GET", "/v2/models/add_sub")
            assert status == 503 and "shutting down" in json.loads(body)["error"]
            status, _, body = await adapter.call("GET", "/v2/health/ready")
            assert status == 400 and json.loads(body)["ready"] is False
        finally:
            adapter.state.draining = False
        status, _, _ = await adapter.call("GET", "/v2/models/add_sub")
        assert status == 200

    served(scenario)


def test_metrics_count_answers_by_route_and_status(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        await adapter.call("GET", "/v2/models/nope")
        labels = {"method": "GET", "route": "/v2/models/{name}", "status": "404"}
        assert (
            adapter.state.registry.get_sample_value("meshserve_http_requests_total", labels) or 0
        ) >= 1

    served(scenario)


# --- generate: the SSE writer and the pump, through a decoupled model -----------------


def test_generate_stream_sends_an_event_per_delta(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        body = {"text_input": "one two three", "parameters": {"max_tokens": 2}}
        status, headers, answer = await adapter.call("POST", "/v2/models/gen/generate_stream", body)
        assert status == 200, answer
        assert headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(answer)
        assert [e["text_output"] for e in events] == [" one", " two", ""]
        assert "finish_reason" not in events[0]
        assert events[-1]["finish_reason"] == "length"
        assert (events[-1]["prompt_tokens"], events[-1]["completion_tokens"]) == (3, 2)

    served(scenario)


def test_generate_whole_answers_echo_the_prompt(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        body = {"text_input": "one two", "parameters": {"max_tokens": 5}}
        status, _, answer = await adapter.call("POST", "/v2/models/gen/generate", body)
        assert status == 200, answer
        document = json.loads(answer)
        assert (document["text_output"], document["finish_reason"]) == ("one two one two", "stop")
        # generate_stream with stream: false answers the same in one event.
        body["stream"] = False
        status, _, answer = await adapter.call("POST", "/v2/models/gen/generate_stream", body)
        assert status == 200
        assert [e["text_output"] for e in sse_events(answer)] == ["one two one two"]

    served(scenario)


def test_generate_errors_up_front_keep_their_status_later_ones_are_events(
    served: Callable[..., Any],
) -> None:
    async def scenario(adapter: Adapter) -> None:
        status, _, answer = await adapter.call(
            "POST", "/v2/models/nope/generate_stream", {"text_input": "hi"}
        )
        assert status == 404 and "'nope'" in json.loads(answer)["error"]
        status, _, answer = await adapter.call(
            "POST", "/v2/models/gen/generate_stream", {"text_input": "hi", "bogus": 1}
        )
        assert status == 400 and "'bogus'" in json.loads(answer)["error"]
        status, _, answer = await adapter.call(
            "POST", "/v2/models/gen/generate_stream", {"text_input": "fail now please"}
        )
        assert status == 200
        events = sse_events(answer)
        assert events[0]["text_output"] == " fail"
        assert events[-1] == {"error": "the engine failed midway"}

    served(scenario)


# --- bounds and shutdown ---------------------------------------------------------------


def test_a_full_queue_answers_429_with_retry_after(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        body = {"inputs": [{"name": "MS", "shape": [1], "datatype": "INT32", "data": [300]}]}
        answers = await asyncio.gather(
            *(adapter.call("POST", "/v2/models/busy/infer", body) for _ in range(6))
        )
        statuses = sorted(status for status, _, _ in answers)
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
        assert set(statuses) == {200, 429}, statuses
        for status, headers, answer in answers:
            if status == 429:
                assert headers["Retry-After"] == "1"
                assert "max_queue_size" in json.loads(answer)["error"]

    served(scenario)


def test_a_stream_cut_by_shutdown_ends_with_an_error_event(served: Callable[..., Any]) -> None:
    async def scenario(adapter: Adapter) -> None:
        # An adapter of its own over the same stage, so that stopping it spares the others.
        tracer = trace.NoOpTracer()
        upstream = Upstream(
            adapter.stage.address,
            channels=1,
            max_message_bytes=1 << 24,
            timeout_s=30,
            tracer=tracer,
        )
        state = AdapterState(upstream, tracer, MAX_BODY)
        server = TestServer(build_app(state))
        await server.start_server(auto_decompress=False, shutdown_timeout=0.5)
        client = TestClient(server)
        await client.start_server()
        words = " ".join(f"w{i}" for i in range(15))  # 3 s of words: longer than the grace
        body = {"text_input": words, "parameters": {"max_tokens": 15}}
        try:
            async with client.post("/v2/models/drip/generate_stream", json=body) as response:
                assert response.status == 200
                first = await response.content.readuntil(b"\n\n")
                assert json.loads(first[6:])["text_output"] == " w0"
                draining = asyncio.create_task(drain(server.runner, state, 0.5))
                rest = await response.content.read()
                await draining
        finally:
            await client.close()
            await upstream.close()
        events = sse_events(first + rest)
        assert events[-1] == {"error": CUT_REASON}, events
        assert all("error" not in e for e in events[:-1]), events
        assert "finish_reason" not in events[-2], events  # it did not end on its own

    served(scenario)
