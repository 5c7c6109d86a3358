"""The OpenAI-compatible API through Envoy, driven by the official openai SDK.

The SDK runs in child processes (tests/clients/openai_*.py) like every other
client of these tests; raw HTTP checks (error bodies, the SSE framing) use
urllib from here.
"""

from __future__ import annotations

import json
import re
import secrets
import urllib.error
import urllib.request
from typing import Any

import jsonschema
import numpy as np
import pytest

from tests.e2e.conftest import (
    aborted_generations,
    openai_error,
    post,
    streamed_chat,
    wait_for_abort,
)
from tests.harness import run_client
from tests.otlp import OtlpReceiver, Span

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the capital of Italy?",
    "What is the capital of Germany?",
    "What is the capital of Spain?",
    "What is the capital of England?",
    "What is the capital of Russia?",
    "What is the capital of Egypt?",
    "What color is the sky on a clear day?",
    "How many days are in a week?",
    "What do bees make?",
    "What is the opposite of hot?",
    "What animal says moo?",
    "What is 2 + 2?",
    "What is frozen water called?",
    "Which planet do we live on?",
]
# Each answer must speak of its own question's subject (or give the right
# answer): a 135M model is not always right, but a crossed stream would show.
EXPECTED = [
    "paris|fran",
    "tokyo|japan",
    "rome|ital",
    "berlin|german",
    "madrid|spa[ie]n|españa",
    "london|engl",
    "moscow|russ",
    "cairo|egypt",
    "blue|sky",
    "seven|7|week|day",
    "honey|bee",
    "cold|hot",
    "cow|moo|animal",
    "4|four|2",
    "ice|water|frozen",
    "earth|planet",
]


@pytest.fixture(scope="module")
def base_url(mesh: dict[str, Any]) -> str:
    return f"http://{mesh['processes']['envoy']['grpc']}/v1"


@pytest.fixture(scope="module")
def basics(base_url: str) -> dict[str, Any]:
    result: dict[str, Any] = run_client("openai_basics.py", base_url)
    return result


def test_chat_completion_answers_paris(basics: dict[str, Any]) -> None:
    chat = basics["chat"]
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert chat["model"] == "llm"
    (choice,) = chat["choices"]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = chat["usage"]
    assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] <= 32
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "Paris" in basics["parts_chat"]["choices"][0]["message"]["content"]


def test_chat_stream_chunks_in_openai_order(basics: dict[str, Any]) -> None:
    chunks = basics["chunks"]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    first, *middle, finish, usage = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["delta"]["content"] == ""
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in middle)
    # Greedy: the stream says what the whole answer said.
    assert text == basics["chat"]["choices"][0]["message"]["content"]
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *middle])
    assert finish["choices"][0]["finish_reason"] in ("stop", "length")
    assert not finish["choices"][0]["delta"]["content"]
    assert all(c["usage"] is None for c in [first, *middle, finish])
    assert usage["choices"] == []
    assert usage["usage"] == basics["chat"]["usage"]


def test_text_completion_whole_and_streamed(basics: dict[str, Any]) -> None:
    completion = basics["completion"]
    assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
    text = completion["choices"][0]["text"]
    assert "Paris" in text
    streamed = basics["text_chunks"]
    assert "".join(c["choices"][0]["text"] for c in streamed) == text
    assert streamed[-1]["choices"][0]["finish_reason"] == completion["choices"][0]["finish_reason"]


def test_models_and_embeddings(basics: dict[str, Any]) -> None:
    models = {m["id"]: m for m in basics["models"]}
    assert {"llm", "text_embedding"} <= set(models)
    assert models["llm"]["owned_by"] == "meshserve" and models["llm"]["object"] == "model"

    embeddings = basics["embeddings"]
    assert embeddings["object"] == "list" and embeddings["model"] == "text_embedding"
    assert [d["index"] for d in embeddings["data"]] == [0, 1]
    first, second = (np.array(d["embedding"]) for d in embeddings["data"])
    assert first.shape == (384,)
    assert float(np.linalg.norm(first)) == pytest.approx(1.0, abs=1e-3)
    assert float(first @ second) >= 0.5
    decoded = [np.array(d["embedding"]) for d in basics["embeddings_base64"]["data"]]
    np.testing.assert_allclose(decoded[0], first, rtol=1e-6)


def test_sixteen_concurrent_streams_each_answer_their_question(base_url: str) -> None:
    answers = run_client("openai_concurrent.py", base_url, QUESTIONS)
    assert len(answers) == 16
    for question, expected, answer in zip(QUESTIONS, EXPECTED, answers, strict=True):
        assert answer["ids"] == 1 and answer["finish"] in ("stop", "length"), answer
        assert re.search(expected, answer["text"].lower()), (question, answer["text"])
    assert len({a["text"] for a in answers}) == 16


@pytest.fixture(scope="module")
def parity(base_url: str) -> dict[str, Any]:
    result: dict[str, Any] = run_client("openai_parity.py", base_url)
    return result


def test_n_choices_with_a_seed_differ_and_repeat(parity: dict[str, Any]) -> None:
    first, again = parity["seeded"]
    assert len(first) == 3 and len(set(first)) == 3, first
    assert again == first
    streamed = parity["streamed_choices"]
    assert set(streamed["texts"]) == {"0", "1"}  # JSON keys
    for text in streamed["texts"].values():
        assert text.startswith("The capital of France is")  # echo
    assert set(streamed["finishes"].values()) <= {"stop", "length"}
    usage = streamed["usage"]
    assert all(u is not None for u in usage)  # continuous_usage_stats
    last = usage[-1]
    assert last["total_tokens"] == last["prompt_tokens"] + last["completion_tokens"]
    assert 2 <= last["completion_tokens"] <= 16  # both choices counted, 8 tokens at most each


def test_logprobs_take_openais_shapes(parity: dict[str, Any]) -> None:
    chat = parity["logprobs"]["chat"]["choices"][0]
    content = chat["logprobs"]["content"]
    # As in vLLM's answer, the end-of-turn token that stopped it has its entry too.
    assert "".join(t["token"] for t in content).startswith(chat["message"]["content"])
    for token in content:
        assert len(token["top_logprobs"]) == 5
        assert token["top_logprobs"][0]["token"] == token["token"]  # greedy: the likeliest
        assert token["bytes"] == list(token["token"].encode())
        values = [t["logprob"] for t in token["top_logprobs"]]
        assert values == sorted(values, reverse=True) and values[0] <= 0
    streamed = [
        t
        for c in parity["logprobs"]["chat_chunks"]
        for ch in c["choices"]
        if ch["logprobs"]
        for t in ch["logprobs"]["content"]
    ]
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    completion = parity["logprobs"]["completion"]["choices"][0]["logprobs"]
    assert "".join(completion["tokens"]) == parity["logprobs"]["completion"]["choices"][0]["text"]
    assert all(len(top) <= 4 for top in completion["top_logprobs"])
    assert completion["text_offset"][0] == 0


def test_json_schema_answers_validate(parity: dict[str, Any]) -> None:
    answers = parity["schema_answers"]
    assert len(answers) == 20
    for answer in answers:
        jsonschema.validate(json.loads(answer), parity["schema"])
    extras = parity["extras"]
    assert extras["choice"] in ("Paris", "Lyon", "Nice")
    assert re.fullmatch("[0-9]{3}", extras["regex"])
    assert extras["json_object"].lstrip().startswith("{")  # (cut by max_tokens, maybe)


def test_tools_for_a_model_without_a_tool_format_are_a_clear_400(parity: dict[str, Any]) -> None:
    for how in ("whole", "stream"):
        refused = parity["tools"][how]
        assert (refused["class"], refused["status"]) == ("BadRequestError", 400), refused
        assert refused["body"]["param"] == "tools"
        assert "no tool format" in refused["body"]["message"]


def test_bad_requests_through_the_sdk(base_url: str) -> None:
    results = run_client("openai_errors.py", base_url)
    expected = {
        "negative_max_tokens": ("BadRequestError", 400, "max_tokens"),
        "unknown_model": ("NotFoundError", 404, None),
        "too_long": ("BadRequestError", 400, None),
        "too_long_stream": ("BadRequestError", 400, None),
        "malformed_messages": ("BadRequestError", 400, "messages[0].role"),
        "suffix": ("BadRequestError", 400, "suffix"),
        "too_many_top_logprobs": ("BadRequestError", 400, "top_logprobs"),
        "token_prompt": ("BadRequestError", 400, "prompt"),
        "token_embeddings": ("BadRequestError", 400, "input"),
        "unknown_embedder": ("NotFoundError", 404, None),
    }
    for case, (cls, status, param) in expected.items():
        got = results[case]
        assert (got["class"], got["status"]) == (cls, status), (case, got)
        assert got["body"]["type"] == (
            "not_found_error" if status == 404 else "invalid_request_error"
        )
        if param is not None:
            assert got["body"]["param"] == param, (case, got)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
            400,
            "max_tokens",
        ),
        (
            "chat/completions",
            {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]},
            404,
            None,
        ),
        ("chat/completions", {"messages": "hi"}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, 400, None),
        ("chat/completions", b"{not json", 400, None),
        ("completions", {"prompt": "hi", "temperature": "warm"}, 400, "temperature"),
        ("embeddings", {"input": [1, 2, 3]}, 400, "input"),
        ("no/such/route", {}, 404, None),
    ],
)
def test_raw_http_errors_are_openai_json(
    base_url: str, path: str, body: Any, status: int, param: str | None
) -> None:
    assert openai_error(f"{base_url}/{path}", body, status)["param"] == param


def test_vllm_health_path_answers_through_envoy(base_url: str) -> None:
    # vLLM's server answers GET /health with 200 and no body; its users' probes use it.
    edge = base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{edge}/health", timeout=30) as response:
        assert response.status == 200 and response.read() == b""


def test_raw_sse_framing(base_url: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 16,
        "stream": True,
    }
    status, headers, raw = post(f"{base_url}/chat/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "Paris" in "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_closing_a_stream_aborts_the_generation(base_url: str, mesh: dict[str, Any]) -> None:
    metrics_port = mesh["processes"]["inference-0"]["metrics_port"]
    assert metrics_port > 0
    before = aborted_generations(metrics_port)
    result = run_client("openai_cancel.py", base_url, 5)
    assert result == {"read": 5, "finish": None}
    wait_for_abort(metrics_port, before)


def test_one_chat_request_is_one_trace_across_the_mesh(base_url: str, otlp: OtlpReceiver) -> None:
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    request = streamed_chat(
        base_url,
        "What is the capital of France?",
        8,
        headers={"traceparent": f"00-{trace_id}-{caller}-01"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        assert response.read().decode().endswith("data: [DONE]\n\n")

    stages = ("tokenizer", "inference", "postprocess")

    def complete(spans: list[Span]) -> bool:
        # Every process exports on its own schedule; the orchestrator's two server
        # spans (the HTTP request, its Chat call) end last, so wait for those and
        # every stage.
        mine = [s for s in spans if s.trace_id == trace_id]
        doors = [s for s in mine if s.service == "orchestrator" and s.kind == 2]
        return {"envoy", *stages} <= {s.service for s in mine} and len(doors) == 2

    mine = [s for s in otlp.wait_for(complete) if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in mine}

    def parent(span: Span) -> Span:
        assert span.parent_id in by_id, f"{span.service} {span.name}: parent not in the trace"
        return by_id[span.parent_id]

    (envoy,) = [s for s in mine if s.service == "envoy" and s.parent_id == caller]
    # The orchestrator serves REST itself (http_front_door's default): its HTTP
    # server span hangs under Envoy's (directly or through its egress span).
    servers = [s for s in mine if s.service == "orchestrator" and s.kind == 2]
    (door,) = [s for s in servers if s.name == "POST /v1/chat/completions"]
    above = parent(door)
    assert above.service == "envoy" and (above is envoy or parent(above) is envoy)
    # The chat's meshserve.v1 call goes to the orchestrator's own gRPC port, below it.
    (orchestrator,) = [s for s in servers if s is not door]
    assert parent(orchestrator) is door or parent(parent(orchestrator)) is door
    for stage in stages:
        served = [s for s in mine if s.service == stage and s.kind == 2]
        assert served, f"no {stage} server span in the trace"
        # Each stage stream was opened ahead of the request, outside any trace;
        # its span joins the trace with its first request, under the orchestrator's
        # ensemble step span that sent it, inside the Chat server span.
        for span in served:
            step = parent(span)
            assert step.service == "orchestrator", f"{stage}: under {step.name}"
            assert step.name.startswith("ensemble step") and step.attributes["meshserve.ensemble"]
            assert parent(step) is orchestrator
