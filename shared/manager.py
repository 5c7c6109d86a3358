"""Model management: which versions are loaded, loading, reloading, unloading.

A (re)load builds the new versions beside the serving ones and swaps them in
only once they are ready, so a reload never fails a request; the versions it
replaces then drain their queues before they are released. Loads and unloads
of one model are serialised by a per-model lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from google.protobuf import json_format

from inference import model_config_pb2 as mc
from shared.backend import Backend, ModelSpec, config_parameters
from shared.errors import ConfigError, InvalidArgument, MeshError, NotFound, Unavailable
from shared.model import ModelVersion
from shared.repository import ModelEntry, ModelRepository
from shared.statistics import Metrics

log = logging.getLogger(__name__)


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
    ) -> None:
        self.repository = repository
        self.backends = dict(backends)
        self.metrics = metrics
        self._versions: dict[str, dict[int, ModelVersion]] = {}
        self._failed: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def hosts(self, config: mc.ModelConfig) -> bool:
        """True when one of this service's backends runs the model."""
        return self._backend_name(config) in self.backends

    @staticmethod
    def _backend_name(config: mc.ModelConfig) -> str:
        aliases = {"pytorch_libtorch": "pytorch", "onnxruntime_onnx": "onnxruntime"}
        key = config.backend or config.platform
        return aliases.get(key, key)

    async def load_all(self, names: Iterable[str] | None = None) -> None:
        """Load the given models, or every model this service hosts."""
        if names is None:
            entries = [e for e in self.repository.entries() if self.hosts(e.config)]
            names = [entry.name for entry in entries]
        for name in names:
            await self.load(name)

    async def load(self, name: str, config_override: str | None = None) -> None:
        """Load or reload ``name``: new versions become ready, then replace the old."""
        async with self._lock(name):
            entry = self.repository.entry(name)
            if config_override:
                entry = _with_override(entry, config_override)
            backend = self.backends.get(self._backend_name(entry.config))
            if backend is None:
                raise InvalidArgument(
                    f"model '{name}': backend '{entry.config.backend or entry.config.platform}'"
                    f" is not served here (this service runs {sorted(self.backends)})"
                )
            wanted = entry.selected_versions()
            fresh = [self._version(entry, version, backend) for version in wanted]
            try:
                await asyncio.gather(*(version.load() for version in fresh))
            except BaseException as exc:
                self._failed[name] = str(exc) if isinstance(exc, MeshError) else repr(exc)
                await asyncio.gather(
                    *(v.unload() for v in fresh if v.ready), return_exceptions=True
                )
                raise
            old = self._versions.get(name, {})
            self._versions[name] = {version.version: version for version in fresh}
            self._failed.pop(name, None)
            log.info("model '%s' ready, versions %s", name, list(wanted))
        await asyncio.gather(*(v.unload() for v in old.values()), return_exceptions=True)

    def _version(self, entry: ModelEntry, version: int, backend: Backend) -> ModelVersion:
        spec = ModelSpec(
            name=entry.name,
            version=version,
            path=entry.version_path(version),
            config=entry.config,
            parameters=config_parameters(entry.config),
        )
        return ModelVersion(spec, backend, self.metrics)

    async def unload(self, name: str) -> None:
        """Stop serving every version of ``name`` (queued requests finish first)."""
        async with self._lock(name):
            versions = self._versions.pop(name, None)
            if versions is None:
                raise NotFound(f"model '{name}' is not loaded")
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
                raise Unavailable(f"model '{name}' failed to load: {self._failed[name]}")
            raise NotFound(f"unknown model '{name}'")
        if version:
            if not version.isdigit() or int(version) not in versions:
                raise NotFound(
                    f"model '{name}' has no version '{version}' loaded (loaded: {sorted(versions)})"
                )
            return versions[int(version)]
        ready = [v for v in versions.values() if v.ready]
        if not ready:
            raise Unavailable(f"model '{name}' is not ready")
        return max(ready, key=lambda v: v.version)

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
            try:
                config = self.repository.config(name)
            except ConfigError as exc:
                rows.append(IndexEntry(name, "", "UNAVAILABLE", str(exc)))
                continue
            if self.hosts(config):
                rows.append(IndexEntry(name, "", "UNAVAILABLE", self._failed.get(name, "")))
        if ready_only:
            rows = [row for row in rows if row.state == "READY"]
        return rows


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
