"""The HTTP front door's listener and its drain, wherever it runs.

Two processes serve the same aiohttp application (app.py): the orchestrator
itself (in_orchestrator.py, the local mesh's default), which calls its core in
process (``CoreUpstream``), and the HTTP adapter (main.py), which calls the
orchestrator over gRPC (``Upstream``). ``HttpSettings`` are the
settings both read; ``FrontDoor`` starts the listener and drains it.

On drain: readiness turns 400 and new requests get 503, the listener closes,
in-flight requests get the grace period to finish; a streamed answer still
open then ends with an error event (no ``[DONE]``), so its client knows it
was cut short.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

from aiohttp import web
from pydantic import Field

from gateway.http.app import AdapterState, build_app
from shared.config import ServiceConfig

CUT_REASON = "the HTTP front door shut down before the answer finished; retry on another replica"


class HttpSettings(ServiceConfig):
    """The HTTP front door's settings (KServe v2 REST, OpenAI, TorchServe APIs)."""

    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=2**31 - 1)
    """Largest request body, also after gzip/deflate inflation; larger gets 413."""
    request_timeout_s: float = Field(300.0, gt=0.0, le=3600.0)
    """Deadline of each call to the orchestrator; past it the caller gets 504."""
    model_store: Path | None = None
    """TorchServe's model store: the folder its management API registers .mar files from."""
    model_repository: Path | None = None
    """The mesh's model repository, where registered archives become model folders
    (the orchestrator's ensembles are read from it too)."""


async def drain(runner: web.BaseRunner, state: AdapterState, grace_s: float) -> None:
    """Refuse new work, give in-flight requests ``grace_s`` (the runner's shutdown
    timeout), cut the streams still open with an error event, then close."""
    state.draining = True
    loop = asyncio.get_running_loop()
    # aiohttp cancels the handlers still running after grace_s and drops their
    # connections at once: the streams are cut a little before, so their error
    # events go out first.
    cutting = loop.call_later(grace_s - min(1.0, grace_s / 4), state.streams.cut, CUT_REASON)
    try:
        await runner.cleanup()
    finally:
        cutting.cancel()


class FrontDoor:
    """The aiohttp application over ``state``, listening on one port."""

    def __init__(self, state: AdapterState, grace_s: float) -> None:
        # auto_decompress off: rest.decode_body inflates with the body limit applied.
        # handler_cancellation: a client that disconnects cancels its handler, and so
        # its call upstream (an abandoned LLM generation stops instead of running on).
        self.state = state
        self.grace_s = grace_s
        self.runner = web.AppRunner(
            build_app(state),
            access_log=None,
            auto_decompress=False,
            handler_cancellation=True,
            shutdown_timeout=grace_s,
        )
        self._started = False
        self._drained = asyncio.Event()

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> str:
        """Listen on ``host:port`` (0: a free port); the bound ``host:port``."""
        await self.runner.setup()
        self._started = True
        await web.TCPSite(self.runner, host, port, ssl_context=ssl_context).start()
        bound_host, bound_port = self.runner.addresses[0][:2]
        return f"{bound_host}:{bound_port}"

    async def drain(self) -> None:
        """Refuse new requests, let those in flight finish (``grace_s``), close."""
        try:
            if self._started:
                await drain(self.runner, self.state, self.grace_s)
        finally:
            self._drained.set()

    async def drained(self) -> None:
        """Return once ``drain`` has finished."""
        await self._drained.wait()
