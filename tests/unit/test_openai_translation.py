"""OpenAI request JSON -> meshserve.v1 messages, and TextDeltas -> OpenAI documents;
Triton generate request JSON -> the LLM pipeline's request."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from gateway.http.generate import DEFAULT_MAX_TOKENS, GenerateCall, generate_request
from gateway.http.openai_answer import Choices, Generation
from gateway.http.openai_documents import (
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
from gateway.http.openai_fields import StreamOptions
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
        ({"n": 0}, "n"),
        ({"n": 2, "temperature": 0}, "n"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": "x"}, "presence_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 3}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ({"logit_bias": {"12": 101}}, "logit_bias.12"),
        ({"tools": [{"type": "function"}]}, "tools[0].function.name"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"stream": "yes"}, "stream"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
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
        chat_request({"messages": QUESTION, "functions": [{"name": "f"}]})
    assert caught.value.error_code == "unsupported_parameter"
    assert "not supported" in caught.value.message
    for body, param in (
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"echo": True, "logprobs": 2}, "echo"),
    ):
        with pytest.raises(InvalidParam) as caught:
            completion_request({"prompt": "Hi", **body})
        assert (caught.value.param, caught.value.error_code) == (param, "unsupported_parameter")


def test_vllm_sampling_fields_reach_sampling_params() -> None:
    body = {
        "messages": QUESTION,
        "n": 3,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "min_tokens": 2,
        "ignore_eos": True,
        "logit_bias": {"504": -100, "12": 2.5},
        "stop_token_ids": [2],
        "logprobs": True,
        "top_logprobs": 5,
        "user": "u-1",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    message, generation = chat_request(body)
    sampling = message.sampling
    assert (sampling.n, sampling.seed, sampling.min_tokens, sampling.logprobs) == (3, 7, 2, 5)
    assert sampling.presence_penalty == 0.5 and sampling.frequency_penalty == -0.5
    assert sampling.ignore_eos and sampling.min_p == pytest.approx(0.05)
    assert dict(sampling.logit_bias) == {504: -100.0, 12: 2.5}
    assert (generation.n, generation.logprobs) == (3, 5)
    assert generation.options.include_usage and generation.options.continuous_usage_stats


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "object"}},
                }
            },
            {"json_schema": '{"type": "object"}'},
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"guided_grammar": "root ::= 'a'"}, {"grammar": "root ::= 'a'"}),
        ({"guided_json": '{"type": "string"}'}, {"json_schema": '{"type": "string"}'}),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_structured_output_fields_become_one_constraint(
    extra: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    message, _ = chat_request({"messages": QUESTION, **extra})
    if expected is None:
        assert not message.sampling.HasField("structured")
    else:
        assert message.sampling.structured == api.StructuredOutput(**expected)


def test_tools_travel_with_the_chat() -> None:
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    message, _ = chat_request({"messages": QUESTION, "tools": [tool], "tool_choice": "auto"})
    assert [dict(t)["function"]["name"] for t in message.tools] == ["weather"]


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
    generation = Generation(True, "llm", stream=True, options=StreamOptions(include_usage=True))
    chunks = []
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
    choices = Choices(Generation(True, "llm"))
    for delta in _deltas(("Paris", "stop", 5, 2)):
        choices.add(delta)
    document = choices.document()
    assert document["object"] == "chat.completion"
    message = {"role": "assistant", "content": "Paris", "tool_calls": []}
    assert document["choices"][0]["message"] == message
    assert document["usage"]["total_tokens"] == 7
    text = Choices(Generation(False, "llm", echo="The capital is "))
    text.add(api.TextDelta(text="Paris", finish_reason="length"))
    answer = text.document()
    assert answer["object"] == "text_completion"
    assert answer["choices"][0]["text"] == "The capital is Paris"
    assert answer["choices"][0]["finish_reason"] == "length"


def _token(token_id: int, logprob: float, text: str, *top: tuple[int, float, str]) -> Any:
    def one(i: int, lp: float, t: str) -> api.TokenLogprob:
        return api.TokenLogprob(token=t, token_id=i, logprob=lp, token_bytes=t.encode())

    entry = one(token_id, logprob, text)
    entry.top_logprobs.extend(one(*t) for t in top)
    return entry


def test_choices_keep_their_own_text_logprobs_and_counts() -> None:
    generation = Generation(True, "llm", n=2, logprobs=2)
    choices = Choices(generation)
    paris = _token(7, -0.1, " Paris", (7, -0.1, " Paris"), (9, -2.5, " Lyon"))
    lyon = _token(9, -2.5, " Lyon", (7, -0.1, " Paris"), (9, -2.5, " Lyon"))
    choices.add(api.TextDelta(index=1, text=" Lyon", completion_tokens=1, logprobs=[lyon]))
    choices.add(api.TextDelta(index=0, text=" Paris", completion_tokens=1, logprobs=[paris]))
    choices.add(api.TextDelta(index=0, finish_reason="stop", prompt_tokens=4, completion_tokens=2))
    choices.add(
        api.TextDelta(index=1, finish_reason="length", prompt_tokens=4, completion_tokens=1)
    )
    document = choices.document()
    first, second = document["choices"]
    assert (first["message"]["content"], second["message"]["content"]) == (" Paris", " Lyon")
    assert (first["finish_reason"], second["finish_reason"]) == ("stop", "length")
    assert document["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    # vLLM's order: the sampled token, then the likeliest others, each once.
    tops = [t["token"] for t in second["logprobs"]["content"][0]["top_logprobs"]]
    assert tops == [" Lyon", " Paris"]
    entry = first["logprobs"]["content"][0]
    assert entry["token"] == " Paris" and entry["bytes"] == list(b" Paris")
    assert entry["logprob"] == pytest.approx(-0.1)


def test_completion_logprobs_take_vllms_shape() -> None:
    generation = Generation(False, "llm", stream=True, logprobs=1)
    token = _token(7, -0.5, " Paris", (7, -0.5, " Paris"), (9, -1.5, " Lyon"), (3, -3.0, " Nice"))
    chunks = generation.chunks(api.TextDelta(text=" Paris", logprobs=[token, token]))
    logprobs = chunks[0]["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" Paris", " Paris"]
    assert logprobs["text_offset"] == [0, 6]
    assert logprobs["top_logprobs"][0] == {" Paris": -0.5, " Lyon": -1.5}


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
