"""Edge cases of the stage backends, called directly (no sockets, no batcher).

Each test builds a ModelSpec from a config written inline, creates one instance
as the model manager would, and runs ``execute`` on a list of requests.
"""

from __future__ import annotations

import asyncio
import gc
import io
import shutil
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from PIL import Image
from tokenizers import Tokenizer

from inference import model_config_pb2 as mc
from models import sources
from services.inference.onnx import OnnxBackend
from services.postprocess.classify import ClassifyBackend, softmax_top_k, top_k_indices
from services.postprocess.pool import EmbeddingPoolBackend
from services.preprocess.backend import ImagePreprocessBackend
from services.preprocess.transform import TransformConfig, decode_rgb, preprocess
from services.tokenizer.backend import TokenizerBackend, parse_messages
from shared.backend import InstanceSpec, ModelSpec, config_parameters
from shared.errors import ConfigError, InvalidArgument
from shared.instances import ThreadedInstance
from shared.request import InferRequest, InferResponse
from shared.statistics import StatsRecorder
from tests.conftest import affine_onnx

INSTANCE = InstanceSpec(name="m_0", kind="KIND_CPU", device="cpu", intra_op_threads=1)


def make_spec(folder: Path, config_text: str) -> ModelSpec:
    """A model folder ``folder`` with version 1, and its spec."""
    config = mc.ModelConfig()
    text_format.Parse(config_text, config)
    (folder / "1").mkdir(parents=True, exist_ok=True)
    return ModelSpec(
        name=config.name or "m",
        version=1,
        path=folder / "1",
        config=config,
        parameters=config_parameters(config),
    )


def params(**values: Any) -> str:
    return "\n".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        for key, value in values.items()
    )


def request(**inputs: np.ndarray) -> InferRequest:
    return InferRequest(model_name="m", model_version="1", inputs=inputs)


def strings(*items: bytes) -> np.ndarray:
    """A batched TYPE_STRING tensor ``[len(items), 1]``."""
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = list(items)
    return array


def ok(result: InferResponse | Exception) -> dict[str, np.ndarray]:
    assert isinstance(result, InferResponse), result
    return result.outputs


# -- embedding_pool -----------------------------------------------------------

POOL_CONFIG = """
name: "pool" backend: "embedding_pool" max_batch_size: 8
input [ { name: "TOKEN_EMBEDDINGS" data_type: TYPE_FP32 dims: [ -1, 4 ] },
        { name: "ATTENTION_MASK" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def pool_request(rows: int, length: int, seed: int) -> InferRequest:
    rng = np.random.default_rng(seed)
    mask = (rng.random((rows, length)) < 0.7).astype(np.int64)
    mask[:, 0] = 1
    return request(
        TOKEN_EMBEDDINGS=rng.normal(size=(rows, length, 4)).astype(np.float32),
        ATTENTION_MASK=mask,
    )


def test_pool_all_zero_mask_row_is_the_zero_vector_not_nan(tmp_path: Path) -> None:
    instance = EmbeddingPoolBackend().create_instance(make_spec(tmp_path, POOL_CONFIG), INSTANCE)
    embeddings = np.ones((2, 3, 4), dtype=np.float32)
    mask = np.array([[0, 0, 0], [1, 1, 0]], dtype=np.int64)
    (result,) = instance.execute([request(TOKEN_EMBEDDINGS=embeddings, ATTENTION_MASK=mask)])
    pooled = ok(result)["EMBEDDING"]
    assert pooled.dtype == np.float32 and pooled.shape == (2, 4)
    np.testing.assert_array_equal(pooled[0], np.zeros(4))
    np.testing.assert_allclose(pooled[1], np.full(4, 0.5), rtol=1e-6)  # unit norm of ones(4)


def test_pool_mixed_lengths_in_one_batch_equal_one_at_a_time(tmp_path: Path) -> None:
    instance = EmbeddingPoolBackend().create_instance(make_spec(tmp_path, POOL_CONFIG), INSTANCE)
    requests = [pool_request(2, 5, 0), pool_request(1, 9, 1), pool_request(3, 5, 2)]
    together = [ok(r)["EMBEDDING"] for r in instance.execute(requests)]
    alone = [ok(instance.execute([r])[0])["EMBEDDING"] for r in requests]
    for joint, single, req in zip(together, alone, requests, strict=True):
        assert joint.shape == (len(req.inputs["ATTENTION_MASK"]), 4)
        np.testing.assert_allclose(joint, single, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.linalg.norm(joint, axis=1), 1.0, rtol=1e-6)


def test_pool_mismatched_mask_fails_only_its_request(tmp_path: Path) -> None:
    instance = EmbeddingPoolBackend().create_instance(make_spec(tmp_path, POOL_CONFIG), INSTANCE)
    bad = request(
        TOKEN_EMBEDDINGS=np.zeros((1, 5, 4), dtype=np.float32),
        ATTENTION_MASK=np.ones((1, 6), dtype=np.int64),
    )
    good, failed = instance.execute([pool_request(1, 5, 3), bad])
    assert ok(good)["EMBEDDING"].shape == (1, 4)
    assert isinstance(failed, InvalidArgument)
    assert "ATTENTION_MASK" in str(failed) and "[1, 6]" in str(failed)


def test_pool_without_normalize_is_the_plain_masked_mean(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, POOL_CONFIG + params(normalize="false"))
    instance = EmbeddingPoolBackend().create_instance(spec, INSTANCE)
    embeddings = np.arange(12, dtype=np.float32).reshape(1, 3, 4)
    mask = np.array([[1, 0, 1]], dtype=np.int64)
    (result,) = instance.execute([request(TOKEN_EMBEDDINGS=embeddings, ATTENTION_MASK=mask)])
    np.testing.assert_allclose(ok(result)["EMBEDDING"], [[4.0, 5.0, 6.0, 7.0]])


def test_pool_output_dims_must_match_the_embedding_width(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, POOL_CONFIG.replace("dims: [ 4 ]", "dims: [ 5 ]"))
    with pytest.raises(ConfigError, match="EMBEDDING"):
        EmbeddingPoolBackend().create_instance(spec, INSTANCE)


# -- classify -----------------------------------------------------------------

CLASSIFY_CONFIG = """
name: "cls" backend: "classify" max_batch_size: 8
input [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "LABELS" data_type: TYPE_STRING dims: [ 3 ] label_filename: "labels.txt" },
         { name: "PROBABILITIES" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""


def classify_model(folder: Path, config: str = CLASSIFY_CONFIG, top_k: int = 3) -> ModelSpec:
    spec = make_spec(folder, config + params(top_k=top_k))
    (folder / "labels.txt").write_text("ant\nbee\ncat\ndog\n")
    return spec


def test_classify_top_k_larger_than_the_classes_is_a_config_error(tmp_path: Path) -> None:
    config = CLASSIFY_CONFIG.replace("dims: [ 3 ]", "dims: [ 5 ]")
    with pytest.raises(ConfigError, match="top_k = 5 exceeds the 4 classes"):
        ClassifyBackend().create_instance(classify_model(tmp_path, config, 5), INSTANCE)


def test_classify_labels_file_missing_or_mismatched_is_a_config_error(tmp_path: Path) -> None:
    spec = classify_model(tmp_path)
    (tmp_path / "labels.txt").unlink()
    with pytest.raises(ConfigError, match="labels.txt"):
        ClassifyBackend().create_instance(spec, INSTANCE)
    (tmp_path / "labels.txt").write_text("ant\nbee\ncat\n")
    with pytest.raises(ConfigError, match="4 classes, but the labels file has 3"):
        ClassifyBackend().create_instance(spec, INSTANCE)


def test_classify_orders_best_first_and_breaks_ties_by_class_index(tmp_path: Path) -> None:
    instance = ClassifyBackend().create_instance(classify_model(tmp_path), INSTANCE)
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 5.0]], dtype=np.float32)
    (result,) = instance.execute([request(LOGITS=logits)])
    outputs = ok(result)
    assert outputs["LABELS"].tolist() == [[b"bee", b"cat", b"ant"], [b"dog", b"ant", b"bee"]]
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    softmax = exp / exp.sum(axis=1, keepdims=True)
    expected = np.take_along_axis(softmax, np.array([[1, 2, 0], [3, 0, 1]]), axis=1)
    np.testing.assert_allclose(outputs["PROBABILITIES"], expected, rtol=1e-6)


def test_softmax_top_k_with_k_equal_to_n_returns_every_class_sorted() -> None:
    indices, probabilities = softmax_top_k(np.array([[0.0, 2.0, 1.0]], dtype=np.float32), 3)
    assert indices.tolist() == [[1, 2, 0]]
    assert probabilities.sum() == pytest.approx(1.0, rel=1e-6)


def test_top_k_breaks_ties_at_the_kth_place_by_index_and_ranks_nan_last() -> None:
    scores = np.array([[0.0, 1.0, 1.0, 1.0, 2.0], [np.nan, 0.5, 0.1, 0.5, 0.0]], np.float32)
    assert top_k_indices(scores, 3).tolist() == [[4, 1, 2], [1, 3, 2]]


def test_classify_unbatched_model_answers_k_labels(tmp_path: Path) -> None:
    spec = classify_model(tmp_path, CLASSIFY_CONFIG.replace("max_batch_size: 8", ""))
    instance = ClassifyBackend().create_instance(spec, INSTANCE)
    (result,) = instance.execute([request(LOGITS=np.array([0, 0, 9, 0], dtype=np.float32))])
    assert ok(result)["LABELS"].tolist() == [b"cat", b"ant", b"bee"]


# -- tokenizer ----------------------------------------------------------------

TOKENIZER_CONFIG = """
name: "tok" backend: "tokenizer" max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
         { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] } ]
"""


def tokenizer_model(folder: Path, extra: str = "") -> ModelSpec:
    spec = make_spec(folder, TOKENIZER_CONFIG + extra)
    shutil.copy(sources.minilm_file("tokenizer.json"), spec.path / "tokenizer.json")
    return spec


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (params(pad_to_multiple_of=0), "'pad_to_multiple_of' must be in 1..4096"),
        (params(max_length="long"), "'max_length' = 'long' is not a int"),
    ],
)
def test_tokenizer_bad_parameter_is_a_config_error(
    tmp_path: Path, extra: str, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        TokenizerBackend().create_instance(tokenizer_model(tmp_path, extra), INSTANCE)


def test_tokenizer_without_tokenizer_json_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        TokenizerBackend().create_instance(make_spec(tmp_path, TOKENIZER_CONFIG), INSTANCE)


def test_tokenizer_padding_never_exceeds_max_length(tmp_path: Path) -> None:
    spec = tokenizer_model(tmp_path, params(max_length=10, pad_to_multiple_of=16))
    instance = TokenizerBackend().create_instance(spec, INSTANCE)
    (result,) = instance.execute(
        [request(TEXT=strings(b"hi", b"one two three four five six seven eight nine ten"))]
    )
    outputs = ok(result)
    assert outputs["input_ids"].shape == (2, 10)  # 16 would pass the model's positions
    assert outputs["attention_mask"].sum(axis=1).tolist() == [3, 10]
    assert outputs["input_ids"][1, -1] == 102  # truncation keeps [SEP]


def test_tokenizer_bad_utf8_fails_only_its_request_in_a_batch(tmp_path: Path) -> None:
    instance = TokenizerBackend().create_instance(tokenizer_model(tmp_path), INSTANCE)
    results = instance.execute(
        [
            request(TEXT=strings(b"fine")),
            request(TEXT=strings(b"also fine", b"caf\xe9")),
            request(TEXT=strings(b"")),
        ]
    )
    assert ok(results[0])["input_ids"][0, :3].tolist() == [101, 2986, 102]
    assert isinstance(results[1], InvalidArgument)
    assert "TEXT[1]" in str(results[1]) and "UTF-8" in str(results[1])
    empty = ok(results[2])
    assert empty["input_ids"].shape == (1, 16)
    assert empty["attention_mask"][0].tolist() == [1, 1] + [0] * 14  # [CLS] [SEP]


@pytest.mark.parametrize(
    ("chat", "problem"),
    [
        (b'[{"role": "user", "content": "\\udcff"}]', "surrogate"),
        (b"[" * 3000 + b"]" * 3000, "recursion limit"),
        (b'[{"role": "user", "content": "hi"}', "EOF"),
        (b"[]", "non-empty"),
        (b'[{"role": "user"}]', "message 0"),
    ],
)
def test_chat_messages_that_are_not_a_chat_are_invalid_naming_the_tensor(
    chat: bytes, problem: str
) -> None:
    with pytest.raises(InvalidArgument, match=problem) as caught:
        parse_messages(chat, "MESSAGES[0]")
    assert "MESSAGES[0]" in str(caught.value)


def test_chat_messages_take_an_escaped_surrogate_pair_as_one_character() -> None:
    pair = parse_messages(b'[{"role": "user", "content": "\\ud83d\\ude00"}]', "MESSAGES[0]")
    assert pair == [{"role": "user", "content": "\U0001f600"}]


def test_tokenizer_answers_only_the_requested_outputs(tmp_path: Path) -> None:
    instance = TokenizerBackend().create_instance(tokenizer_model(tmp_path), INSTANCE)
    req = request(TEXT=strings(b"hello"))
    req.requested_outputs = ["attention_mask"]
    (result,) = instance.execute([req])
    assert list(ok(result)) == ["attention_mask"]


# -- onnxruntime --------------------------------------------------------------

AFFINE_CONFIG = """
name: "affine" backend: "onnxruntime" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def affine_model(folder: Path, scale: float) -> ModelSpec:
    """Y = X * scale + 1, as model.onnx in a version folder."""
    spec = make_spec(folder, AFFINE_CONFIG)
    affine_onnx(spec.path / "model.onnx", scale)
    return spec


def test_onnx_cpu_instances_with_one_thread_share_one_session(tmp_path: Path) -> None:
    spec = affine_model(tmp_path, 2.0)
    backend = OnnxBackend()
    first, second = (backend.create_instance(spec, INSTANCE) for _ in range(2))
    wider = backend.create_instance(spec, replace(INSTANCE, intra_op_threads=2))
    assert first.session is second.session
    assert wider.session is not first.session  # its thread pool is its own

    def answers(instance: Any, value: float) -> list[float]:
        outputs = []
        for _ in range(200):
            (result,) = instance.execute([request(X=np.full((3, 4), value, dtype=np.float32))])
            outputs += np.unique(ok(result)["Y"]).tolist()
        return sorted(set(outputs))

    # Both instances' threads run the one session at once, each with its own data.
    with ThreadPoolExecutor(max_workers=2) as pool:
        a, b = pool.map(answers, (first, second), (1.0, 10.0))
    assert (a, b) == ([3.0], [21.0])
    assert answers(wider, 1.0) == [3.0]

    held = weakref.ref(first.session)
    del first, second
    gc.collect()
    assert held() is None  # released with the last instance that held it


@pytest.mark.parametrize(("share", "threads", "shared"), [("false", 1, False), ("true", 2, True)])
def test_onnx_share_session_between_instances_as_configured(
    tmp_path: Path, share: str, threads: int, shared: bool
) -> None:
    spec = affine_model(tmp_path, 2.0)
    spec = replace(spec, parameters={"share_session_between_instances": share})
    instance = replace(INSTANCE, intra_op_threads=threads)
    first, second = (OnnxBackend().create_instance(spec, instance) for _ in range(2))
    assert (first.session is second.session) == shared


def test_onnx_a_reload_gets_its_own_session(tmp_path: Path) -> None:
    backend = OnnxBackend()
    old = backend.create_instance(affine_model(tmp_path, 2.0), INSTANCE)
    # The file changed and the version loads again while the old instance serves.
    spec = affine_model(tmp_path, 3.0)
    new = backend.create_instance(spec, INSTANCE)
    assert new.session is not old.session
    (result,) = new.execute([request(X=np.ones((1, 4), dtype=np.float32))])
    assert ok(result)["Y"].tolist() == [[4.0] * 4]
    (result,) = old.execute([request(X=np.ones((1, 4), dtype=np.float32))])
    assert ok(result)["Y"].tolist() == [[3.0] * 4]


# -- image_preprocess ---------------------------------------------------------

PREPROCESS_CONFIG = """
name: "img" backend: "image_preprocess" max_batch_size: 8
input [ { name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "PIXELS" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
"""


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_preprocess_bad_item_fails_its_request_naming_the_item(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, PREPROCESS_CONFIG + params(resize=40, crop=32))
    instance = ImagePreprocessBackend().create_instance(spec, INSTANCE)
    good, bad = instance.execute(
        [request(IMAGE=strings(png(50, 40))), request(IMAGE=strings(png(40, 40), b"junk"))]
    )
    expected = preprocess(png(50, 40), TransformConfig(resize_short_side=40, crop_size=32))
    np.testing.assert_array_equal(ok(good)["PIXELS"], expected[None])
    assert isinstance(bad, InvalidArgument)
    assert "IMAGE[1]" in str(bad) and "decode" in str(bad)


def test_preprocess_turns_photos_upright_and_any_mode_into_rgb() -> None:
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[:, :20] = (255, 0, 0)  # left half red, right half blue
    pixels[:, 20:] = (0, 0, 255)
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the camera was turned; rotate 90 degrees clockwise
    Image.fromarray(pixels).save(buffer, format="PNG", exif=exif)
    upright = decode_rgb(buffer.getvalue())
    assert upright.mode == "RGB" and upright.size == (20, 40)
    top, bottom = np.asarray(upright)[0, 10], np.asarray(upright)[-1, 10]
    assert top.tolist() == [255, 0, 0] and bottom.tolist() == [0, 0, 255]

    for mode in ("L", "P", "RGBA", "CMYK"):
        buffer = io.BytesIO()
        Image.fromarray(pixels).convert(mode).save(buffer, format="TIFF")
        assert decode_rgb(buffer.getvalue()).mode == "RGB", mode


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (params(crop=48, resize=64), r"PIXELS.*\[3, 48, 48\]"),
        (params(crop=32, mean="0.5,0.5"), "3 comma-separated values"),
        (params(crop=32, std="1,0,1"), "std values must be > 0"),
    ],
)
def test_preprocess_bad_settings_are_config_errors(
    tmp_path: Path, extra: str, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ImagePreprocessBackend().create_instance(
            make_spec(tmp_path, PREPROCESS_CONFIG + extra), INSTANCE
        )


def test_tokenizer_runs_short_texts_inline_and_long_ones_in_its_thread(tmp_path: Path) -> None:
    instance = TokenizerBackend().create_instance(tokenizer_model(tmp_path), INSTANCE)
    assert instance.runs_inline([request(TEXT=strings(b"a short prompt"))])
    assert not instance.runs_inline([request(TEXT=strings(b"x" * 2000))])
    # Many short requests add up.
    assert not instance.runs_inline([request(TEXT=strings(b"y" * 300)) for _ in range(4)])
    # A malformed element (execute reports it) does not count as cheap.
    assert not instance.runs_inline([request(TEXT=np.array([7], dtype=object))])


def test_tokenizer_encodes_short_and_long_batches_alike(tmp_path: Path) -> None:
    # Short texts are encoded one at a time, a batch past INLINE_BYTES in one
    # encode_batch: both must give each row what the tokenizer gives that text.
    instance = TokenizerBackend().create_instance(tokenizer_model(tmp_path), INSTANCE)
    reference = Tokenizer.from_file(str(sources.minilm_file("tokenizer.json")))
    reference.no_padding()  # the file pads and truncates to 128; the instance does neither
    reference.no_truncation()
    texts = [b"hello world", b"The quick brown fox.", b"caf\xc3\xa9 au lait"]
    for extra in ([], [b"a long one " * 100]):  # the second batch passes INLINE_BYTES
        batch = [*texts, *extra]
        (result,) = instance.execute([request(TEXT=strings(*batch))])
        outputs = ok(result)
        for row, text in enumerate(batch):
            ids = reference.encode(text.decode()).ids
            assert outputs["input_ids"][row, : len(ids)].tolist() == ids
            assert outputs["attention_mask"][row].sum() == len(ids)


class _Recorder:
    """A backend instance that says which thread ran each batch."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def runs_inline(self, requests: list[InferRequest]) -> bool:
        return all(r.inputs["X"].size <= 4 for r in requests)

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        self.threads.append(threading.get_ident())
        return [InferResponse(outputs={"Y": r.inputs["X"] * 2}) for r in requests]

    def close(self) -> None:
        """Nothing held."""


def test_a_quick_instance_runs_cheap_batches_on_the_loop_and_the_rest_in_its_thread() -> None:
    recorder = _Recorder()
    executor = ThreadPoolExecutor(1)
    threaded = ThreadedInstance(INSTANCE, recorder, executor, StatsRecorder("m", "1", None), False)

    async def main() -> tuple[int, list[Any]]:
        small = await threaded.execute([request(X=np.arange(3))])
        large = await threaded.execute([request(X=np.arange(10))])
        return threading.get_ident(), [small, large]

    try:
        loop_thread, (small, large) = asyncio.run(main())
    finally:
        executor.shutdown()
    assert ok(small[0])["Y"].tolist() == [0, 2, 4]
    assert ok(large[0])["Y"].tolist() == list(range(0, 20, 2))
    assert recorder.threads[0] == loop_thread
    assert recorder.threads[1] != loop_thread
