"""TorchServe model archives (.mar) as Triton-layout model folders.

A ``.mar`` is a zip (or a tgz, or with ``--archive-format no-archive`` a plain
folder) holding ``MAR-INF/MANIFEST.json``, the serialized model, the handler
and extra files. The mesh serves it from a model folder of its repository:

    <repository>/<model>/config.pbtxt     backend "torchserve", batching, workers
    <repository>/<model>/torchserve.json  TorchServe's versions -> folders, the default
    <repository>/<model>/<n>/...          one archive's files, unpacked as they are

TorchServe's settings map onto the model config: ``batchSize`` ->
``max_batch_size``, ``maxBatchDelay`` (ms) -> the dynamic batcher's
``max_queue_delay_microseconds``, ``minWorkers`` -> the instance group's
``count``; ``maxWorkers`` and ``responseTimeout`` are kept as parameters. They
come, the first that sets one winning, from registration parameters, the
archive's ``model-config.yaml``, then ``config.properties`` (its ``models``
entry for the model, then its ``default_*`` keys).

No torch and no gRPC here: the converter (``meshserve import-mar``) and the
management API both call this.
"""

from __future__ import annotations

import json
import re
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from shared.errors import FailedPrecondition, InvalidArgument, NotFound

MANIFEST = PurePosixPath("MAR-INF/MANIFEST.json")
BACKEND = "torchserve"
INPUT = "body"
"""The model's one input: the request body, BYTES."""
OUTPUT = "output"
"""The model's one output: what the handler returned for the request, BYTES."""
HEADER_PREFIX = "header:"
"""Request parameters ``header:<name>`` are the HTTP request's headers (lower case)."""
CONTENT_TYPE = "content_type"
"""Response parameter: the answer's content type (the handler's, else by its value)."""
STATUS = "status_code"
"""Response parameter: a status the handler set with ``context.set_response_status``."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MAX_UNPACKED_BYTES = 8 * 1024**3
"""An archive that unpacks to more than this is refused (a zip bomb)."""


@dataclass(frozen=True)
class WorkerSettings:
    """TorchServe's per-model batching and worker settings."""

    batch_size: int = 1
    """Requests the handler gets at once at most (``batchSize``); 1..1024."""
    max_batch_delay_ms: int = 100
    """How long a batch waits to fill (``maxBatchDelay``, ms); 0..600000."""
    min_workers: int = 1
    """Workers (mesh instances) started (``minWorkers`` / ``initial_workers``); 0..64."""
    max_workers: int = 1
    """The most workers a scale may ask for (``maxWorkers``); >= min_workers, <= 64."""
    response_timeout_s: int = 120
    """Seconds a request may wait for its answer (``responseTimeout``); 1..86400."""

    def __post_init__(self) -> None:
        bounds = {
            "batch_size": (1, 1024),
            "max_batch_delay_ms": (0, 600_000),
            "min_workers": (0, 64),
            "max_workers": (1, 64),
            "response_timeout_s": (1, 86_400),
        }
        for key, (low, high) in bounds.items():
            if not low <= getattr(self, key) <= high:
                raise InvalidArgument(f"{key} must be in {low}..{high}, got {getattr(self, key)}")


# TorchServe's names -> ours (model-config.yaml, config.properties' models entry).
_YAML_KEYS = {
    "batchSize": "batch_size",
    "maxBatchDelay": "max_batch_delay_ms",
    "minWorkers": "min_workers",
    "maxWorkers": "max_workers",
    "responseTimeout": "response_timeout_s",
}
# The management API's registration parameters -> ours.
REGISTER_KEYS = {
    "batch_size": "batch_size",
    "max_batch_delay": "max_batch_delay_ms",
    "initial_workers": "min_workers",
    "response_timeout": "response_timeout_s",
}
# config.properties' server-wide defaults -> ours.
_PROPERTIES_KEYS = {
    "default_workers_per_model": "min_workers",
    "default_response_timeout": "response_timeout_s",
}


def _ints(values: Mapping[str, Any], keys: Mapping[str, str], where: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for key, ours in keys.items():
        if key in values and values[key] not in (None, ""):
            try:
                found[ours] = int(values[key])
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"{where}: {key} = {values[key]!r} is not a number") from exc
    return found


def read_properties(path: Path) -> dict[str, str]:
    """A Java ``config.properties`` file as a dict (``key=value`` lines, ``#`` comments)."""
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", "!")) and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def properties_settings(properties: Mapping[str, str], model: str) -> dict[str, int]:
    """The settings ``config.properties`` gives ``model``: its ``models`` entry
    (any version) over the server-wide defaults."""
    found = _ints(properties, _PROPERTIES_KEYS, "config.properties")
    raw = properties.get("models")
    if raw:
        try:
            entries = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"config.properties: models is not JSON: {exc}") from exc
        for version in (entries.get(model) or {}).values():
            found.update(_ints(version, _YAML_KEYS, f"config.properties models.{model}"))
            break
    return found


def read_manifest(folder: Path) -> dict[str, Any]:
    """MAR-INF/MANIFEST.json of an unpacked archive; errors name the file."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise InvalidArgument("not a TorchServe archive: no MAR-INF/MANIFEST.json") from exc
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"MAR-INF/MANIFEST.json is not JSON: {exc}") from exc
    model = manifest.get("model") if isinstance(manifest, dict) else None
    if not isinstance(model, dict) or not model.get("handler"):
        raise InvalidArgument("MAR-INF/MANIFEST.json names no model.handler")
    return dict(manifest)


def yaml_settings(folder: Path, manifest: Mapping[str, Any]) -> dict[str, int]:
    """The settings of the archive's model-config.yaml (none when it has none)."""
    name = manifest["model"].get("configFile")
    if not name:
        return {}
    path = _inside(folder, str(name), "model.configFile")
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"model-config file {name!r} cannot be read: {exc}") from exc
    return _ints(document if isinstance(document, dict) else {}, _YAML_KEYS, str(name))


def merged_settings(*layers: Mapping[str, int]) -> WorkerSettings:
    """WorkerSettings from layers of values, the first layer that sets a key winning."""
    values: dict[str, int] = {}
    for layer in reversed(layers):
        values.update(layer)
    settings = WorkerSettings(**{k: v for k, v in values.items() if k != "max_workers"})
    return replace(settings, max_workers=max(values.get("max_workers", 1), settings.min_workers))


def _inside(folder: Path, name: str, what: str) -> Path:
    path = (folder / name).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise InvalidArgument(f"{what} {name!r} points outside the archive")
    return path


def model_config_text(name: str, settings: WorkerSettings) -> str:
    """config.pbtxt of a served archive."""
    lines = [
        f'name: "{name}"',
        f'backend: "{BACKEND}"',
        f"max_batch_size: {settings.batch_size}",
        f'input [ {{ name: "{INPUT}" data_type: TYPE_STRING dims: [ 1 ] }} ]',
        f'output [ {{ name: "{OUTPUT}" data_type: TYPE_STRING dims: [ 1 ] }} ]',
        f"instance_group [ {{ count: {max(settings.min_workers, 1)} kind: KIND_CPU }} ]",
        "version_policy { all { } }",
    ]
    if settings.batch_size > 1:
        delay_us = settings.max_batch_delay_ms * 1000
        lines.append(
            f"dynamic_batching {{ preferred_batch_size: [ {settings.batch_size} ] "
            f"max_queue_delay_microseconds: {delay_us} }}"
        )
    for f in fields(settings):
        value = getattr(settings, f.name)
        lines.append(f'parameters {{ key: "{f.name}" value {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def settings_of(config: Any) -> WorkerSettings:
    """The WorkerSettings a model config (as written above) carries."""
    values = {key: int(v.string_value) for key, v in config.parameters.items()}
    known = {f.name for f in fields(WorkerSettings)}
    return WorkerSettings(**{k: v for k, v in values.items() if k in known})


def unpack(archive: Path, target: Path) -> None:
    """The archive's files into ``target`` (a zip, a tgz or a folder); members
    that would land outside it, links and oversized contents are refused."""
    if archive.is_dir():
        shutil.copytree(archive, target, symlinks=False)
        return
    target.mkdir(parents=True)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zipped:
            members = zipped.infolist()
            _check_members([(m.filename, m.file_size) for m in members], target)
            zipped.extractall(target)
        return
    if tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tarred:
            tar_members = tarred.getmembers()
            if any(not (m.isfile() or m.isdir()) for m in tar_members):
                raise InvalidArgument(f"{archive.name}: links and devices are not accepted")
            _check_members([(m.name, m.size) for m in tar_members], target)
            tarred.extractall(target, filter="data")
        return
    raise InvalidArgument(f"{archive.name}: not a zip or tgz archive")


def _check_members(members: list[tuple[str, int]], target: Path) -> None:
    if sum(size for _, size in members) > MAX_UNPACKED_BYTES:
        raise InvalidArgument(f"archive unpacks to more than {MAX_UNPACKED_BYTES} bytes")
    for name, _ in members:
        _inside(target, name, "archive member")


def model_name(archive: Path) -> str:
    """The name TorchServe registers an archive under when its manifest names none:
    the file name without .mar."""
    return archive.name.removesuffix(".mar").removesuffix(".tar.gz").removesuffix(".tgz")


RECORD = "torchserve.json"
"""Per model folder: TorchServe's versions -> version folders, the default, the URLs."""


def read_record(folder: Path) -> dict[str, Any]:
    """The model folder's registration record (empty for a folder without one)."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"versions": {}, "default": ""}
    return dict(record)


def write_record(folder: Path, record: Mapping[str, Any]) -> None:
    """Replace the record whole (written beside it, then renamed)."""
    staged = folder / f".{RECORD}.new"
    staged.write_text(json.dumps(record, indent=1, sort_keys=True))
    staged.replace(folder / RECORD)


@dataclass(frozen=True)
class Imported:
    """What an import wrote."""

    name: str
    version: str
    """TorchServe's version of the archive (the manifest's modelVersion)."""
    folder: int
    """The version folder it went into."""
    settings: WorkerSettings


def import_archive(
    archive: Path,
    repository: Path,
    name: str | None = None,
    overrides: Mapping[str, int] | None = None,
    properties: Mapping[str, str] | None = None,
) -> Imported:
    """Write ``archive`` into ``repository``: a new model folder, or a new version
    folder of a model registered before under another version. A version folder
    appears whole or not at all (built beside it, then renamed)."""
    if not archive.exists():
        raise NotFound(f"model archive {archive.name!r} not found")
    repository.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".mar-", dir=repository) as tmp:
        staging = Path(tmp) / "version"
        unpack(archive, staging)
        manifest = read_manifest(staging)
        chosen = name or manifest["model"].get("modelName") or model_name(archive)
        if not NAME_PATTERN.match(chosen):
            raise InvalidArgument(f"model name {chosen!r} must match {NAME_PATTERN.pattern}")
        version = str(manifest["model"].get("modelVersion") or "1.0")
        folder = repository / chosen
        record = read_record(folder)
        if folder.exists() and not record["versions"]:
            raise FailedPrecondition(f"model {chosen!r} is already in the repository")
        if version in record["versions"]:
            raise FailedPrecondition(
                f"Model version {version} is already registered for model {chosen}"
            )
        settings = merged_settings(
            overrides or {},
            yaml_settings(staging, manifest),
            properties_settings(properties or {}, chosen),
        )
        numbers = [int(v["folder"]) for v in record["versions"].values()]
        number = max(numbers, default=0) + 1
        folder.mkdir(exist_ok=True)
        staging.rename(folder / str(number))
    record["versions"][version] = {"folder": number, "url": archive.name}
    record["default"] = record["default"] or version
    write_record(folder, record)
    write_settings(folder, settings)
    return Imported(chosen, version, number, settings)


def write_settings(folder: Path, settings: WorkerSettings) -> None:
    """Rewrite a served archive's config.pbtxt with new settings (a scale)."""
    text = model_config_text(folder.name, settings)
    staged = folder / ".config.pbtxt.new"
    staged.write_text(text)
    staged.replace(folder / "config.pbtxt")
