"""The job store: files on disk, jobs and their lines on Redis. No gRPC or HTTP here.

::

    files      <dir>/files/<id>.jsonl          uploaded inputs and written outputs
               file:<id>        (hash)         its OpenAI file object
    jobs       batch:<id>       (hash)         status, counts, timestamps, file ids
               batch:<id>:done  (hash)         line index -> result line (exactly one)
    queue      lines            (stream)       one entry per input line: batch, index, line
               group "workers"                 claimed with XREADGROUP, acknowledged by
                                               the same script that records the result

Redis Streams with a consumer group give what the issue asks without a
library on top: an entry stays in its consumer's pending list until it is
acknowledged, a restarted worker (same consumer name) reads its own pending
entries first, and a dead worker's entries are taken over with XAUTOCLAIM.
The result and the acknowledgement are written by one Lua script that keeps
the first result of a line and counts it once, so a line run twice (its worker
killed after the call, before the record) still has exactly one result line.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import secrets
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import redis.asyncio as aioredis

from services.batch.lines import BatchLine, parse_file
from shared.errors import FailedPrecondition, InvalidArgument, NotFound

PREFIX = "meshserve:"
STREAM = PREFIX + "lines"
GROUP = "workers"
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
Outcome = Literal["ok", "error", "skip"]
T = TypeVar("T")

# KEYS: batch hash, done hash, stream. ARGV: index, line, outcome, group, entry id.
_RECORD = """
local new = 0
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  local field = 'completed'
  if ARGV[3] == 'error' then field = 'failed' elseif ARGV[3] == 'skip' then field = 'skipped' end
  redis.call('HINCRBY', KEYS[1], field, 1)
  new = 1
end
redis.call('XACK', KEYS[3], ARGV[4], ARGV[5])
redis.call('XDEL', KEYS[3], ARGV[5])
return new
"""


@dataclass(frozen=True)
class Claimed:
    """A line a worker holds: acknowledge it with ``JobStore.record``."""

    entry_id: str
    batch_id: str
    index: int
    line: BatchLine


async def _aw(value: Awaitable[T] | T) -> T:
    # redis-py types many async commands as "awaitable or not".
    if inspect.isawaitable(value):
        return cast(T, await value)
    return value


def _now() -> int:
    return int(time.time())


def _new_id(kind: str) -> str:
    return f"{kind}-{secrets.token_hex(12)}"


class JobStore:
    """Files, jobs and the line queue, shared by the HTTP adapter, the CLI and the workers."""

    def __init__(self, redis_url: str, directory: Path, retention_s: int) -> None:
        self.redis: aioredis.Redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        self.files_dir = directory / "files"
        self.retention_s = retention_s
        self._record = self.redis.register_script(_RECORD)

    async def close(self) -> None:
        """Close the Redis connections."""
        await self.redis.aclose()

    async def ensure_group(self) -> None:
        """Create the stream's consumer group once (a no-op when it exists)."""
        try:
            await self.redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- files -----------------------------------------------------------------

    async def put_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        """Keep ``content`` on disk as a new file; its OpenAI file object."""
        file_id = _new_id("file")
        return await self._write_file(file_id, content, filename, purpose)

    async def _write_file(
        self, file_id: str, content: bytes, filename: str, purpose: str
    ) -> dict[str, Any]:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        path = self.files_dir / f"{file_id}.jsonl"
        await asyncio.to_thread(_write_atomically, path, content)
        # Listed by the time to the microsecond: two made in one second keep their order.
        stamp = time.time()
        created = int(stamp)
        info = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": created,
            "expires_at": created + self.retention_s,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        await _aw(self.redis.hset(PREFIX + f"file:{file_id}", mapping=_flat(info)))
        await self.redis.zadd(PREFIX + "files", {file_id: stamp})
        return info

    async def file(self, file_id: str) -> dict[str, Any]:
        """The file object, or NotFound."""
        raw = await _aw(self.redis.hgetall(PREFIX + f"file:{file_id}"))
        if not raw:
            raise NotFound(f"file '{file_id}' does not exist")
        return _typed(raw, ("bytes", "created_at", "expires_at"))

    async def files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        """Every file (newest first), of ``purpose`` when given."""
        ids = await self.redis.zrevrange(PREFIX + "files", 0, -1)
        found = [await self.file(i) for i in ids if await self.redis.exists(PREFIX + f"file:{i}")]
        return [f for f in found if purpose is None or f["purpose"] == purpose]

    async def content(self, file_id: str) -> bytes:
        """The file's bytes, or NotFound."""
        await self.file(file_id)
        path = self.files_dir / f"{file_id}.jsonl"
        if not path.exists():
            raise NotFound(f"file '{file_id}' has no content any more")
        return await asyncio.to_thread(path.read_bytes)

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        """Remove the file; OpenAI's deletion object."""
        await self.file(file_id)
        await self.redis.delete(PREFIX + f"file:{file_id}")
        await self.redis.zrem(PREFIX + "files", file_id)
        (self.files_dir / f"{file_id}.jsonl").unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- jobs ------------------------------------------------------------------

    async def create_batch(
        self, input_file_id: str, endpoint: str, window: str, metadata: Mapping[str, str]
    ) -> dict[str, Any]:
        """Queue every line of ``input_file_id`` as a new job; its batch object."""
        lines = await asyncio.to_thread(parse_file, await self.content(input_file_id))
        wrong = next((n for n, line in enumerate(lines, 1) if line.url != endpoint), None)
        if wrong is not None:
            raise InvalidArgument(
                f"line {wrong}: 'url' is {lines[wrong - 1].url!r}, but the batch's endpoint is"
                f" {endpoint!r}"
            )
        batch_id = _new_id("batch")
        stamp = time.time()  # as files
        created = int(stamp)
        info = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": "in_progress",
            "created_at": created,
            "in_progress_at": created,
            "expires_at": created + self.retention_s,
            "total": len(lines),
            "completed": 0,
            "failed": 0,
            "skipped": 0,
            "metadata": json.dumps(dict(metadata)),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(PREFIX + f"batch:{batch_id}", mapping=_flat(info))
            pipe.zadd(PREFIX + "batches", {batch_id: stamp})
            pipe.sadd(PREFIX + "active", batch_id)
            for index, line in enumerate(lines):
                pipe.xadd(STREAM, {"batch": batch_id, "index": index, "line": _line_text(line)})
            await pipe.execute()
        return await self.batch(batch_id)

    async def batch(self, batch_id: str) -> dict[str, Any]:
        """The batch object (OpenAI's shape), or NotFound."""
        raw = await _aw(self.redis.hgetall(PREFIX + f"batch:{batch_id}"))
        if not raw:
            raise NotFound(f"batch '{batch_id}' does not exist")
        return batch_document(raw)

    async def batches(self, after: str | None, limit: int) -> list[dict[str, Any]]:
        """Batches, newest first, after the id ``after`` when given."""
        ids = await self.redis.zrevrange(PREFIX + "batches", 0, -1)
        if after in ids:
            ids = ids[ids.index(after) + 1 :]
        return [await self.batch(i) for i in ids[:limit]]

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        """Ask the workers to skip the job's remaining lines; the batch object."""
        info = await self.batch(batch_id)
        if info["status"] in TERMINAL:
            raise FailedPrecondition(f"batch '{batch_id}' is {info['status']}: cannot cancel")
        await _aw(
            self.redis.hset(
                PREFIX + f"batch:{batch_id}",
                mapping={"status": "cancelling", "cancelling_at": _now()},
            )
        )
        return await self.batch(batch_id)

    async def status(self, batch_id: str) -> str:
        """The job's status ('' when it is gone)."""
        return str(await _aw(self.redis.hget(PREFIX + f"batch:{batch_id}", "status")) or "")

    # -- the queue (workers) ---------------------------------------------------

    async def claim(self, consumer: str, count: int, block_ms: int, own: bool) -> list[Claimed]:
        """Up to ``count`` lines for ``consumer``: its own unacknowledged ones when ``own``."""
        start = "0" if own else ">"
        answer = await self.redis.xreadgroup(
            GROUP, consumer, {STREAM: start}, count=count, block=None if own else block_ms
        )
        return [
            _claimed(entry_id, fields)
            for _, entries in answer
            for entry_id, fields in entries
            if fields
        ]

    async def take_over(self, consumer: str, idle_ms: int, count: int) -> list[Claimed]:
        """Lines another consumer claimed and left idle for ``idle_ms`` (a dead worker)."""
        answer = await self.redis.xautoclaim(STREAM, GROUP, consumer, idle_ms, "0-0", count=count)
        return [_claimed(entry_id, fields) for entry_id, fields in answer[1] if fields]

    async def touch(self, consumer: str, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of lines ``consumer`` is still running (none is taken over)."""
        if entry_ids:
            await self.redis.xclaim(STREAM, GROUP, consumer, 0, list(entry_ids), justid=True)

    async def queued(self) -> int:
        """Lines no worker has claimed yet."""
        groups = await self.redis.xinfo_groups(STREAM)
        return sum(int(g.get("lag") or 0) for g in groups if g["name"] == GROUP)

    async def record(self, claimed: Claimed, result: Mapping[str, Any], outcome: Outcome) -> bool:
        """Keep the line's first result and acknowledge it; whether this one was kept."""
        keys = [
            PREFIX + f"batch:{claimed.batch_id}",
            PREFIX + f"batch:{claimed.batch_id}:done",
            STREAM,
        ]
        row = json.dumps({"outcome": outcome, "line": result})
        args = [claimed.index, row, outcome, GROUP, claimed.entry_id]
        return bool(await self._record(keys=keys, args=args))

    async def active(self) -> list[str]:
        """Jobs not yet finished."""
        return sorted(await _aw(self.redis.smembers(PREFIX + "active")))

    async def finish(self, batch_id: str) -> bool:
        """Write the output and error files of a job whose every line is done; whether it was."""
        raw = await _aw(self.redis.hgetall(PREFIX + f"batch:{batch_id}"))
        if not raw or raw["status"] in TERMINAL:
            await _aw(self.redis.srem(PREFIX + "active", batch_id))
            return bool(raw)
        counts = [int(raw.get(k, 0)) for k in ("completed", "failed", "skipped")]
        if sum(counts) < int(raw["total"]):
            return False
        if not await self.redis.set(PREFIX + f"batch:{batch_id}:finishing", "1", nx=True, ex=15):
            return False
        done = await _aw(self.redis.hgetall(PREFIX + f"batch:{batch_id}:done"))
        ordered = [json.loads(done[k]) for k in sorted(done, key=int)]
        update: dict[str, Any] = {"finalizing_at": _now()}
        for kind, keep in (("output", "ok"), ("error", "error")):
            rows = [r["line"] for r in ordered if r["outcome"] == keep]
            if rows:
                text = "".join(json.dumps(row) + "\n" for row in rows).encode()
                name = f"{batch_id}_{kind}.jsonl"
                stored = await self._write_file(
                    f"file-{kind}-{batch_id}", text, name, "batch_output"
                )
                update[f"{kind}_file_id"] = stored["id"]
        ended = "cancelled" if raw["status"] == "cancelling" else "completed"
        update |= {"status": ended, f"{ended}_at": _now()}
        await _aw(self.redis.hset(PREFIX + f"batch:{batch_id}", mapping=update))
        await self.redis.delete(PREFIX + f"batch:{batch_id}:done")
        await _aw(self.redis.srem(PREFIX + "active", batch_id))
        return True

    async def expire(self) -> int:
        """Remove files and finished jobs past their retention; how many went."""
        gone = 0
        cutoff = _now() - self.retention_s
        for file_id in await self.redis.zrangebyscore(PREFIX + "files", 0, cutoff):
            await self.delete_file(file_id)
            gone += 1
        for batch_id in await self.redis.zrangebyscore(PREFIX + "batches", 0, cutoff):
            if await self.status(batch_id) in TERMINAL | {""}:
                await self.redis.delete(PREFIX + f"batch:{batch_id}")
                await self.redis.zrem(PREFIX + "batches", batch_id)
                gone += 1
        return gone


def batch_document(raw: Mapping[str, str]) -> dict[str, Any]:
    """OpenAI's batch object from the stored hash."""
    numbers = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at")
    numbers += ("cancelling_at", "cancelled_at", "failed_at", "expired_at")  # type: ignore[assignment]
    document: dict[str, Any] = {key: None for key in numbers}
    document |= {"errors": None, "output_file_id": None, "error_file_id": None}
    for key in ("id", "object", "endpoint", "input_file_id", "completion_window", "status"):
        document[key] = raw.get(key)
    for key in ("output_file_id", "error_file_id"):
        document[key] = raw.get(key)
    for key in numbers:
        document[key] = int(raw[key]) if key in raw else None
    completed, failed = int(raw.get("completed", 0)), int(raw.get("failed", 0))
    document["request_counts"] = {
        "total": int(raw.get("total", 0)),
        "completed": completed,
        "failed": failed,
    }
    document["metadata"] = json.loads(raw.get("metadata") or "{}") or None
    return document


def _line_text(line: BatchLine) -> str:
    return json.dumps({"custom_id": line.custom_id, "url": line.url, "body": line.body})


def _claimed(entry_id: str, fields: Mapping[str, str]) -> Claimed:
    item = json.loads(fields["line"])
    line = BatchLine(item["custom_id"], item["url"], item["body"])
    return Claimed(entry_id, fields["batch"], int(fields["index"]), line)


def _flat(info: Mapping[str, Any]) -> dict[str, str | int]:
    return {k: v if isinstance(v, int) else str(v) for k, v in info.items() if v is not None}


def _typed(raw: Mapping[str, str], numbers: tuple[str, ...]) -> dict[str, Any]:
    return {k: int(v) if k in numbers else v for k, v in raw.items()}


def _write_atomically(path: Path, content: bytes) -> None:
    partial = path.with_suffix(".part")
    partial.write_bytes(content)
    partial.replace(path)
