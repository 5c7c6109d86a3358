"""SmolLM2 streamed by the inference service's vLLM engine (a decoupled model).

The session's mesh (tests/e2e/conftest.py) hosts ``smollm2`` on its inference
service and ``smollm2_tokenizer`` on its tokenizer service; these tests call
those stages directly, so they share the session's one engine instead of
starting their own. Streams go through our own grpc.aio stubs and, in a child
process, through tritonclient. What a user would notice: the answer streams
token by token and is right (Paris), concurrent streams keep their own text,
a cancelled stream stops the generation inside vLLM, bad requests name their
field, ModelInfer on a decoupled model says to use ModelStreamInfer, the
model's config shows (and the log says) the dtype the engine runs in: float32,
on any CPU, and a request for logprobs gets each token's with its top five.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from services.postprocess.detokenize import IncrementalDecoder
from shared.tensors import decode_outputs, encode_inputs
from tests.harness import RUNNING, Samples, run_client, scrape_metrics

pytestmark = pytest.mark.e2e

MODEL = "smollm2"
TOKENIZER = "smollm2_tokenizer"
MAX_MODEL_LEN = 2048
# Questions this small model answers right; each answer names its own capital,
# so streams that crossed would show.
CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Germany": "Berlin",
    "England": "London",
    "Russia": "Moscow",
    "Egypt": "Cairo",
    "China": "Beijing",
    "Canada": "Ottawa",
    "Greece": "Athens",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Sweden": "Stockholm",
    "Norway": "Oslo",
    "Poland": "Warsaw",
    "Kenya": "Nairobi",
    "Peru": "Lima",
}
STORY = "Write a very long story about a dragon who learns to bake bread."


@dataclass(frozen=True)
class Stage:
    """One stage process of the session's mesh."""

    address: str
    metrics_port: int

    def metrics(self) -> Samples:
        """Scrape the stage's /metrics endpoint."""
        return scrape_metrics(self.metrics_port)


@pytest.fixture(scope="module")
def services(mesh: dict[str, Any]) -> dict[str, Stage]:
    """The session mesh's inference and tokenizer services."""
    processes = mesh["processes"]
    return {
        name: Stage(processes[f"{name}-0"]["grpc"], processes[f"{name}-0"]["metrics_port"])
        for name in ("inference", "tokenizer")
    }


@pytest.fixture(scope="module")
def repo(mesh: dict[str, Any]) -> Path:
    return Path(mesh["repository"])


@pytest.fixture(scope="module")
def address(services: dict[str, Stage]) -> str:
    return services["inference"].address


def mesh_log(address: str) -> str:
    """The log of the running mesh whose processes include ``address``."""
    for name, path in RUNNING.values():
        if name == "deploy.local.supervisor" and address in (text := path.read_text()):
            return text
    raise AssertionError(f"no running mesh's log names {address}")


@pytest.fixture(scope="module")
def tokenizer(repo: Path) -> Tokenizer:
    return Tokenizer.from_file(str(repo / TOKENIZER / "1" / "tokenizer.json"))


@pytest.fixture(scope="module")
def chat_ids(repo: Path, tokenizer: Tokenizer) -> Any:
    """Question -> prompt ids, the chat template rendered as transformers renders it."""
    config = json.loads((repo / TOKENIZER / "1" / "tokenizer_config.json").read_text())
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        config["chat_template"]
    )

    def encode(question: str) -> list[int]:
        text = template.render(
            messages=[{"role": "user", "content": question}], add_generation_prompt=True
        )
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    return encode


def request(
    ids: list[int] | np.ndarray, sampling: dict[str, Any] | bytes | None, request_id: str = ""
) -> pb.ModelInferRequest:
    inputs: dict[str, np.ndarray] = {"INPUT_IDS": np.asarray(ids, dtype=np.int64)}
    if sampling is not None:
        raw = sampling if isinstance(sampling, bytes) else json.dumps(sampling).encode()
        inputs["SAMPLING"] = np.array([raw], dtype=object)
    message = pb.ModelInferRequest(model_name=MODEL, id=request_id)
    encode_inputs(message, inputs)
    return message


async def stream_all(
    address: str, requests: list[pb.ModelInferRequest]
) -> list[pb.ModelStreamInferResponse]:
    """Send ``requests`` on one stream; every response until each request is done."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter(requests), timeout=240
        )
        return [message async for message in call]


def is_final(message: pb.ModelStreamInferResponse) -> bool:
    return message.infer_response.parameters["triton_final_response"].bool_param


def llm_metric(samples: Samples, name: str, **labels: str) -> float:
    wanted = frozenset({"model": MODEL, "version": "1", **labels}.items())
    return samples.get((f"meshserve_llm_{name}", wanted), 0.0)


def test_tokenizer_stage_renders_the_chat_like_transformers(
    services: dict[str, Stage], chat_ids: Any
) -> None:
    chat = json.dumps([{"role": "user", "content": "What is the capital of France?"}])
    message = pb.ModelInferRequest(model_name=TOKENIZER)
    encode_inputs(message, {"MESSAGES": np.array([chat.encode()], dtype=object)})
    with grpc.insecure_channel(services["tokenizer"].address) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=60)
    ids = decode_outputs(response)["input_ids"]
    assert ids.tolist() == chat_ids("What is the capital of France?")  # [n]: no padding


def test_greedy_chat_streams_token_deltas_ending_in_paris(
    address: str, chat_ids: Any, tokenizer: Tokenizer
) -> None:
    prompt = chat_ids("What is the capital of France?")
    sampling = {"temperature": 0, "max_tokens": 24}
    messages = asyncio.run(stream_all(address, [request(prompt, sampling, "france")]))
    assert [m.error_message for m in messages] == [""] * len(messages)
    outputs = [decode_outputs(m.infer_response) for m in messages]
    assert len(outputs) >= 3  # streamed, not answered at once
    assert [is_final(m) for m in messages] == [False] * (len(messages) - 1) + [True]
    assert {m.infer_response.id for m in messages} == {"france"}
    decoder, text, previous = IncrementalDecoder(tokenizer), "", []
    for out in outputs:
        ids, new = out["OUTPUT_IDS"].tolist(), int(out["NEW_TOKENS"][0])
        assert ids[: len(previous)] == previous and len(ids) == len(previous) + new
        assert out["COMPLETION_TOKENS"].tolist() == [len(ids)]
        assert out["PROMPT_TOKENS"].tolist() == [len(prompt)]
        text += decoder.delta(ids, new, out["ENGINE_FINISH"][0].decode())[0]
        previous = ids
    assert [out["ENGINE_FINISH"][0] for out in outputs[:-1]] == [b""] * (len(outputs) - 1)
    assert outputs[-1]["ENGINE_FINISH"].tolist() == [b"stop"]
    assert text == tokenizer.decode(previous, skip_special_tokens=True)
    assert "Paris" in text


def test_model_config_shows_the_dtype_the_engine_runs_in(
    services: dict[str, Stage],
) -> None:
    with grpc.insecure_channel(services["inference"].address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        config = stub.ModelConfig(pb.ModelConfigRequest(name=MODEL), timeout=30).config
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters["dtype"] == "float32"  # the config's own: no engine guesses
    assert parameters["dtype_in_use"] == "float32"  # what the running engine resolved
    line = f"model '{MODEL}': dtype float32 in use (requested float32): as configured"
    assert line in mesh_log(services["inference"].address)


async def _answer(address: str, ids: list[int]) -> list[pb.ModelStreamInferResponse]:
    return await stream_all(address, [request(ids, {"temperature": 0, "max_tokens": 20})])


def test_sixteen_concurrent_streams_each_answer_their_own_question(
    address: str, chat_ids: Any, tokenizer: Tokenizer
) -> None:
    questions = [f"What is the capital of {country}?" for country in CAPITALS]

    async def everyone() -> list[list[pb.ModelStreamInferResponse]]:
        return await asyncio.gather(*(_answer(address, chat_ids(q)) for q in questions))

    started = time.monotonic()
    results = asyncio.run(everyone())
    elapsed = time.monotonic() - started
    generated = 0
    for (country, capital), messages in zip(CAPITALS.items(), results, strict=True):
        assert is_final(messages[-1]), country
        ids = decode_outputs(messages[-1].infer_response)["OUTPUT_IDS"].tolist()
        generated += len(ids)
        answer = tokenizer.decode(ids, skip_special_tokens=True)
        assert capital in answer, (country, answer)
        others = [city for city in CAPITALS.values() if city != capital and city in answer]
        assert not others, (country, answer)
    print(f"16 streams: {generated} tokens in {elapsed:.1f} s = {generated / elapsed:.0f} tok/s")


async def _cancel_after(address: str, ids: list[int], responses: int) -> int:
    """Open a long generation, read ``responses`` responses, then cancel the RPC."""
    # ignore_eos: only the cancel can end it, never an early end of text
    sampling = {"temperature": 0.8, "seed": 7, "max_tokens": 1500, "ignore_eos": True}
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([request(ids, sampling)]), timeout=240
        )
        seen = 0
        async for _ in call:
            seen += 1
            if seen == responses:
                call.cancel()
                break
        return seen


def test_cancelling_a_stream_aborts_the_generation_in_vllm(
    services: dict[str, Stage], chat_ids: Any
) -> None:
    service = services["inference"]
    aborted_before = llm_metric(service.metrics(), "requests_finished_total", finish_reason="abort")
    assert asyncio.run(_cancel_after(service.address, chat_ids(STORY), 3)) == 3
    names = ("requests_running", "requests_waiting", "requests_unfinished")
    deadline = time.monotonic() + 15
    while True:  # the abort completes on the server a moment after the cancel
        samples = service.metrics()
        busy = {name: llm_metric(samples, name) for name in names}
        aborted = llm_metric(samples, "requests_finished_total", finish_reason="abort")
        if (aborted > aborted_before and not any(busy.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert busy == dict.fromkeys(names, 0.0)
    assert aborted == aborted_before + 1
    assert llm_metric(samples, "time_to_first_token_seconds_count") >= 1
    assert llm_metric(samples, "generation_tokens_total") >= 3


def test_vllm_own_metric_names_are_served_for_its_dashboards(
    services: dict[str, Stage], chat_ids: Any
) -> None:
    service = services["inference"]
    engine = frozenset({"model_name": MODEL, "engine": "0"}.items())

    def vllm_metric(samples: Samples, name: str) -> float | None:
        return samples.get((f"vllm:{name}", engine))

    before = vllm_metric(service.metrics(), "generation_tokens_total") or 0.0
    good = request(chat_ids("What is 2 + 2?"), {"temperature": 0, "max_tokens": 4}, "good")
    messages = asyncio.run(stream_all(service.address, [good]))
    assert is_final(messages[-1]) and not messages[-1].error_message
    samples = service.metrics()
    assert vllm_metric(samples, "generation_tokens_total") == before + 4
    assert (vllm_metric(samples, "time_to_first_token_seconds_count") or 0) >= 1
    assert (vllm_metric(samples, "e2e_request_latency_seconds_count") or 0) >= 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert vllm_metric(samples, gauge) is not None, gauge


BAD_REQUESTS = [
    ("bad-max-tokens", {"max_tokens": -5}, "max_tokens"),
    # Over the config's max_tokens_cap (models/smollm2.py): refused, not run for minutes.
    ("over-cap-max-tokens", {"max_tokens": 1537}, "max_tokens_cap"),
    ("bad-temperature", {"temperature": -0.5}, "temperature"),
    ("bad-json", b'{"max_tokens": 8', "SAMPLING"),
    ("bad-field", {"max_token": 8}, "max_token"),
    # JSON that Python's parser takes but no protobuf string holds, or that it
    # would fail with RecursionError: refused as JSON, naming the tensor.
    ("bad-surrogate", b'{"stop": ["\\udcff"]}', "SAMPLING"),
    ("bad-deep-json", b"[" * 3000 + b"]" * 3000, "SAMPLING"),
]


def test_bad_requests_fail_alone_naming_the_field(address: str, chat_ids: Any) -> None:
    prompt = chat_ids("What is 2 + 2?")
    requests = [request(prompt, {"temperature": 0, "max_tokens": 4}, "good")]
    requests += [request(prompt, sampling, rid) for rid, sampling, _ in BAD_REQUESTS]
    requests.append(request(np.ones(MAX_MODEL_LEN + 1, np.int64), None, "bad-long-prompt"))
    messages = asyncio.run(stream_all(address, requests))
    errors = {m.infer_response.id: m for m in messages if m.error_message}
    expected = {rid: field for rid, _, field in BAD_REQUESTS} | {"bad-long-prompt": "INPUT_IDS"}
    assert set(errors) == set(expected)
    for rid, field in expected.items():
        assert field in errors[rid].error_message, errors[rid].error_message
        code = errors[rid].infer_response.parameters["meshserve_status_code"].int64_param
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    good = [m for m in messages if m.infer_response.id == "good"]
    assert good and is_final(good[-1]) and not good[-1].error_message
    # ModelInfer cannot carry a stream: the decoupled model refuses it, bad or good.
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for message in requests[:2]:
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(message, timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() == f"model '{MODEL}' is decoupled; use ModelStreamInfer"


def test_tritonclient_streaming_receives_every_response(
    address: str, chat_ids: Any, tmp_path: Path
) -> None:
    good, bad = tmp_path / "good.npz", tmp_path / "bad.npz"
    ids = np.array(chat_ids("What is the capital of France?"), dtype=np.int64)
    sampling = json.dumps({"temperature": 0, "max_tokens": 12}).encode()
    np.savez(good, INPUT_IDS=ids, SAMPLING=np.array([sampling], dtype=object))
    np.savez(bad, INPUT_IDS=ids, SAMPLING=np.array([b'{"top_p": 0}'], dtype=object))
    answers = run_client(
        "triton_llm_stream.py", address, MODEL, [["good", str(good)], ["bad", str(bad)]]
    )
    responses = answers["good"]["responses"]
    assert len(responses) >= 2 and answers["good"]["error"] is None
    assert [r["final"] for r in responses] == [False] * (len(responses) - 1) + [True]
    assert sum(r["new_tokens"] for r in responses) == len(responses[-1]["output_ids"])
    assert responses[-1]["finish"] in ("stop", "length")
    assert "top_p" in answers["bad"]["error"]


def test_logprobs_come_with_each_step_sampled_token_first(address: str, chat_ids: Any) -> None:
    prompt = chat_ids("What is the capital of France?")
    sampling = {"temperature": 0, "max_tokens": 6, "logprobs": 5}
    messages = asyncio.run(stream_all(address, [request(prompt, sampling, "lp")]))
    outputs = [decode_outputs(m.infer_response) for m in messages if not m.error_message]
    assert len(outputs) == len(messages)
    seen = 0
    for out in outputs:
        new = int(out["NEW_TOKENS"][0])
        ids, values = out["LOGPROB_IDS"], out["LOGPROBS"]
        assert ids.shape == values.shape == (new, 6)
        if new:
            assert ids[:, 0].tolist() == out["OUTPUT_IDS"][-new:].tolist()
        # Greedy: the sampled token is the likeliest; the alternatives come by rank.
        assert (ids[:, 0] == ids[:, 1]).all() and (values[:, 0] == values[:, 1]).all()
        assert (np.diff(values[:, 1:], axis=1) <= 0).all() and (values <= 0).all()
        seen += new
    assert seen == 6
