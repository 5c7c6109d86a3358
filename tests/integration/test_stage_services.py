"""The tokenizer, preprocess and postprocess services as real processes on port 0.

One temporary repository holds every model, with its config written here; each
service loads only the models its backends host. Results are compared with the
same libraries run locally (``tokenizers``, ``transform.preprocess``, numpy).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tokenizers import Tokenizer

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models import sources
from services.preprocess.transform import preprocess
from shared.tensors import decode_outputs, encode_inputs
from tests.harness import ServiceProcess

TOKEN_OUTPUTS = """
output [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
         { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] },
         { name: "token_type_ids" data_type: TYPE_INT64 dims: [ -1 ] } ]
"""

CONFIGS = {
    "minilm_tokenizer": """
backend: "tokenizer"
max_batch_size: 32
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
    + TOKEN_OUTPUTS
    + """
dynamic_batching { max_queue_delay_microseconds: 50000 }
""",
    "short_tokenizer": """
backend: "tokenizer"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
         { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] } ]
parameters { key: "max_length" value: { string_value: "8" } }
parameters { key: "pad_to_multiple_of" value: { string_value: "4" } }
""",
    "chat_tokenizer": """
backend: "tokenizer"
max_batch_size: 8
input [ { name: "MESSAGES" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
    + TOKEN_OUTPUTS,
    "imagenet_preprocess": """
backend: "image_preprocess"
max_batch_size: 8
input [ { name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "PIXELS" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
""",
    "toy_classify": """
backend: "classify"
max_batch_size: 8
input [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 6 ] } ]
output [ { name: "LABELS" data_type: TYPE_STRING dims: [ 3 ] label_filename: "labels.txt" },
         { name: "PROBABILITIES" data_type: TYPE_FP32 dims: [ 3 ] } ]
parameters { key: "top_k" value: { string_value: "3" } }
""",
    "mean_pool": """
backend: "embedding_pool"
max_batch_size: 8
input [ { name: "TOKEN_EMBEDDINGS" data_type: TYPE_FP32 dims: [ -1, 8 ] },
        { name: "ATTENTION_MASK" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 8 ] } ]
""",
}
LABELS = ["apple", "banana", "cherry", "date", "elderberry", "fig"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, twice, before breakfast.",
    "Hello!",
    "Serving models over gRPC with dynamic batching keeps the accelerator busy.",
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stage-repo")
    for name, config in CONFIGS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    for name in ("minilm_tokenizer", "short_tokenizer", "chat_tokenizer"):
        shutil.copy(sources.minilm_file("tokenizer.json"), root / name / "1" / "tokenizer.json")
    config = {"chat_template": CHAT_TEMPLATE, "pad_token": "[PAD]"}
    (root / "chat_tokenizer" / "1" / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "toy_classify" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    return root


Stub = pb_grpc.GRPCInferenceServiceStub


def serve(service: str, repo: Path) -> Iterator[tuple[ServiceProcess, Stub]]:
    """One service process over ``repo`` and a client for it; stopped at the end."""
    process = ServiceProcess(f"services.{service}.main", ["--model-repository", str(repo)])
    try:
        with grpc.insecure_channel(process.address) as channel:
            yield process, pb_grpc.GRPCInferenceServiceStub(channel)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def tokenizer_service(repo: Path) -> Iterator[tuple[ServiceProcess, Stub]]:
    yield from serve("tokenizer", repo)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_service: tuple[ServiceProcess, Stub]) -> Stub:
    return tokenizer_service[1]


@pytest.fixture(scope="module")
def preprocessor(repo: Path) -> Iterator[Stub]:
    for _, client in serve("preprocess", repo):
        yield client


@pytest.fixture(scope="module")
def postprocessor(repo: Path) -> Iterator[Stub]:
    for _, client in serve("postprocess", repo):
        yield client


def strings(*items: bytes | str) -> np.ndarray:
    """A batched TYPE_STRING tensor ``[len(items), 1]``."""
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = [item.encode() if isinstance(item, str) else item for item in items]
    return array


def infer_request(model: str, **inputs: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, inputs)
    return request


def local_tokenizer(max_length: int = 512) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(sources.minilm_file("tokenizer.json")))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    return tokenizer


def assert_rows_match(outputs: dict[str, np.ndarray], expected_ids: list[list[int]]) -> None:
    """Each row holds its ids, then padding: pad id 0, mask 0, one width rounded to 16."""
    ids, mask = outputs["input_ids"], outputs["attention_mask"]
    assert ids.shape == mask.shape == outputs["token_type_ids"].shape
    longest = max(len(row) for row in expected_ids)
    assert ids.shape[1] == -(-longest // 16) * 16
    for row, expected in enumerate(expected_ids):
        assert ids[row, : len(expected)].tolist() == expected
        assert mask[row].tolist() == [1] * len(expected) + [0] * (ids.shape[1] - len(expected))
        assert not ids[row, len(expected) :].any()
    assert not outputs["token_type_ids"].any()


# -- tokenizer ----------------------------------------------------------------


def test_tokenizer_ids_equal_tokenizers_run_locally(tokenizer: Stub) -> None:
    response = tokenizer.ModelInfer(
        infer_request("minilm_tokenizer", TEXT=strings(*SENTENCES)), timeout=30
    )
    expected = [e.ids for e in local_tokenizer().encode_batch(SENTENCES)]
    assert_rows_match(decode_outputs(response), expected)


async def _infer_concurrently(address: str, texts: list[str]) -> list[dict[str, np.ndarray]]:
    async with grpc.aio.insecure_channel(address) as channel:
        client = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [
            client.ModelInfer(infer_request("minilm_tokenizer", TEXT=strings(t)), timeout=30)
            for t in texts
        ]
        return [decode_outputs(response) for response in await asyncio.gather(*calls)]


def test_concurrent_requests_are_batched_and_each_gets_its_own_ids(
    tokenizer_service: tuple[ServiceProcess, Stub],
) -> None:
    process, tokenizer = tokenizer_service
    texts = [f"request number {i}: " + "word " * i for i in range(16)]
    results = asyncio.run(_infer_concurrently(process.address, texts))
    reference = local_tokenizer()
    for text, outputs in zip(texts, results, strict=True):
        expected = reference.encode(text).ids
        assert outputs["input_ids"][0, : len(expected)].tolist() == expected
        assert int(outputs["attention_mask"].sum()) == len(expected)
        assert outputs["input_ids"].shape[1] % 16 == 0
    stats = tokenizer.ModelStatistics(
        pb.ModelStatisticsRequest(name="minilm_tokenizer"), timeout=10
    )
    sizes = {entry.batch_size for entry in stats.model_stats[0].batch_stats}
    assert max(sizes) > 1, f"no batch combined requests: {sizes}"


def test_tokenizer_truncates_at_max_length(tokenizer: Stub) -> None:
    text = "this sentence is clearly longer than eight tokens in total"
    response = tokenizer.ModelInfer(
        infer_request("short_tokenizer", TEXT=strings(text, "short")), timeout=30
    )
    outputs = decode_outputs(response)
    assert set(outputs) == {"input_ids", "attention_mask"}  # no token_type_ids declared
    assert outputs["input_ids"].shape == (2, 8)
    assert outputs["input_ids"][0].tolist() == local_tokenizer(8).encode(text).ids
    assert outputs["input_ids"][0, -1] == 102  # [SEP] survives truncation
    assert outputs["attention_mask"].tolist() == [[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]]


def test_bad_utf8_is_invalid_argument_naming_the_item(tokenizer: Stub) -> None:
    client = tokenizer
    with pytest.raises(grpc.RpcError) as caught:
        client.ModelInfer(
            infer_request("minilm_tokenizer", TEXT=strings("fine", b"\xc3\x28 broken")),
            timeout=30,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "TEXT[1]" in caught.value.details()
    assert "UTF-8" in caught.value.details()
    response = client.ModelInfer(infer_request("minilm_tokenizer", TEXT=strings("still here")))
    assert decode_outputs(response)["input_ids"][0, :4].tolist() == [101, 2145, 2182, 102]


def test_chat_messages_are_rendered_by_the_template_then_encoded(
    tokenizer: Stub,
) -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    client = tokenizer
    response = client.ModelInfer(
        infer_request("chat_tokenizer", MESSAGES=strings(json.dumps(chat))), timeout=30
    )
    rendered = "<system> Be brief.\n<user> Hi there\n<assistant>"
    expected = local_tokenizer().encode(rendered, add_special_tokens=False).ids
    outputs = decode_outputs(response)
    assert outputs["input_ids"][0, : len(expected)].tolist() == expected
    assert int(outputs["attention_mask"].sum()) == len(expected)
    with pytest.raises(grpc.RpcError) as caught:
        client.ModelInfer(
            infer_request("chat_tokenizer", MESSAGES=strings('[{"role": "user"')), timeout=30
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "MESSAGES[0]" in caught.value.details()


# -- preprocess ---------------------------------------------------------------


def test_preprocess_equals_the_local_transform_on_real_photos(
    preprocessor: Stub,
) -> None:
    photos = [sources.sample_image(name).read_bytes() for name in ("coffee.png", "chelsea.png")]
    response = preprocessor.ModelInfer(
        infer_request("imagenet_preprocess", IMAGE=strings(*photos)), timeout=60
    )
    pixels = decode_outputs(response)["PIXELS"]
    assert pixels.shape == (2, 3, 224, 224) and pixels.dtype == np.float32
    for row, photo in enumerate(photos):
        np.testing.assert_array_equal(pixels[row], preprocess(photo))


def test_undecodable_image_is_invalid_argument_naming_image(
    preprocessor: Stub,
) -> None:
    client = preprocessor
    photo = sources.sample_image("coffee.png").read_bytes()
    with pytest.raises(grpc.RpcError) as caught:
        client.ModelInfer(
            infer_request("imagenet_preprocess", IMAGE=strings(photo, b"not an image")),
            timeout=60,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "IMAGE[1]" in caught.value.details()
    assert "decode" in caught.value.details()
    response = client.ModelInfer(infer_request("imagenet_preprocess", IMAGE=strings(photo)))
    assert decode_outputs(response)["PIXELS"].shape == (1, 3, 224, 224)


# -- postprocess --------------------------------------------------------------


def test_classify_returns_the_top_k_labels_and_softmax(postprocessor: Stub) -> None:
    logits = np.array([[0.5, 3.0, -1.0, 2.0, 0.0, 1.0], [4.0, 0, 0, 0, 0, 4.5]], np.float32)
    response = postprocessor.ModelInfer(infer_request("toy_classify", LOGITS=logits), timeout=30)
    outputs = decode_outputs(response)
    assert outputs["LABELS"].tolist() == [
        [b"banana", b"date", b"fig"],
        [b"fig", b"apple", b"banana"],
    ]
    full = np.exp(logits.astype(np.float64))
    full /= full.sum(axis=1, keepdims=True)
    expected = np.sort(full, axis=1)[:, ::-1][:, :3]
    np.testing.assert_allclose(outputs["PROBABILITIES"], expected, rtol=1e-5)
    assert outputs["PROBABILITIES"].dtype == np.float32
    assert np.all(outputs["PROBABILITIES"].sum(axis=1) < 1.0)


def test_embedding_pool_equals_a_numpy_reference(postprocessor: Stub) -> None:
    rng = np.random.default_rng(7)
    tokens = rng.normal(size=(3, 5, 8)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=np.int64)
    response = postprocessor.ModelInfer(
        infer_request("mean_pool", TOKEN_EMBEDDINGS=tokens, ATTENTION_MASK=mask), timeout=30
    )
    embedding = decode_outputs(response)["EMBEDDING"]
    mean = np.stack([tokens[i, mask[i] == 1].mean(axis=0) for i in range(3)])
    expected = mean / np.linalg.norm(mean, axis=1, keepdims=True)
    assert embedding.shape == (3, 8) and embedding.dtype == np.float32
    np.testing.assert_allclose(embedding, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, rtol=1e-6)


# -- every service ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "model", "inputs", "outputs"),
    [
        (
            "tokenizer",
            "minilm_tokenizer",
            [("TEXT", "BYTES", [-1, 1])],
            [
                (name, "INT64", [-1, -1])
                for name in ("input_ids", "attention_mask", "token_type_ids")
            ],
        ),
        (
            "preprocessor",
            "imagenet_preprocess",
            [("IMAGE", "BYTES", [-1, 1])],
            [("PIXELS", "FP32", [-1, 3, 224, 224])],
        ),
        (
            "postprocessor",
            "toy_classify",
            [("LOGITS", "FP32", [-1, 6])],
            [("LABELS", "BYTES", [-1, 3]), ("PROBABILITIES", "FP32", [-1, 3])],
        ),
        (
            "postprocessor",
            "mean_pool",
            [("TOKEN_EMBEDDINGS", "FP32", [-1, -1, 8]), ("ATTENTION_MASK", "INT64", [-1, -1])],
            [("EMBEDDING", "FP32", [-1, 8])],
        ),
    ],
)
def test_model_metadata_lists_the_declared_tensors(
    request: pytest.FixtureRequest,
    fixture: str,
    model: str,
    inputs: list[tuple[str, str, list[int]]],
    outputs: list[tuple[str, str, list[int]]],
) -> None:
    client: Stub = request.getfixturevalue(fixture)
    metadata = client.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=10)
    assert metadata.name == model
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == inputs
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == outputs
