"""meshserve.v1.JobService over the job store (services/batch/store.py).

The servicer translates only: proto -> the store's calls -> proto. The
orchestrator hosts it (so Envoy's gRPC and /api/v1 routes reach it) when the
environment names the queue (``MESHSERVE_REDIS_URL``, ``MESHSERVE_JOBS_DIR``);
errors are the store's (NotFound, InvalidArgument...), mapped by the server's
interceptor like every other RPC's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from meshserve.v1 import jobs_pb2 as japi
from meshserve.v1 import jobs_pb2_grpc as japi_grpc
from services.batch.lines import endpoint_ok
from services.batch.store import JobStore
from shared.errors import InvalidArgument
from shared.server import ServiceParts

JOB_SERVICE_NAME = "meshserve.v1.JobService"
RETENTION_S = 7 * 86400
"""Default retention of files and jobs (env MESHSERVE_JOBS_RETENTION_S)."""
MAX_METADATA = 16

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


def store_from_environment(env: Mapping[str, str]) -> JobStore | None:
    """The job store the environment names, or None (no queue configured)."""
    url, directory = env.get("MESHSERVE_REDIS_URL"), env.get("MESHSERVE_JOBS_DIR")
    if not url or not directory:
        return None
    retention = int(env.get("MESHSERVE_JOBS_RETENTION_S", RETENTION_S))
    return JobStore(url, Path(directory).expanduser(), retention)


def job_to_proto(batch: Mapping[str, Any]) -> japi.Job:
    """The store's batch object as a Job."""
    counts = batch["request_counts"]
    ended = next((batch[k] for k in ("completed_at", "cancelled_at", "failed_at") if batch[k]), 0)
    return japi.Job(
        id=batch["id"],
        status=batch["status"],
        endpoint=batch["endpoint"],
        input_file_id=batch["input_file_id"],
        output_file_id=batch["output_file_id"] or "",
        error_file_id=batch["error_file_id"] or "",
        counts=japi.JobCounts(
            total=counts["total"], completed=counts["completed"], failed=counts["failed"]
        ),
        created_at=batch["created_at"] or 0,
        ended_at=ended or 0,
        metadata=batch["metadata"] or {},
    )


class JobApiServicer(japi_grpc.JobServiceServicer):
    """JobService over the job store."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    async def SubmitJob(
        self, request: japi.SubmitJobRequest, context: Context
    ) -> japi.SubmitJobResponse:
        if not endpoint_ok(request.endpoint):
            raise InvalidArgument(f"'endpoint' {request.endpoint!r} cannot be run as a job")
        if bool(request.input_jsonl) == bool(request.input_file_id):
            raise InvalidArgument("give either 'input_jsonl' or 'input_file_id'")
        if len(request.metadata) > MAX_METADATA:
            raise InvalidArgument(f"'metadata' holds at most {MAX_METADATA} keys")
        file_id = request.input_file_id
        if request.input_jsonl:
            content = request.input_jsonl.encode()
            file_id = (await self.store.put_file(content, "job.jsonl", "batch"))["id"]
        batch = await self.store.create_batch(
            file_id, request.endpoint, "24h", dict(request.metadata)
        )
        return japi.SubmitJobResponse(job=job_to_proto(batch))

    async def GetJob(self, request: japi.GetJobRequest, context: Context) -> japi.GetJobResponse:
        return japi.GetJobResponse(job=job_to_proto(await self.store.batch(request.id)))

    async def ListJobs(
        self, request: japi.ListJobsRequest, context: Context
    ) -> japi.ListJobsResponse:
        limit = request.limit or 20
        if not 1 <= limit <= 100:
            raise InvalidArgument(f"'limit' must be in 1..100, got {limit}")
        found = await self.store.batches(request.after or None, limit + 1)
        jobs = [job_to_proto(batch) for batch in found[:limit]]
        return japi.ListJobsResponse(jobs=jobs, has_more=len(found) > limit)

    async def CancelJob(
        self, request: japi.CancelJobRequest, context: Context
    ) -> japi.CancelJobResponse:
        return japi.CancelJobResponse(job=job_to_proto(await self.store.cancel(request.id)))


def add_job_api(parts: ServiceParts, env: Mapping[str, str] | None = None) -> None:
    """Host JobService in the server ``parts`` describe, when the environment names a queue."""
    store = store_from_environment(os.environ if env is None else env)
    if store is None:
        return
    pair = (japi_grpc.add_JobServiceServicer_to_server, JobApiServicer(store))
    parts.servicers = [*parts.servicers, pair]
    parts.service_names = [*parts.service_names, JOB_SERVICE_NAME]
    parts.on_stop = [*parts.on_stop, store.close]
