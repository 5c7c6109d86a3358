"""vLLM's /tokenize and /detokenize through Envoy, and MeshService's Tokenize / Detokenize.

The ids must be the ones the default LLM pipeline feeds its engine: they are
checked against the model folder's own tokenizer (tokenizers for a prompt,
transformers' chat template for messages), and a chat's count against the
prompt tokens a chat completion reports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshserve.v1 import meshserve_pb2 as api
from meshserve.v1 import meshserve_pb2_grpc as api_grpc
from tests.e2e.conftest import openai_error, post

pytestmark = pytest.mark.e2e

PROMPT = "What is the capital of France?"
CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": PROMPT},
]


@pytest.fixture(scope="module")
def edge(mesh: dict[str, Any]) -> str:
    return str(mesh["processes"]["envoy"]["grpc"])


@pytest.fixture(scope="module")
def model_folder(prepared_repository: Path) -> Path:
    return prepared_repository / "smollm2" / "1"


def _ok(url: str, body: Any) -> dict[str, Any]:
    status, headers, raw = post(url, body)
    assert status == 200, raw
    assert headers["Content-Type"].startswith("application/json")
    answer: dict[str, Any] = json.loads(raw)
    return answer


def test_a_prompt_tokenizes_as_the_model_tokenizer_does(edge: str, model_folder: Path) -> None:
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(model_folder / "tokenizer.json")).encode(PROMPT).ids
    answer = _ok(f"http://{edge}/tokenize", {"model": "llm", "prompt": PROMPT})
    assert answer == {
        "count": len(expected),
        "max_model_len": 2048,  # the smollm2 config's max_model_len
        "tokens": expected,
        "token_strs": None,
    }


def test_a_chat_tokenizes_through_the_chat_template(edge: str, model_folder: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_folder), local_files_only=True)
    rendered = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    expected = hf(rendered, add_special_tokens=False)["input_ids"]
    answer = _ok(f"http://{edge}/tokenize", {"messages": CHAT})  # model: "llm" by default
    assert answer["tokens"] == expected and answer["count"] == len(expected)
    # The same count the engine saw for the same chat.
    completion = _ok(
        f"http://{edge}/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "temperature": 0}
    )
    assert completion["usage"]["prompt_tokens"] == len(expected)


def test_detokenize_gives_back_the_text(edge: str) -> None:
    tokens = _ok(f"http://{edge}/tokenize", {"prompt": PROMPT})["tokens"]
    assert _ok(f"http://{edge}/detokenize", {"model": "llm", "tokens": tokens}) == {
        "prompt": PROMPT
    }
    # A character split across tokens comes back whole.
    accented = _ok(f"http://{edge}/tokenize", {"prompt": "Crème brûlée à Zürich"})["tokens"]
    assert _ok(f"http://{edge}/detokenize", {"tokens": accented})["prompt"] == (
        "Crème brûlée à Zürich"
    )
    # Special tokens stay, as vLLM's /detokenize keeps them (generation skips them).
    chat = _ok(f"http://{edge}/tokenize", {"messages": CHAT})["tokens"]
    text = _ok(f"http://{edge}/detokenize", {"tokens": chat})["prompt"]
    assert text.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>"), text


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("tokenize", {"prompt": PROMPT, "return_token_strs": True}, 400, "return_token_strs"),
        (
            "tokenize",
            {"messages": CHAT, "add_generation_prompt": False},
            400,
            "add_generation_prompt",
        ),
        ("tokenize", {"prompt": PROMPT, "messages": CHAT}, 400, "prompt"),
        ("tokenize", {"prompt": ""}, 400, "prompt"),
        ("tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400, None),
        ("tokenize", {"model": "ghost", "prompt": PROMPT}, 404, None),
        ("tokenize", {"model": "text_embedding", "prompt": PROMPT}, 400, None),
        ("detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("detokenize", {"tokens": [10**9]}, 400, None),
        ("detokenize", {"tokens": []}, 400, None),
        ("detokenize", b"{not json", 400, None),
    ],
)
def test_bad_requests_are_openai_errors(
    edge: str, path: str, body: Any, status: int, param: str | None
) -> None:
    error = openai_error(f"http://{edge}/{path}", body, status)
    if param is not None:
        assert error["param"] == param, error


def test_mesh_api_over_grpc_and_json(edge: str) -> None:
    with grpc.insecure_channel(edge) as channel:
        stub = api_grpc.MeshServiceStub(channel)  # type: ignore[no-untyped-call]
        tokens = stub.Tokenize(api.TokenizeRequest(prompt=PROMPT), timeout=60)
        assert tokens.model == "llm" and tokens.max_model_len == 2048 and tokens.tokens
        text = stub.Detokenize(api.DetokenizeRequest(tokens=tokens.tokens), timeout=60)
        assert text.text == PROMPT
        with pytest.raises(grpc.RpcError) as neither:
            stub.Tokenize(api.TokenizeRequest(), timeout=60)
        assert neither.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt and messages" in (neither.value.details() or "")
        with pytest.raises(grpc.RpcError) as negative:
            stub.Detokenize(api.DetokenizeRequest(tokens=[5, -1]), timeout=60)
        assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tokens[1]" in (negative.value.details() or "")
    # Transcoded by Envoy: the same answer as JSON under /api/v1.
    answer = _ok(f"http://{edge}/api/v1/tokenize", {"prompt": PROMPT})
    assert answer["tokens"] == list(tokens.tokens) and answer["max_model_len"] == 2048
