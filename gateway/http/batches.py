"""OpenAI's Files and Batch APIs over the mesh's job queue (services/batch/store.py).

::

    POST   /v1/files                  multipart: file (JSONL), purpose=batch
    GET    /v1/files[/{id}]           the file objects
    GET    /v1/files/{id}/content     the bytes (inputs, and the results a job wrote)
    DELETE /v1/files/{id}
    POST   /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches[/{id}]         status, request_counts, output_file_id, error_file_id
    POST   /v1/batches/{id}/cancel

The queue is found from ``MESHSERVE_REDIS_URL`` and ``MESHSERVE_JOBS_DIR``
(the local mesh sets both); without them these routes answer 503 saying so.
An upload is checked line by line before it is kept: the first bad line is
named in a 400. Translation only: the store does the work.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from services.batch.lines import endpoint_ok, parse_file
from services.batch.store import JobStore
from shared import jsontext
from shared.errors import InvalidArgument, Unavailable

Handler = Callable[[web.Request], Awaitable[web.Response]]
WINDOW = re.compile(r"^\d{1,4}h$")
"""A completion window: hours, as OpenAI writes it ("24h")."""
RETENTION_S = 7 * 86400
"""Default retention of files and jobs (env MESHSERVE_JOBS_RETENTION_S)."""


def _listing(data: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


class BatchApi:
    """The /v1/files and /v1/batches route handlers."""

    def __init__(self, store: JobStore | None) -> None:
        self._store = store

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> BatchApi:
        """The API over the queue the environment names (none: every call is 503)."""
        url, directory = env.get("MESHSERVE_REDIS_URL"), env.get("MESHSERVE_JOBS_DIR")
        if not url or not directory:
            return cls(None)
        retention = int(env.get("MESHSERVE_JOBS_RETENTION_S", RETENTION_S))
        return cls(JobStore(url, Path(directory).expanduser(), retention))

    @property
    def store(self) -> JobStore:
        """The job store, or Unavailable when the mesh runs without a queue."""
        if self._store is None:
            raise Unavailable(
                "batch jobs need the job queue: set MESHSERVE_REDIS_URL and MESHSERVE_JOBS_DIR"
                " (the local mesh starts Redis when redis-server is installed)"
            )
        return self._store

    async def upload(self, request: web.Request) -> web.Response:
        """POST /v1/files."""
        form = await request.post()
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise InvalidArgument(f"'purpose' must be \"batch\", got {purpose!r}")
        if not isinstance(upload, web.FileField):
            raise InvalidArgument("'file' must be a file part of the multipart form")
        content = upload.file.read()
        await asyncio.to_thread(parse_file, content)
        name = upload.filename or "batch.jsonl"
        return web.json_response(await self.store.put_file(content, name, "batch"))

    async def files(self, request: web.Request) -> web.Response:
        """GET /v1/files."""
        return web.json_response(_listing(await self.store.files(request.query.get("purpose"))))

    async def file(self, request: web.Request) -> web.Response:
        """GET /v1/files/{id}."""
        return web.json_response(await self.store.file(request.match_info["id"]))

    async def content(self, request: web.Request) -> web.Response:
        """GET /v1/files/{id}/content."""
        body = await self.store.content(request.match_info["id"])
        return web.Response(body=body, content_type="application/jsonl")

    async def delete(self, request: web.Request) -> web.Response:
        """DELETE /v1/files/{id}."""
        return web.json_response(await self.store.delete_file(request.match_info["id"]))

    async def create(self, request: web.Request) -> web.Response:
        """POST /v1/batches."""
        body = jsontext.parse_object(await request.read())
        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window, metadata = body.get("completion_window", "24h"), body.get("metadata") or {}
        if not isinstance(file_id, str) or not file_id:
            raise InvalidArgument("'input_file_id' must be a file id")
        if not isinstance(endpoint, str) or not endpoint_ok(endpoint):
            raise InvalidArgument(f"'endpoint' {endpoint!r} cannot be run as a batch")
        if not isinstance(window, str) or not WINDOW.match(window):
            raise InvalidArgument(f"'completion_window' must be like \"24h\", got {window!r}")
        if not isinstance(metadata, dict) or len(metadata) > 16:
            raise InvalidArgument("'metadata' must be an object of at most 16 keys")
        metadata = {str(k): str(v) for k, v in metadata.items()}
        batch = await self.store.create_batch(file_id, endpoint, window, metadata)
        return web.json_response(batch)

    async def batch(self, request: web.Request) -> web.Response:
        """GET /v1/batches/{id}."""
        return web.json_response(await self.store.batch(request.match_info["id"]))

    async def batches(self, request: web.Request) -> web.Response:
        """GET /v1/batches?after=&limit=."""
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError as exc:
            raise InvalidArgument("'limit' must be an integer") from exc
        if not 1 <= limit <= 100:
            raise InvalidArgument(f"'limit' must be in 1..100, got {limit}")
        found = await self.store.batches(request.query.get("after"), limit + 1)
        return web.json_response(_listing(found[:limit], len(found) > limit))

    async def cancel(self, request: web.Request) -> web.Response:
        """POST /v1/batches/{id}/cancel."""
        return web.json_response(await self.store.cancel(request.match_info["id"]))

    async def close(self, _: web.Application) -> None:
        """Close the store's connections (the app's cleanup)."""
        if self._store is not None:
            await self._store.close()

    def add_routes(self, app: web.Application) -> None:
        """Mount the routes on ``app`` and close the store with it."""
        routes = [
            ("POST", "/v1/files", self.upload),
            ("GET", "/v1/files", self.files),
            ("GET", "/v1/files/{id}", self.file),
            ("GET", "/v1/files/{id}/content", self.content),
            ("DELETE", "/v1/files/{id}", self.delete),
            ("POST", "/v1/batches", self.create),
            ("GET", "/v1/batches", self.batches),
            ("GET", "/v1/batches/{id}", self.batch),
            ("POST", "/v1/batches/{id}/cancel", self.cancel),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, _queue_errors(handler))
        app.on_cleanup.append(self.close)


def _queue_errors(handler: Handler) -> Handler:
    """``handler``, with Redis being away (restarting) answered 503 instead of 500."""

    async def handle(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except RedisError as exc:
            raise Unavailable(f"the job queue is unreachable, retry shortly: {exc}") from exc

    return handle


def mount(app: web.Application) -> None:
    """The Files and Batch APIs on ``app``, over the queue the environment names."""
    BatchApi.from_environment(os.environ).add_routes(app)
