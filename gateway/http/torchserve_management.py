"""TorchServe's management API over the mesh (its own Envoy listener, admin role).

    POST   /models?url=x.mar[&model_name&initial_workers&batch_size&max_batch_delay
                             &response_timeout&synchronous]       register
    PUT    /models/{m}[/{v}]?min_worker=N[&max_worker&synchronous] scale workers
    GET    /models[?limit&next_page_token]                         list
    GET    /models/{m}[/{v}|/all]                                  describe
    PUT    /models/{m}/{v}/set-default                             default version
    DELETE /models/{m}[/{v}]                                       unregister

Registration writes the archive into the mesh's repository as a model folder
(the stages see it like any other) and loads it through the orchestrator's
repository API, so the model is then a normal model of the mesh: in the v2
index, answering v2 inference too. Workers are the model's instances: a scale
rewrites the folder's config and reloads it (new instances are built beside
the old, so no request fails), 0 workers unloads it. Answers use TorchServe's
JSON shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.http.torchserve import torchserve_errors
from gateway.http.torchserve_store import ModelStore
from gateway.http.upstream import Upstream
from inference import grpc_service_pb2 as pb
from services.inference.torchserve_archive import (
    REGISTER_KEYS,
    Imported,
    WorkerSettings,
    import_archive,
    read_record,
    settings_of,
    write_record,
    write_settings,
)
from shared.errors import FailedPrecondition, InvalidArgument, MeshError, NotFound
from shared.repository import parse_config

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def _int(query: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    raw = query.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise InvalidArgument(f"parameter '{key}' = {raw!r} is not an integer") from exc


def _flag(query: Mapping[str, str], key: str, default: bool) -> bool:
    raw = query.get(key)
    return default if raw is None else raw.strip().lower() in ("true", "1", "yes")


def _status(message: str, code: int = 200) -> web.Response:
    return web.json_response({"status": message}, status=code)


class TorchServeManagement:
    """The management API's routes and the model changes they make."""

    def __init__(self, upstream: Upstream, store: ModelStore) -> None:
        self.upstream = upstream
        self.store = store
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        """Loads of ``synchronous=false`` calls, kept until they finish."""

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Register the routes on ``router``."""
        router.add_post("/models", torchserve_errors(self.register))
        router.add_get("/models", torchserve_errors(self.list_models))
        for path in ("/models/{name}", "/models/{name}/{version}"):
            router.add_get(path, torchserve_errors(self.describe))
            router.add_put(path, torchserve_errors(self.scale))
            router.add_delete(path, torchserve_errors(self.unregister))
        router.add_put("/models/{name}/{version}/set-default", torchserve_errors(self.set_default))

    async def close(self) -> None:
        """Cancel the loads still running in the background."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    # Register, scale, unregister.

    async def register(self, request: web.Request) -> web.Response:
        """POST /models?url=...: the archive becomes a model of the mesh."""
        query = request.query
        url = query.get("url")
        if not url:
            raise InvalidArgument("Parameter url is required.")
        _, repository = self.store.configured()
        archive = self.store.archive(url)
        overrides = {
            ours: value
            for key, ours in REGISTER_KEYS.items()
            if (value := _int(query, key)) is not None
        }
        name = query.get("model_name") or None
        imported: Imported = await asyncio.to_thread(
            import_archive, archive, repository, name, overrides, {"default_workers_per_model": "0"}
        )
        self.store.forget(imported.name)
        head = f'Model "{imported.name}" Version: {imported.version} registered with '
        workers = imported.settings.min_workers
        if workers == 0:
            message = "0 initial workers. Use scale workers API to add workers for the model."
            return _status(head + message)
        if not _flag(query, "synchronous", True):
            self._background(imported.name, self._load_or_remove(imported))
            return _status(head + f"{workers} initial workers", 202)
        await self._load_or_remove(imported)
        return _status(head + f"{workers} initial workers")

    async def _load_or_remove(self, imported: Imported) -> None:
        """Load a fresh registration; one that cannot load is removed again."""
        try:
            async with self._lock(imported.name):
                await self._load(imported.name)
        except MeshError:
            await self._drop_version(imported.name, imported.version)
            raise

    def _background(self, name: str, work: Any) -> None:
        async def run() -> None:
            try:
                await work
            except MeshError as exc:
                log.error("model '%s': worker update failed: %s", name, exc.message)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self, name: str) -> None:
        await self.upstream.load(pb.RepositoryModelLoadRequest(model_name=name))

    async def _unload(self, name: str) -> None:
        with contextlib.suppress(NotFound):  # no workers: nothing loaded
            await self.upstream.unload(pb.RepositoryModelUnloadRequest(model_name=name))

    async def scale(self, request: web.Request) -> web.Response:
        """PUT /models/{m}[/{v}]?min_worker=N: the model's instances become N."""
        name = request.match_info["name"]
        version = await self._registered_version(name, request.match_info.get("version", ""))
        folder = self._folder(name)
        settings = await asyncio.to_thread(_settings, folder)
        low = _int(request.query, "min_worker", settings.min_workers)
        high = _int(request.query, "max_worker", max(settings.max_workers, low or 1))
        assert low is not None and high is not None
        if high < low:
            raise InvalidArgument(f"max_worker ({high}) must be at least min_worker ({low})")
        scaled = dataclasses.replace(settings, min_workers=low, max_workers=max(high, 1))

        async def apply() -> None:
            async with self._lock(name):
                await asyncio.to_thread(write_settings, folder, scaled)
                await (self._load(name) if low else self._unload(name))

        if not _flag(request.query, "synchronous", False):
            self._background(name, apply())
            return _status("Processing worker updates...", 202)
        await apply()
        return _status(f"Workers scaled to {low} for model: {name}, version: {version}")

    async def unregister(self, request: web.Request) -> web.Response:
        """DELETE /models/{m}[/{v}]: stop serving it and remove it from the repository."""
        name = request.match_info["name"]
        asked = request.match_info.get("version", "")
        version = await self._registered_version(name, asked)
        record = await self.store.record(name)
        if asked and len(record["versions"]) > 1 and version == record["default"]:
            raise InvalidArgument(f"Cannot remove default version {version} for model {name}")
        async with self._lock(name):
            if asked and len(record["versions"]) > 1:
                await self._drop_version(name, version)
                await self._load(name)
            else:
                await self._unload(name)
                await asyncio.to_thread(shutil.rmtree, self._folder(name))
                self.store.forget(name)
        return _status(f'Model "{name}" unregistered')

    async def _drop_version(self, name: str, version: str) -> None:
        """Remove one version folder (the whole model folder when it was the last)."""
        folder = self._folder(name)

        def drop() -> None:
            record = read_record(folder)
            entry = record["versions"].pop(version, None)
            if not record["versions"]:
                shutil.rmtree(folder, ignore_errors=True)
                return
            if entry is not None:
                shutil.rmtree(folder / str(entry["folder"]), ignore_errors=True)
            if record["default"] == version:
                record["default"] = sorted(record["versions"])[-1]
            write_record(folder, record)

        await asyncio.to_thread(drop)
        self.store.forget(name)

    async def set_default(self, request: web.Request) -> web.Response:
        """PUT /models/{m}/{v}/set-default: unversioned predictions go to ``v``."""
        name = request.match_info["name"]
        version = await self._registered_version(name, request.match_info["version"])
        folder = self._folder(name)
        async with self._lock(name):
            record = dict(await self.store.record(name))
            record["default"] = version
            await asyncio.to_thread(write_record, folder, record)
            self.store.forget(name)
        return _status(f'Default version successfully updated for model "{name}" to "{version}"')

    # Describe and list.

    async def list_models(self, request: web.Request) -> web.Response:
        """GET /models: registered models, paginated as TorchServe pages them."""
        limit = _int(request.query, "limit", DEFAULT_LIMIT) or DEFAULT_LIMIT
        start = _int(request.query, "next_page_token", 0) or 0
        if not 1 <= limit <= MAX_LIMIT or start < 0:
            raise InvalidArgument(f"limit must be in 1..{MAX_LIMIT}, next_page_token >= 0")
        names = await self.store.names()
        page = names[start : start + limit]
        models = []
        for name in page:
            record = await self.store.record(name)
            default = record["versions"].get(record["default"], {})
            models.append({"modelName": name, "modelUrl": default.get("url", "")})
        document: dict[str, Any] = {"models": models}
        if start + limit < len(names):
            document["nextPageToken"] = str(start + limit)
        return web.json_response(document)

    async def describe(self, request: web.Request) -> web.Response:
        """GET /models/{m}[/{v}|/all]: each version in TorchServe's description shape."""
        name = request.match_info["name"]
        asked = request.match_info.get("version", "")
        record = await self.store.record(name)
        if asked == "all":
            versions = sorted(record["versions"])
        else:
            versions = [await self._registered_version(name, asked)]
        settings = await asyncio.to_thread(_settings, self._folder(name))
        return web.json_response(
            [await self._description(name, v, record, settings) for v in versions]
        )

    async def _description(
        self, name: str, version: str, record: Mapping[str, Any], settings: WorkerSettings
    ) -> dict[str, Any]:
        entry = record["versions"][version]
        folder = str(entry["folder"])
        return {
            "modelName": name,
            "modelVersion": version,
            "modelUrl": entry["url"],
            "runtime": "python",
            "minWorkers": settings.min_workers,
            "maxWorkers": settings.max_workers,
            "batchSize": settings.batch_size,
            "maxBatchDelay": settings.max_batch_delay_ms,
            "responseTimeout": settings.response_timeout_s,
            "loadedAtStartup": False,
            "isDefault": version == record["default"],
            "workers": await self._workers(name, folder),
            "jobQueueStatus": {"remainingCapacity": 1000, "pendingRequests": 0},
        }

    async def _workers(self, name: str, folder: str) -> list[dict[str, Any]]:
        """One entry per instance the stage runs now (none when not loaded)."""
        try:
            ready = await self.upstream.model_ready(pb.ModelReadyRequest(name=name, version=folder))
            if not ready.ready:
                return []
            config = await self.upstream.model_config(
                pb.ModelConfigRequest(name=name, version=folder)
            )
        except MeshError:
            return []
        count = sum(group.count or 1 for group in config.config.instance_group) or 1
        return [
            {
                "id": f"{name}_{index}",
                "status": "READY",
                "memoryUsage": 0,
                "pid": -1,
                "gpu": False,
                "gpuUsage": "N/A",
            }
            for index in range(count)
        ]

    async def _registered_version(self, name: str, version: str) -> str:
        """TorchServe's version ``version`` of ``name`` (the default for ""); 404s."""
        record = await self.store.record(name)
        if not record["versions"]:
            raise NotFound(f"Model not found: {name}")
        chosen = version or record["default"]
        if chosen not in record["versions"]:
            raise NotFound(f"Model version: {version} does not exist for model: {name}")
        return str(chosen)

    def _folder(self, name: str) -> Path:
        _, repository = self.store.configured()
        return repository / name


def _settings(folder: Path) -> WorkerSettings:
    """The settings in a model folder's config.pbtxt."""
    try:
        return settings_of(parse_config(folder / "config.pbtxt"))
    except (OSError, ValueError, MeshError) as exc:
        raise FailedPrecondition(f"model folder '{folder.name}' has no readable config") from exc
