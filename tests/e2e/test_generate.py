"""Triton's generate extension through Envoy, as Triton's vLLM backend users call it.

Raw HTTP (urllib), since the extension has no client library: a curl user's
requests, answered by the whole mesh with the default LLM pipeline.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.e2e.conftest import aborted_generations, post, wait_for_abort

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def edge(mesh: dict[str, Any]) -> str:
    return f"http://{mesh['processes']['envoy']['grpc']}"


def events(body: bytes) -> list[dict[str, Any]]:
    """The ``data:`` events of an SSE body, parsed."""
    blocks = [b for b in body.decode().split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [json.loads(b[len("data: ") :]) for b in blocks]


def test_generate_answers_the_prompt_then_the_text_the_completions_api_gives(edge: str) -> None:
    status, headers, body = post(
        f"{edge}/v2/models/llm/generate",
        {"text_input": PROMPT, "parameters": {**GREEDY, "stream": False}},
    )
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    answer = json.loads(body)
    assert (answer["model_name"], answer["model_version"]) == ("llm", "1")
    # As Triton's vLLM backend: the prompt, then what was generated.
    assert answer["text_output"].startswith(PROMPT)
    generated = answer["text_output"][len(PROMPT) :]
    assert "Paris" in generated
    assert answer["finish_reason"] in ("stop", "length")
    assert 0 < answer["completion_tokens"] <= GREEDY["max_tokens"]
    # Greedy: the same text as /v1/completions on the same prompt and settings.
    status, _, body = post(f"{edge}/v1/completions", {"model": "llm", "prompt": PROMPT, **GREEDY})
    assert status == 200
    assert json.loads(body)["choices"][0]["text"] == generated
    # exclude_input_in_output, here in the vLLM backend's sampling_parameters form.
    status, _, body = post(
        f"{edge}/v2/models/llm/versions/1/generate",
        {
            "text_input": PROMPT,
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(GREEDY),
        },
    )
    assert status == 200 and json.loads(body)["text_output"] == generated


def test_generate_stream_events_add_up_to_the_whole_answer(edge: str) -> None:
    url = f"{edge}/v2/models/llm/generate_stream"
    status, headers, body = post(url, {"text_input": PROMPT, "parameters": GREEDY})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    streamed = events(body)
    assert len(streamed) > 1
    assert {(e["model_name"], e["model_version"]) for e in streamed} == {("llm", "1")}
    *middle, last = streamed
    assert all("finish_reason" not in e for e in middle)
    assert last["finish_reason"] in ("stop", "length")
    text = "".join(e["text_output"] for e in streamed)
    assert "Paris" in text and not text.startswith(PROMPT)
    # stream false: one event, the whole answer (the prompt first, as /generate).
    status, _, body = post(url, {"text_input": PROMPT, "parameters": {**GREEDY, "stream": False}})
    (whole,) = events(body)
    assert whole["text_output"] == PROMPT + text
    assert whole["completion_tokens"] == last["completion_tokens"]


def test_generate_without_max_tokens_stops_at_sixteen(edge: str) -> None:
    status, _, body = post(
        f"{edge}/v2/models/llm/generate",
        {"text_input": "1, 2, 3, 4, 5, 6,", "parameters": {"temperature": 0}},
    )
    assert status == 200
    answer = json.loads(body)
    assert answer["finish_reason"] == "length" and answer["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("llm/generate", {"text_input": "hi", "top_p": 0.5}, 400, ["unexpected field 'top_p'"]),
        ("llm/generate", {"text_input": ""}, 400, ["text_input"]),
        ("llm/generate", {"prompt": "hi"}, 400, ["unexpected field 'prompt'"]),
        (
            "llm/generate_stream",
            {"text_input": "hi", "parameters": {"best_of": 2}},
            400,
            ["parameters.best_of"],
        ),
        (
            "llm/generate",
            {"text_input": "hi", "parameters": {"temperature": -1}},
            400,
            ["parameters.temperature", "between 0 and 2"],
        ),
        ("llm/generate", {"text_input": "hi", "stream": "no"}, 400, ["stream", "boolean"]),
        (
            "nope/generate",
            {"text_input": "hi"},
            404,
            ["Request for unknown model: 'nope' is not found"],
        ),
        ("llm/versions/7/generate_stream", {"text_input": "hi"}, 404, ["no version '7'"]),
        ("mobilenet_v2/generate", {"text_input": "hi"}, 400, ["unknown input 'PROMPT'"]),
        # Found by the engine, before the first token: still a status, not an event.
        ("llm/generate_stream", {"text_input": "hello " * 3000}, 400, ["max_model_len"]),
    ],
)
def test_generate_errors_keep_their_status_and_name_the_field(
    edge: str, path: str, body: dict[str, Any], status: int, words: list[str]
) -> None:
    code, headers, answer = post(f"{edge}/v2/models/{path}", body)
    assert code == status and headers["Content-Type"].startswith("application/json")
    message = json.loads(answer)["error"]
    assert all(word in message for word in words), message


def test_closing_a_generate_stream_aborts_the_generation(edge: str, mesh: dict[str, Any]) -> None:
    metrics_port = mesh["processes"]["inference-0"]["metrics_port"]
    before = aborted_generations(metrics_port)
    body = {
        "text_input": "1, 2, 3, 4, 5, 6,",
        "parameters": {"max_tokens": 1500, "ignore_eos": True},
    }
    request = urllib.request.Request(
        f"{edge}/v2/models/llm/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        lines = [response.readline() for _ in range(6)]  # three events of new text
    assert all(line.startswith(b"data: ") for line in lines[::2]), lines
    assert "finish_reason" not in json.loads(lines[4][len(b"data: ") :])
    wait_for_abort(metrics_port, before)
