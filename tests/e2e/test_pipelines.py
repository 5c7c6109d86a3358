"""End to end on real models: the default ensembles through the orchestrator."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.sources import sample_image
from shared.tensors import decode_outputs, encode_inputs
from tests.harness import run_client
from tests.otlp import OtlpReceiver

pytestmark = pytest.mark.e2e

RELATED = ("A man is playing a guitar.", "Someone plays an acoustic guitar.")
UNRELATED = ("A man is playing a guitar.", "The stock market fell sharply today.")


def image(name: str) -> np.ndarray:
    return np.array([[sample_image(name).read_bytes()]], dtype=object)


def infer(
    address: str,
    model: str,
    inputs: dict[str, np.ndarray],
    metadata: list[tuple[str, str]] | None = None,
) -> dict[str, np.ndarray]:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, inputs)
    with grpc.insecure_channel(address) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=60, metadata=metadata
        )
    return decode_outputs(response)


def test_tritonclient_classifies_the_espresso(mesh: dict[str, Any], tmp_path: Path) -> None:
    np.savez(tmp_path / "in.npz", IMAGE=image("coffee.png"))
    run_client(
        "infer_npz.py",
        mesh["orchestrator"],
        "image_classifier",
        str(tmp_path / "in.npz"),
        str(tmp_path / "out.npz"),
        "sync",
    )
    with np.load(tmp_path / "out.npz", allow_pickle=True) as out:
        labels, probabilities = out["LABELS"][0], out["PROBABILITIES"][0]
    assert labels[0] == b"espresso"
    assert probabilities[0] > 0.9
    assert list(probabilities) == sorted(probabilities, reverse=True)


def test_cat_photo_is_a_cat(mesh: dict[str, Any]) -> None:
    labels = infer(mesh["orchestrator"], "image_classifier", {"IMAGE": image("chelsea.png")})
    assert labels["LABELS"][0][0] in (b"tabby", b"tiger cat", b"Egyptian cat")


def embed(address: str, texts: tuple[str, ...]) -> np.ndarray:
    array = np.array([[t.encode()] for t in texts], dtype=object)
    return infer(address, "text_embedding", {"TEXT": array})["EMBEDDING"]


def test_text_embedding_relates_related_sentences(mesh: dict[str, Any]) -> None:
    related = embed(mesh["orchestrator"], RELATED)
    unrelated = embed(mesh["orchestrator"], UNRELATED)
    assert np.allclose(np.linalg.norm(related, axis=1), 1.0, atol=1e-5)
    assert float(related[0] @ related[1]) >= 0.5
    assert float(unrelated[0] @ unrelated[1]) <= 0.2


def test_ensemble_equals_its_steps_one_by_one(mesh: dict[str, Any]) -> None:
    address = mesh["orchestrator"]
    whole = infer(address, "image_classifier", {"IMAGE": image("coffee.png")})
    pixels = infer(address, "image_preprocess", {"IMAGE": image("coffee.png")})["PIXELS"]
    logits = infer(address, "mobilenet_v2_onnx", {"input": pixels})["logits"]
    top = infer(address, "imagenet_top5", {"LOGITS": logits})
    assert whole["LABELS"].tolist() == top["LABELS"].tolist()
    np.testing.assert_array_equal(whole["PROBABILITIES"], top["PROBABILITIES"])

    texts = np.array([[RELATED[0].encode()]], dtype=object)
    embedding = infer(address, "text_embedding", {"TEXT": texts})["EMBEDDING"]
    tokens = infer(address, "minilm_tokenizer", {"TEXT": texts})
    hidden = infer(address, "minilm", tokens)["last_hidden_state"]
    pooled = infer(
        address,
        "mean_pool",
        {"TOKEN_EMBEDDINGS": hidden, "ATTENTION_MASK": tokens["attention_mask"]},
    )
    np.testing.assert_array_equal(embedding, pooled["EMBEDDING"])


def test_undecodable_image_names_the_step_and_tensor(mesh: dict[str, Any]) -> None:
    garbage = np.array([[b"this is not an image"]], dtype=object)
    with pytest.raises(grpc.RpcError) as caught:
        infer(mesh["orchestrator"], "image_classifier", {"IMAGE": garbage})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert "ensemble 'image_classifier' step 0 ('image_preprocess')" in details
    assert "IMAGE" in details
    assert (
        infer(mesh["orchestrator"], "image_classifier", {"IMAGE": image("coffee.png")})["LABELS"][
            0
        ][0]
        == b"espresso"
    )


def test_one_trace_covers_every_stage(mesh: dict[str, Any], otlp: OtlpReceiver) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = "00f067aa0ba902b7"
    for model, inputs in (
        ("image_classifier", {"IMAGE": image("coffee.png")}),
        ("text_embedding", {"TEXT": np.array([[b"hi"]], dtype=object)}),
    ):
        tid = trace_id if model == "image_classifier" else trace_id[::-1]
        infer(
            mesh["orchestrator"], model, inputs, metadata=[("traceparent", f"00-{tid}-{parent}-01")]
        )
        expected = {
            "orchestrator",
            "inference",
            "postprocess",
            "preprocess" if model == "image_classifier" else "tokenizer",
        }

        def complete(spans: list, tid: str = tid, expected: set = expected) -> bool:  # type: ignore[type-arg]
            return expected <= {s.service for s in spans if s.trace_id == tid and s.kind == 2}

        spans = [s for s in otlp.wait_for(complete) if s.trace_id == tid]
        servers = {s.service: s for s in spans if s.kind == 2}
        assert expected <= set(servers), sorted(servers)
        ids = {s.span_id: s for s in spans}
        assert servers["orchestrator"].parent_id == parent
        for stage in expected - {"orchestrator"}:
            step = ids[servers[stage].parent_id]  # the step's span is the client span
            assert step.name.startswith("ensemble step") and step.kind == 3
            assert step.parent_id == servers["orchestrator"].span_id
            assert "meshserve.queue_us" in servers[stage].attributes


def test_llm_ensemble_sends_each_token_as_it_comes(mesh: dict[str, Any]) -> None:
    prompt = "Write a short story about a robot learning to bake bread."
    messages = json.dumps([{"role": "user", "content": prompt}])
    request = pb.ModelInferRequest(model_name="llm")
    encode_inputs(
        request,
        {
            "MESSAGES": np.array([messages.encode()], dtype=object),
            "SAMPLING": np.array([b'{"temperature": 0, "max_tokens": 12}'], dtype=object),
        },
    )
    arrivals: list[float] = []
    responses: list[pb.ModelInferResponse] = []
    with grpc.insecure_channel(mesh["orchestrator"]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for message in stub.ModelStreamInfer(iter([request]), timeout=120):
            assert not message.error_message
            arrivals.append(time.perf_counter())
            responses.append(message.infer_response)
    finals = [r.parameters["triton_final_response"].bool_param for r in responses]
    assert finals == [False] * (len(responses) - 1) + [True]
    last = decode_outputs(responses[-1])
    assert bytes(last["FINISH_REASON"].reshape(-1)[0]) == b"length"
    assert int(last["COMPLETION_TOKENS"].reshape(-1)[0]) == 12 == len(responses)
    # One response per engine step, sent when made: the last token is not
    # held back until the stream ends (it came one step after the one before,
    # as every token did), nor is any token held until the next one exists.
    gaps = np.diff(arrivals)
    assert gaps[-1] > np.median(gaps[:-1]) / 3, gaps
