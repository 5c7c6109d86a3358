"""Build the default model repository (Triton layout) in a cache folder.

    python -m models.prepare [--cache DIR] [--force] [--model NAME ...]

The cache defaults to ``$MESHSERVE_CACHE`` or ``~/.cache/meshserve``; models go
to ``<cache>/repository/<model>/`` (``config.pbtxt``, ``labels.txt`` where there
are labels, and version folder ``1/``). A model is rebuilt only when its folder
is incomplete or its fingerprint changed: the fingerprint covers the weights,
labels, config text, model source code and exporter versions, so a warm run
hashes a few files and never imports torch. Each model is built in
``<cache>/staging/`` and renamed into place, so a reader never sees a half-written
folder, and a lock file serialises concurrent runs (parallel test workers).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
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

from models import sources

# Bump when a build step changes in a way the fingerprinted inputs do not show.
RECIPE_VERSION = 1
STAMP_FILE = ".meshserve-stamp.json"
LABELS_FILE = "labels.txt"
_CODE_DIR = Path(__file__).resolve().parent

Echo = Callable[[str], None]

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
}}
instance_group [
  {{
    count: 1
    kind: KIND_CPU
  }}
]
"""


@dataclass(frozen=True)
class Recipe:
    """How to build one model folder, and what its fingerprint covers."""

    name: str
    """Folder name in the repository, and the model's name in config.pbtxt."""
    config: str
    """config.pbtxt text (Triton ModelConfig, protobuf text format)."""
    model_file: str
    """File written into version folder ``1/``."""
    writer: str
    """Function in ``models.export`` that writes ``model_file`` into a version folder."""
    code: tuple[str, ...]
    """Files in ``models/`` whose source shapes the model."""
    packages: tuple[str, ...] = ("torch",)
    """Distributions whose versions shape the serialised file."""
    labelled: bool = False
    """Whether the folder carries ImageNet ``labels.txt`` (and the weights checkpoint)."""


RECIPES: tuple[Recipe, ...] = (
    Recipe("mlp", MLP_CONFIG, "model.pt", "write_mlp_torchscript", ("mlp.py", "export.py")),
    Recipe(
        "mobilenet_v2",
        _MOBILENET_CONFIG.format(name="mobilenet_v2", backend="pytorch"),
        "model.pt",
        "write_mobilenet_v2_torchscript",
        ("mobilenet_v2.py", "export.py"),
        labelled=True,
    ),
    Recipe(
        "mobilenet_v2_onnx",
        _MOBILENET_CONFIG.format(name="mobilenet_v2_onnx", backend="onnxruntime"),
        "model.onnx",
        "write_mobilenet_v2_onnx",
        ("mobilenet_v2.py", "export.py"),
        packages=("torch", "onnx"),
        labelled=True,
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
    """Build, or confirm up to date, the models in ``<cache>/repository``; return that path."""
    recipes = _select(models)
    repository = cache / "repository"
    staging = cache / "staging"
    repository.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with _exclusive(cache / ".prepare.lock", echo):
        # Holding the lock, anything left in staging/ is debris from a killed run.
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        stale = _plan(recipes, repository, force, echo)
        writers = _load_writers(echo) if stale else {}
        for step, (recipe, fingerprint) in enumerate(stale, start=1):
            echo(f"[{step}/{len(stale)}] {recipe.name}: building 1/{recipe.model_file}")
            built_in = time.perf_counter()
            folder = _build(recipe, staging, fingerprint, writers[recipe.writer])
            _install(folder, repository / recipe.name, staging)
            echo(f"[{step}/{len(stale)}] {recipe.name}: built in {_since(built_in)}")
    echo(f"repository ready at {repository} ({_since(started)})")
    return repository


def _plan(
    recipes: Sequence[Recipe], repository: Path, force: bool, echo: Echo
) -> list[tuple[Recipe, dict[str, object]]]:
    """The recipes whose folders must be (re)built, each with its fingerprint."""
    stale = []
    for recipe in recipes:
        fingerprint = _fingerprint(recipe)
        if not force and _is_current(repository / recipe.name, fingerprint):
            echo(f"{recipe.name}: up to date")
        else:
            stale.append((recipe, fingerprint))
    return stale


def _load_writers(echo: Echo) -> dict[str, Callable[[Path], Path]]:
    """The writer functions of ``models.export``, imported only when something is stale."""
    started = time.perf_counter()
    # Deferred: torch takes ~3 s to import, and a warm run (every test session,
    # every `make run`) should cost milliseconds.
    from models import export

    echo(f"imported torch and the exporters ({_since(started)})")
    return {recipe.writer: getattr(export, recipe.writer) for recipe in RECIPES}


def _since(started: float) -> str:
    return f"{time.perf_counter() - started:.1f} s"


def _select(models: Sequence[str] | None) -> tuple[Recipe, ...]:
    if models is None:
        return RECIPES
    known = {recipe.name: recipe for recipe in RECIPES}
    unknown = sorted(set(models) - known.keys())
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {sorted(known)}")
    return tuple(known[name] for name in dict.fromkeys(models))


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


def _fingerprint(recipe: Recipe) -> dict[str, object]:
    """Everything a model folder is made from, hashed: equal fingerprints, equal folders."""
    inputs: dict[str, object] = {
        "recipe": RECIPE_VERSION,
        "config": _sha256(recipe.config.encode()),
        "code": {name: sources.file_sha256(_CODE_DIR / name) for name in recipe.code},
        "versions": {name: importlib.metadata.version(name) for name in recipe.packages},
    }
    if recipe.labelled:
        weights = sources.package_file(sources.WEIGHTS_PACKAGE, sources.WEIGHTS_FILE)
        inputs["weights"] = sources.file_sha256(weights)
        inputs["labels"] = _sha256(_labels_text().encode())
    digest = _sha256(json.dumps(inputs, sort_keys=True).encode())
    return {"digest": digest, "inputs": inputs}


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
    writer: Callable[[Path], Path],
) -> Path:
    """Write the whole model folder under ``staging``; the stamp goes last."""
    folder = Path(tempfile.mkdtemp(prefix=f"{recipe.name}-", dir=staging))
    try:
        (folder / "config.pbtxt").write_text(recipe.config, encoding="utf-8")
        if recipe.labelled:
            (folder / LABELS_FILE).write_text(_labels_text(), encoding="utf-8")
        version_dir = folder / "1"
        version_dir.mkdir()
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
