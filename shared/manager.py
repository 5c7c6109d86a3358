"""Model management: which versions are loaded, loading, reloading, unloading.

A (re)load builds the new versions beside the serving ones and swaps them in
only once they are ready, so a reload never fails a request; the versions it
replaces then drain their queues before they are released. Loads and unloads
of one model are serialised by a per-model lock.

A model that cannot load (a bad config.pbtxt, model code that raises, a
missing import) is that model's problem: it is UNAVAILABLE with its error (in
the index, the log and the metrics) and every other model still loads, so one
model's fault never takes its stage down. Errors use Triton's words ("Request
for unknown model", "failed to load") first, for clients that match on them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from google.protobuf import json_format

from inference import model_config_pb2 as mc
from shared import gc_heap
from shared.backend import (
    Backend,
    CompletingBackend,
    LoopBackend,
    ModelSpec,
    config_parameters,
)
from shared.errors import ConfigError, InvalidArgument, MeshError, NotFound, Unavailable
from shared.model import ModelVersion
from shared.queue_bounds import DEFAULTS, QueueDefaults
from shared.repository import (
    CONFIG_FILE,
    ModelEntry,
    ModelRepository,
    safe_text,
    validate_config,
)
from shared.statistics import Metrics

log = logging.getLogger(__name__)

REASON_CHARS = 1000
"""A load error is cut to this many characters in the index and in answers."""


@dataclass(frozen=True)
class IndexEntry:
    """One row of RepositoryIndex."""

    name: str
    version: str
    state: str
    reason: str


class ModelManager:
    """Owns every loaded ModelVersion of one service."""

    def __init__(
        self,
        repository: ModelRepository,
        backends: Mapping[str, Backend],
        metrics: Metrics | None = None,
        queue_defaults: QueueDefaults = DEFAULTS,
    ) -> None:
        self.repository = repository
        self.backends = dict(backends)
        self.metrics = metrics
        self.queue_defaults = queue_defaults
        """Queue bounds for the models whose config sets none."""
        self._versions: dict[str, dict[int, ModelVersion]] = {}
        self._failed: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.starting = False
        """True from the service's start until its start-up loads are done: a model it
        hosts but has not loaded yet is then UNAVAILABLE (loading), not unknown."""

    def hosts(self, config: mc.ModelConfig) -> bool:
        """True when one of this service's backends runs the model."""
        backend = self._backend(config.backend or config.platform)
        if isinstance(backend, LoopBackend):
            return backend.claims(config)
        return backend is not None

    def hosts_name(self, name: str) -> bool:
        """True when this service hosts the model folder ``name``; a config too
        broken to name its backend may be any service's, so each one claims it
        (and shows its error); a LoopBackend claims only what it can run."""
        try:
            return self.hosts(self.repository.config(name))
        except ConfigError:
            declared = self.repository.declared_backend(name)
            if declared is None:
                return True
            backend = self._backend(declared)
            return backend is not None and not isinstance(backend, LoopBackend)

    def _backend(self, key: str) -> Backend | None:
        """The registered backend a config's ``backend`` (or ``platform``) names."""
        aliases = {"pytorch_libtorch": "pytorch", "onnxruntime_onnx": "onnxruntime"}
        return self.backends.get(aliases.get(key, key))

    async def load_all(self, names: Iterable[str] | None = None) -> None:
        """Load the given models, or every model this service hosts; one that
        fails is left UNAVAILABLE with its error and the others still load."""
        if names is None:
            names = [name for name in self.repository.names() if self.hosts_name(name)]
        try:
            # Light models all at once, each serving as soon as it is in (the index
            # says so, model by model); then the heavy backends' (torch, an LLM
            # engine), whose imports and loads would take the CPU from the others.
            # Last, the models that run others of this stage (LoopBackend).
            light, heavy, last = self._by_weight(names)
            await asyncio.gather(*(self._load_at_start(name) for name in light))
            await asyncio.gather(*(self._load_at_start(name) for name in heavy))
            await asyncio.gather(*(self._load_at_start(name) for name in last))
        finally:
            self.starting = False

    def _by_weight(self, names: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
        """``names`` split into those of light backends, those of heavy ones (a
        backend that says ``heavy = True``) and those of LoopBackends."""
        light: list[str] = []
        heavy: list[str] = []
        last: list[str] = []
        for name in names:
            try:
                key = self.repository.config(name)
                backend = self._backend(key.backend or key.platform)
            except MeshError:
                backend = None  # its load reports the error, among the first
            if isinstance(backend, LoopBackend):
                last.append(name)
            else:
                (heavy if getattr(backend, "heavy", False) else light).append(name)
        return light, heavy, last

    async def _load_at_start(self, name: str) -> None:
        try:
            await self.load(name)
        except NotFound as exc:
            log.error("%s", exc.message)  # not in the repository: no model to mark
        except MeshError:
            pass  # recorded, logged and counted by load()

    async def load(self, name: str, config_override: str | None = None) -> None:
        """Load or reload ``name``: new versions become ready, then replace the old.

        A failure is recorded as the model's load error and raised as the same
        kind of MeshError, its message starting "failed to load 'name'"; older
        versions that serve keep serving.
        """
        # What a failed load or the versions replaced leave is collected once
        # _load has let go of it, and what the new versions hold is frozen with
        # the rest (shared/gc_heap.py).
        with gc_heap.thawed():
            await self._load(name, config_override)

    async def _load(self, name: str, config_override: str | None) -> None:
        if not self.repository.has(name):
            raise NotFound(
                f"failed to load '{name}', failed to poll from model repository "
                f"(no model folder '{name}' in the model repository)"
            )
        async with self._lock(name):
            try:
                entry = self.repository.entry(name)
                if config_override:
                    entry = _with_override(entry, config_override)
                fresh = await self._load_versions(entry)
            except (Exception, SystemExit) as exc:
                raise self._load_failed(name, exc) from exc
            old = self._versions.get(name, {})
            self._versions[name] = {version.version: version for version in fresh}
            self._failed.pop(name, None)
            self._set_ready(name, True)
            log.info("model '%s' ready, versions %s", name, sorted(self._versions[name]))
        await asyncio.gather(*(v.unload() for v in old.values()), return_exceptions=True)

    async def _load_versions(self, entry: ModelEntry) -> list[ModelVersion]:
        """Build and load every selected version of ``entry``; all or none."""
        key = entry.config.backend or entry.config.platform
        backend = self._backend(key)
        if backend is None:
            raise InvalidArgument(
                f"model '{entry.name}': backend '{key}' is not served here"
                f" (this service runs {sorted(self.backends)})"
            )
        if isinstance(backend, CompletingBackend):
            entry = await _completed(entry, backend)
        fresh = [self._version(entry, v, backend) for v in entry.selected_versions()]
        try:
            await asyncio.gather(*(_load_version(version) for version in fresh))
        except Exception:
            await asyncio.gather(*(v.unload() for v in fresh if v.ready), return_exceptions=True)
            raise
        return fresh

    def _load_failed(self, name: str, exc: BaseException) -> MeshError:
        """Record ``exc`` as the load error of ``name``: index, log, metrics; the
        error to raise, naming the model in Triton's words.

        The reason callers see has no path of the server's outside the
        repository; the log has the repository's path and model code's traceback.
        """
        if isinstance(exc, MeshError):
            detail, kind, trace = exc.message, type(exc), None
        else:
            # Model code's own exception: its type and text are what its author needs.
            detail, kind, trace = f"{type(exc).__name__}: {exc}", InvalidArgument, exc
        self._failed[name] = safe_text(detail, self.repository.root)[:REASON_CHARS]
        log.error(
            "failed to load '%s': %s (repository %s)",
            name,
            detail,  # as raised: the log may name the server's folders
            self.repository.root.absolute(),
            exc_info=trace,
        )
        if self.metrics is not None:
            self.metrics.load_failures.labels(name).inc()
        self._set_ready(name, bool(self._versions.get(name)))
        return kind(f"failed to load '{name}': {self._failed[name]}")

    def _set_ready(self, name: str, serving: bool) -> None:
        if self.metrics is not None:
            self.metrics.model_ready.labels(name).set(1 if serving else 0)

    def _version(self, entry: ModelEntry, version: int, backend: Backend) -> ModelVersion:
        spec = ModelSpec(
            name=entry.name,
            version=version,
            path=entry.version_path(version),
            config=entry.config,
            parameters=config_parameters(entry.config),
        )
        return ModelVersion(spec, backend, self.metrics, self.queue_defaults)

    async def unload(self, name: str) -> None:
        """Stop serving every version of ``name`` (queued requests finish first)."""
        with gc_heap.thawed():  # what the versions held is collected, cycles and all
            await self._unload(name)

    async def _unload(self, name: str) -> None:
        async with self._lock(name):
            versions = self._versions.pop(name, None)
            if versions is None:
                raise NotFound(f"model '{name}' is not loaded")
            self._failed.pop(name, None)  # a failed reload's error: no longer why it is down
            self._set_ready(name, False)
        await asyncio.gather(*(v.unload() for v in versions.values()))

    async def unload_all(self) -> None:
        """Unload everything (service shutdown)."""
        for name in list(self._versions):
            await self.unload(name)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def get(self, name: str, version: str = "") -> ModelVersion:
        """The version to serve: the one asked for, or the newest ready one."""
        versions = self._versions.get(name)
        if not versions:
            if name in self._failed:
                raise Unavailable(
                    f"Request for unknown model: '{name}' has no available versions: "
                    f"failed to load '{name}': {self._failed[name]}"
                )
            if self.starting and self._hosted(name):
                raise Unavailable(
                    f"Request for unknown model: '{name}' has no available versions: "
                    "not loaded yet (the service is starting)"
                )
            raise NotFound(
                f"Request for unknown model: '{name}' is not found (not loaded by this service)"
            )
        if version:
            if not version.isdigit() or int(version) not in versions:
                raise NotFound(
                    f"Request for unknown model: '{name}' version {version} is not found "
                    f"(model '{name}' has no version '{version}' loaded; "
                    f"loaded: {sorted(versions)})"
                )
            return versions[int(version)]
        ready = [v for v in versions.values() if v.ready]
        if not ready:
            raise Unavailable(f"model '{name}' is not ready")
        return max(ready, key=lambda v: v.version)

    def _hosted(self, name: str) -> bool:
        """True when ``name`` is a model folder of the repository that this service hosts."""
        try:
            # Listed, not looked up: a caller's name is no path into the folder.
            return name in self.repository.names() and self.hosts_name(name)
        except (MeshError, OSError):
            return False

    def loaded(self) -> list[ModelVersion]:
        """Every loaded version of every model."""
        return [v for versions in self._versions.values() for v in versions.values()]

    def all_ready(self) -> bool:
        """True when every loaded version is ready."""
        return all(version.ready for version in self.loaded())

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model this service hosts, loaded or not, with its state."""
        rows: list[IndexEntry] = []
        for name in self.repository.names():
            versions = self._versions.get(name)
            if versions:
                rows += [
                    IndexEntry(name, str(v.version), *_state(v))
                    for v in sorted(versions.values(), key=lambda v: v.version)
                ]
                continue
            if self.hosts_name(name):
                rows.append(IndexEntry(name, "", "UNAVAILABLE", self._unloaded_reason(name)))
        if ready_only:
            rows = [row for row in rows if row.state == "READY"]
        return rows

    def _unloaded_reason(self, name: str) -> str:
        """Why a model is not loaded: its config's error as it is now, else the
        error of its last load (empty: never loaded, or unloaded)."""
        try:
            self.repository.config(name)
        except ConfigError as exc:
            return safe_text(exc.message, self.repository.root)[:REASON_CHARS]
        return self._failed.get(name, "")


async def _load_version(version: ModelVersion) -> None:
    """Load one version; model code's SystemExit becomes an ordinary error here,
    inside the task, because asyncio lets a task's SystemExit stop the loop."""
    try:
        await version.load()
    except SystemExit as exc:
        raise InvalidArgument(
            f"model '{version.name}' version {version.version}: model code raised "
            f"SystemExit({exc.code!r})"
        ) from exc


async def _completed(entry: ModelEntry, backend: CompletingBackend) -> ModelEntry:
    """``entry`` with the config its backend completed (in a thread: it may import
    model code), validated again."""
    newest = entry.version_path(entry.selected_versions()[-1])
    loop = asyncio.get_running_loop()
    config = await loop.run_in_executor(None, backend.complete_config, entry.config, newest)
    config.name = entry.name
    validate_config(config, entry.path / CONFIG_FILE)
    return dataclasses.replace(entry, config=config)


def _state(version: ModelVersion) -> tuple[str, str]:
    """State and reason for the index; a loaded version whose engine died is not READY."""
    if version.state == "READY" and not version.ready:
        return "UNAVAILABLE", "an instance of this version stopped working; reload the model"
    return version.state, version.reason


def _with_override(entry: ModelEntry, override: str) -> ModelEntry:
    """The entry with its config replaced by a JSON config (RepositoryModelLoad)."""
    config = mc.ModelConfig()
    try:
        json_format.Parse(override, config)
    except json_format.ParseError as exc:
        raise InvalidArgument(
            f"model '{entry.name}': parameter 'config' is not a valid JSON model config: {exc}"
        ) from exc
    config.name = entry.name
    return ModelEntry(entry.name, entry.path, config, entry.versions_on_disk)
