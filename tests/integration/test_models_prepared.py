"""The prepared model repository serves real, correct models.

``models.prepare`` builds the default repository from model wheels; these tests
load what it wrote the way a backend would (TorchScript, ONNX Runtime, the
labels file) and check answers a user would notice: a photo of an espresso is
an espresso, the ONNX copy agrees with the TorchScript one at any batch size,
and preparing twice costs nothing. The repository lives in the default cache
(``$MESHSERVE_CACHE`` or ``~/.cache/meshserve``), so only the first run of a
machine pays for the build; tests of rebuilding use a temporary cache.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from models import sources
from models.export import load_torchscript
from models.mlp import IN_FEATURES, build_mlp
from models.prepare import STAMP_FILE, default_cache, prepare_repository
from services.preprocess.transform import preprocess
from shared.errors import InvalidArgument

CAT_CLASSES = {"tabby", "tiger cat", "Egyptian cat"}
VISION_MODELS = ("mobilenet_v2", "mobilenet_v2_onnx")


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
