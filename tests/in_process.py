"""A mesh in the test's own process: python-backend stages and the orchestrator,
each a real grpc.aio server on port 0, built as their ``main`` builds them.

``running()`` starts one in the caller's event loop (async tests drive the core
and the servers directly); ``MeshThread`` runs one in an event loop of its own,
so that a module of synchronous tests (blocking stubs, tritonclient in a child
process) shares one mesh without spawning the services.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from inference import grpc_service_pb2_grpc as pb_grpc
from meshserve.v1 import meshserve_pb2_grpc as api_grpc
from services.colocated.local_ensembles import LocalEnsembleBackend
from services.inference.python import PythonBackend
from services.orchestrator.core import Orchestrator
from services.orchestrator.main import OrchestratorConfig, build_parts
from shared.backend import Backend
from shared.server import MeshServer
from shared.stage import StageConfig, build_stage_parts

T = TypeVar("T")


@dataclass
class Mesh:
    """Stage replicas and the orchestrator, with clients of both front doors."""

    stages: list[MeshServer]
    orchestrator: MeshServer
    core: Orchestrator
    v2: pb_grpc.GRPCInferenceServiceStub
    api: api_grpc.MeshServiceStub


def _stage(
    repo: Path, index: int, load: list[str], grace_s: float, backends: Mapping[str, Backend]
) -> MeshServer:
    config = StageConfig(
        service_name=f"inference-{index}",
        model_repository=repo,
        load_models=load,
        grace_period_s=grace_s,
    )
    return MeshServer(config, build_stage_parts(config, backends))


def _python_backends(local_ensembles: bool) -> dict[str, Backend]:
    backends: dict[str, Backend] = {"python": PythonBackend()}
    if local_ensembles:  # as services/colocated/main.py registers it
        backends["ensemble"] = LocalEnsembleBackend()
    return backends


@contextlib.asynccontextmanager
async def running(
    repo: Path,
    replicas: int = 1,
    load: list[str] | None = None,
    refresh_interval_s: float = 300,
    grace_s: float = 1,
    local_ensembles: bool = False,
) -> AsyncIterator[Mesh]:
    """``replicas`` inference stages on ``repo`` and the orchestrator, in this loop.

    The default refresh is longer than any test: the router knows what it saw
    at start, so a replica stopped by a test stays "ready" until a call fails.
    With ``local_ensembles`` the stages run the ensembles of their own models whole.
    """
    stages = [
        _stage(repo, index, load or [], grace_s, _python_backends(local_ensembles))
        for index in range(replicas)
    ]
    async with _running(repo, stages, refresh_interval_s, grace_s) as mesh:
        yield mesh


@contextlib.asynccontextmanager
async def running_stage(
    repo: Path, backends: Mapping[str, Backend], grace_s: float = 1
) -> AsyncIterator[Mesh]:
    """One stage with ``backends`` on ``repo`` and the orchestrator, in this loop."""
    stage = _stage(repo, 0, [], grace_s, backends)
    async with _running(repo, [stage], 300, grace_s) as mesh:
        yield mesh


@contextlib.asynccontextmanager
async def _running(
    repo: Path, stages: list[MeshServer], refresh_interval_s: float, grace_s: float
) -> AsyncIterator[Mesh]:
    orchestrator: MeshServer | None = None
    channel: grpc.aio.Channel | None = None
    try:
        for stage in stages:
            await stage.start()
        config = OrchestratorConfig(
            grpc_port=0,
            metrics_port=-1,
            grace_period_s=grace_s,
            stages=[f"inference={stage.address}" for stage in stages],
            model_repository=repo,
            refresh_interval_s=refresh_interval_s,
        )
        parts = build_parts(config)
        orchestrator = MeshServer(config, parts)
        await orchestrator.start()
        channel = grpc.aio.insecure_channel(orchestrator.address)
        yield Mesh(
            stages,
            orchestrator,
            parts.servicers[0][1].core,
            pb_grpc.GRPCInferenceServiceStub(channel),  # type: ignore[no-untyped-call]
            api_grpc.MeshServiceStub(channel),  # type: ignore[no-untyped-call]
        )
    finally:
        if channel is not None:
            await channel.close()
        if orchestrator is not None:
            await orchestrator.stop()
        for stage in stages:
            await stage.stop()


class MeshThread:
    """A mesh (``running``) served from a background thread's event loop."""

    def __init__(self, repo: Path, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._started: Future[Mesh] = Future()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(repo, options),), daemon=True
        )
        self._thread.start()
        self.mesh = self._started.result(timeout=60)

    async def _serve(self, repo: Path, options: dict[str, Any]) -> None:
        self._stop = asyncio.Event()
        try:
            async with running(repo, **options) as mesh:
                self._started.set_result(mesh)
                await self._stop.wait()
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            raise

    @property
    def address(self) -> str:
        """The orchestrator's ``host:port``."""
        return self.mesh.orchestrator.address

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run ``coroutine`` in the mesh's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def close(self) -> None:
        """Stop every server and the loop."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
        self._loop.close()
