"""Where TorchServe's archives come from and where they are served from.

The model store is TorchServe's folder of ``.mar`` files (``--model-store``):
registration takes an archive from it (a file name, a path or a ``file://``
URL inside it; nothing is downloaded). The repository is the mesh's model
repository, shared with the stages: a registered archive becomes a model
folder there (services/inference/torchserve_archive.py), with a record of
TorchServe's versions, which one is the default, and where each came from.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from services.inference.torchserve_archive import read_record
from shared.errors import InvalidArgument, NotFound, Unavailable


@dataclass
class ModelStore:
    """The model store and the repository the management API writes into."""

    store: Path | None = None
    """TorchServe's model store: the only folder archives are registered from."""
    repository: Path | None = None
    """The mesh's model repository (shared with the stages)."""
    _records: dict[str, dict[str, Any]] = field(default_factory=dict)

    def configured(self) -> tuple[Path, Path]:
        """(store, repository), or Unavailable naming the missing setting."""
        if self.store is None or self.repository is None:
            missing = "model_store" if self.store is None else "model_repository"
            raise Unavailable(
                f"TorchServe's management API needs the HTTP adapter's {missing} setting"
            )
        return self.store, self.repository

    def archive(self, url: str) -> Path:
        """The archive a registration's ``url`` names, inside the model store."""
        store, _ = self.configured()
        parsed = urlparse(url)
        if parsed.scheme in ("http", "https", "s3"):
            raise InvalidArgument(
                f"url {url!r}: archives are not downloaded; copy it into the model store "
                "and register it by file name"
            )
        raw = unquote(parsed.path) if parsed.scheme == "file" else url
        path = Path(raw) if Path(raw).is_absolute() else store / raw
        resolved = path.resolve()
        if not resolved.is_relative_to(store.resolve()):
            raise InvalidArgument(f"url {url!r} is outside the model store")
        if not resolved.exists():
            raise NotFound(f"Model not found in model store: {url}")
        return resolved

    async def record(self, name: str) -> dict[str, Any]:
        """The registration record of ``name`` (empty when it was not registered here)."""
        if name not in self._records:
            if self.repository is None:
                return {"versions": {}, "default": ""}
            self._records[name] = await asyncio.to_thread(read_record, self.repository / name)
        return self._records[name]

    def forget(self, name: str) -> None:
        """Drop the cached record of ``name`` (after the management API changed it)."""
        self._records.pop(name, None)

    async def version_folder(self, name: str, version: str) -> str:
        """The mesh version (folder) for TorchServe's ``version`` of ``name``:
        the default version's when none is given; a model not registered through
        TorchServe's API keeps the version as given."""
        record = await self.record(name)
        versions = record["versions"]
        if not versions:
            return version
        chosen = version or record["default"]
        if chosen not in versions:
            raise NotFound(f"Model version: {version} does not exist for model: {name}")
        return str(versions[chosen]["folder"])

    async def names(self) -> list[str]:
        """The models registered through TorchServe's API, sorted."""
        if self.repository is None:
            return []
        repository = self.repository

        def scan() -> list[str]:
            if not repository.is_dir():
                return []
            return sorted(
                child.name
                for child in repository.iterdir()
                if (child / "torchserve.json").is_file()
            )

        return await asyncio.to_thread(scan)
