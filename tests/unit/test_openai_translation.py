"""OpenAI request JSON -> meshserve.v1 messages, and TextDeltas -> OpenAI documents;
Triton generate request JSON -> the LLM pipeline's request."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from gateway.http.generate import DEFAULT_MAX_TOKENS, GenerateCall, generate_request
from gateway.http.openai_documents import (
    Generation,
    InvalidParam,
    chat_request,
    completion_request,
    detokenize_request,
    embed_request,
    embeddings_document,
    error_document,
    models_document,
    tokenize_document,
    tokenize_request,
)
from meshserve.v1 import meshserve_pb2 as api
from shared.errors import InvalidArgument, Unavailable
from shared.tensors import decode_inputs

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_request_carries_messages_model_and_sampling() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
            },
            {"role": "assistant", "content": "Hello."},
            {"role": "developer", "content": "Answer in French."},
        ],
        "temperature": 0,
        "top_p": 0.9,
        "max_completion_tokens": 32,
        "max_tokens": 7,
        "stop": "\n\n",
        "seed": 42,
        "top_k": 5,
        "n": 1,
        "presence_penalty": 0.0,
        "user": "someone",
    }
    message, generation = chat_request(body)
    assert [(m.role, m.content) for m in message.messages] == [
        ("system", "Be brief."),
        ("user", "Hi\nthere"),
        ("assistant", "Hello."),
        ("system", "Answer in French."),
    ]
    assert message.model == "llm" and generation.model == "llm"
    sampling = message.sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0.0
    assert sampling.top_p == pytest.approx(0.9)
    assert sampling.max_tokens == 32  # max_completion_tokens wins
    assert list(sampling.stop) == ["\n\n"] and sampling.seed == 42 and sampling.top_k == 5
    assert not sampling.HasField("repetition_penalty")
    assert not generation.stream and generation.id.startswith("chatcmpl-")


def test_unset_sampling_fields_stay_unset() -> None:
    message, _ = chat_request({"messages": QUESTION, "model": "my_llm"})
    assert message.model == "my_llm"
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed"):
        assert not message.sampling.HasField(name), name


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"n": 2}, "n"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream": "yes"}, "stream"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        ({"model": 7}, "model"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_fields_name_the_param(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParam) as caught:
        chat_request({"messages": QUESTION, **extra})
    assert caught.value.param == param
    assert caught.value.http_status == 400
    assert caught.value.message.startswith(param)


def test_unsupported_fields_say_so() -> None:
    with pytest.raises(InvalidParam) as caught:
        chat_request({"messages": QUESTION, "n": 3})
    assert caught.value.error_code == "unsupported_parameter"
    assert "not supported" in caught.value.message


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("hello", "messages"),
        (["hello"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "tool", "content": "42"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text",
        ),
    ],
)
def test_malformed_messages_are_rejected(messages: Any, param: str) -> None:
    with pytest.raises(InvalidParam) as caught:
        chat_request({"messages": messages})
    assert caught.value.param == param


def test_completion_request_takes_one_prompt() -> None:
    message, generation = completion_request(
        {"prompt": ["Once upon a time"], "max_tokens": 5, "stream": True}
    )
    assert message.prompt == "Once upon a time" and message.sampling.max_tokens == 5
    assert generation.stream and not generation.chat and generation.id.startswith("cmpl-")
    for prompt in ([1, 2, 3], ["a", "b"], "", None, [[1, 2]]):
        with pytest.raises(InvalidParam, match="prompt"):
            completion_request({"prompt": prompt})


def test_embed_request() -> None:
    message, encoding, dimensions = embed_request({"input": "hello"})
    assert list(message.texts) == ["hello"] and message.model == "text_embedding"
    assert encoding == "float" and dimensions is None
    message, encoding, dimensions = embed_request(
        {"input": ["a", "b"], "model": "emb", "encoding_format": "base64", "dimensions": 384}
    )
    assert list(message.texts) == ["a", "b"] and message.model == "emb"
    assert encoding == "base64" and dimensions == 384
    for bad in ([1, 2], [[1, 2]], [], None, ["a", 1]):
        with pytest.raises(InvalidParam, match="input"):
            embed_request({"input": bad})
    with pytest.raises(InvalidParam, match="encoding_format"):
        embed_request({"input": "a", "encoding_format": "int8"})


def test_tokenize_request_takes_a_prompt_or_a_chat_at_vllms_defaults() -> None:
    prompt = tokenize_request({"prompt": "hi", "add_special_tokens": True})
    assert (prompt.model, prompt.prompt, list(prompt.messages)) == ("llm", "hi", [])
    chat = tokenize_request(
        {"model": "m", "messages": QUESTION, "add_generation_prompt": True, "tools": None}
    )
    assert chat.model == "m" and not chat.prompt
    assert [(m.role, m.content) for m in chat.messages] == [("user", QUESTION[0]["content"])]
    refused = [
        ({"prompt": "hi", "messages": QUESTION}, "prompt"),
        ({}, "prompt"),
        ({"prompt": ["hi"]}, "prompt"),
        ({"prompt": "hi", "return_token_strs": True}, "return_token_strs"),
        # vLLM adds special tokens to a prompt by default, not to a chat.
        ({"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
        ({"messages": QUESTION, "add_special_tokens": True}, "add_special_tokens"),
        ({"messages": QUESTION, "continue_final_message": True}, "continue_final_message"),
        ({"messages": QUESTION, "chat_template": "{{ x }}"}, "chat_template"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ]
    for body, param in refused:
        with pytest.raises(InvalidParam) as raised:
            tokenize_request(body)
        assert raised.value.param == param, body


def test_detokenize_request_and_the_tokenize_document() -> None:
    message = detokenize_request({"tokens": [0, 5, 2**31 - 1]})
    assert message.model == "llm" and list(message.tokens) == [0, 5, 2**31 - 1]
    for bad in (None, "1 2", [1, -1], [1.5], [True], [2**31]):
        with pytest.raises(InvalidParam, match="tokens"):
            detokenize_request({"tokens": bad})
    answer = api.TokenizeResponse(model="llm", tokens=[7, 8, 9], max_model_len=2048)
    assert tokenize_document(answer) == {
        "count": 3,
        "max_model_len": 2048,
        "tokens": [7, 8, 9],
        "token_strs": None,
    }


def _deltas(*pieces: tuple[str, str, int, int]) -> list[api.TextDelta]:
    return [
        api.TextDelta(text=t, finish_reason=f, prompt_tokens=p, completion_tokens=c)
        for t, f, p, c in pieces
    ]


def test_chat_stream_chunks_follow_openai_order() -> None:
    generation = Generation(True, "llm", stream=True, include_usage=True)
    chunks = [generation.chunk(None)]
    for delta in _deltas(("The", "", 9, 1), (" capital", "", 9, 2), (".", "stop", 9, 3)):
        chunks.extend(generation.chunks(delta))
    chunks.append(generation.usage_chunk())
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["id"] for c in chunks} == {generation.id}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["choices"][0]["delta"].get("content") for c in chunks[1:4]]
    assert texts == ["The", " capital", "."]
    finish = chunks[4]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks[:5])
    assert chunks[5]["choices"] == []
    assert chunks[5]["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def test_text_stream_chunks_without_usage() -> None:
    generation = Generation(False, "llm", stream=True)
    chunks = [
        c for d in _deltas(("a", "", 2, 1), ("", "length", 2, 1)) for c in generation.chunks(d)
    ]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)


def test_whole_answers() -> None:
    generation = Generation(True, "llm")
    for delta in _deltas(("Paris", "stop", 5, 2)):
        generation.absorb(delta)
    document = generation.document("Paris", "stop")
    assert document["object"] == "chat.completion"
    assert document["choices"][0]["message"] == {"role": "assistant", "content": "Paris"}
    assert document["usage"]["total_tokens"] == 7
    text = Generation(False, "llm").document("Paris", "length")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Paris"


def test_an_aborted_generation_is_an_error() -> None:
    with pytest.raises(Unavailable):
        Generation(True, "llm").absorb(api.TextDelta(finish_reason="abort"))


def test_error_documents() -> None:
    exc = InvalidParam("max_tokens", "must be between 1 and 2147483647, got -1")
    assert error_document(400, exc.message, exc) == {
        "error": {
            "message": exc.message,
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_value",
        }
    }
    types = {s: error_document(s, "x")["error"]["type"] for s in (404, 413, 429, 500, 503)}
    assert types == {
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable_error",
    }


def test_models_lists_ready_pipelines() -> None:
    response = api.ListModelsResponse()
    response.models.add(name="llm", backend="ensemble", state=api.MODEL_STATE_READY)
    response.models.add(name="smollm2", backend="vllm", state=api.MODEL_STATE_READY)
    response.models.add(name="later", backend="ensemble", state=api.MODEL_STATE_LOADING)
    document = models_document(response)
    assert document == {
        "object": "list",
        "data": [{"id": "llm", "object": "model", "created": 0, "owned_by": "meshserve"}],
    }


def test_embeddings_document_float_and_base64() -> None:
    response = api.EmbedResponse(model="text_embedding", dimensions=3)
    response.embeddings.add(values=[0.5, -0.25, 1.0])
    response.embeddings.add(values=[0.0, 1.0, 0.0])
    floats = embeddings_document(response, "float", None)
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["data"][0]["embedding"] == [0.5, -0.25, 1.0]
    encoded = embeddings_document(response, "base64", 3)["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_array_equal(decoded, [0.5, -0.25, 1.0])
    with pytest.raises(InvalidParam, match="dimensions"):
        embeddings_document(response, "float", 2)


# --- Triton's generate extension (gateway/http/generate.py) ----------------------------


def generate_sampling(call: GenerateCall) -> dict[str, Any]:
    inputs = decode_inputs(call.request)
    assert inputs["PROMPT"].tolist() == [call.prompt.encode()]
    sampling: dict[str, Any] = json.loads(inputs["SAMPLING"][0])
    return sampling


def test_generate_request_merges_the_vllm_backend_forms_of_sampling() -> None:
    body = {
        "text_input": "Hello",
        "sampling_parameters": json.dumps({"temperature": 0.5, "top_k": 4, "max_tokens": 9}),
        "parameters": {"temperature": 0, "stop": ["\n"], "exclude_input_in_output": True},
        "stream": False,
    }
    call = generate_request("llm", "1", body)
    assert (call.request.model_name, call.request.model_version) == ("llm", "1")
    # parameters win over sampling_parameters; the switches are not sampling settings.
    assert generate_sampling(call) == {
        "temperature": 0,
        "top_k": 4,
        "max_tokens": 9,
        "stop": ["\n"],
    }
    assert (call.stream, call.echo) == (False, False)


def test_generate_request_defaults_stream_echo_and_sixteen_tokens() -> None:
    call = generate_request("llm", "", {"text_input": "Hello"})
    assert generate_sampling(call) == {"max_tokens": DEFAULT_MAX_TOKENS} == {"max_tokens": 16}
    assert (call.stream, call.echo) == (True, True)
    # null asks for the default, as leaving the setting out does.
    nulls = {"text_input": "Hello", "parameters": {"max_tokens": None, "seed": None}}
    assert generate_sampling(generate_request("llm", "", nulls)) == {"max_tokens": 16}


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({}, "text_input: expected a non-empty string, got null"),
        ({"text_input": 5}, "text_input: expected a non-empty string, got number"),
        ({"text_input": "x", "n": 2}, "unexpected field 'n'"),
        ({"text_input": "x", "parameters": []}, "parameters: expected an object, got array"),
        ({"text_input": "x", "parameters": {"best_of": 2}}, "parameters.best_of: not a setting"),
        ({"text_input": "x", "parameters": {"top_p": 0}}, "parameters.top_p: must be greater"),
        ({"text_input": "x", "sampling_parameters": "{"}, "sampling_parameters: not valid JSON"),
        ({"text_input": "x", "sampling_parameters": "[1]"}, "sampling_parameters: expected"),
        ({"text_input": "x", "parameters": {"stream": 1}}, "stream: expected a boolean"),
    ],
)
def test_generate_request_refuses_naming_the_field(body: dict[str, Any], problem: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        generate_request("llm", "", body)
    assert problem in str(caught.value)
