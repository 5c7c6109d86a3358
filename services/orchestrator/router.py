"""Where each model lives: stage endpoints, discovery, replica choice, retries.

The orchestrator is given stage endpoints (``name=host:port``; in Kubernetes a
headless Service name resolves to every replica). It learns which models each
endpoint hosts from RepositoryIndex and refreshes that periodically, so no
routing table is kept by hand: the index lists every model the stage's
backends host, loaded or not, which also says where a model that is not
loaded would load. Calls go only to READY models; the load errors
of the models a stage could not load are kept too, so a call to one of them
answers UNAVAILABLE with that error instead of "unknown model". A call goes to
the ready replica with the fewest calls in flight (ties take turns); when a
replica cannot be reached the call is retried once on another replica (model
inference here is idempotent), and the replica is marked unready until the
next refresh finds it again. Each endpoint's host is resolved to all of its addresses
(services/orchestrator/discovery.py: every A record of a headless Service, or
every line of a hosts file) and re-resolved periodically: a new address becomes
a replica without a restart; one that vanished is retired: no new calls, its
calls in flight get a grace to finish, then are cut and retried elsewhere.
Every stage call runs inside ``shared.rpc.remote``, so what fails here
is a ``shared.errors`` class: a replica that cannot be reached is
``Unavailable``. Streams to a replica come from its ``StageStream`` spares when
one waits (services/orchestrator/stage_stream.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from inference import model_config_pb2 as mc
from services.orchestrator.discovery import Resolver, is_address, is_local, split_target
from services.orchestrator.endpoint import INFER_METHOD, Endpoint, StageAddress, open_endpoint
from services.orchestrator.forward_stream import NotForwarding
from services.orchestrator.stage_stream import StageStream
from shared.errors import Cancelled, MeshError, NotFound, Unavailable
from shared.rpc import remote
from shared.shared_memory import HANDOFF_EXTENSION
from shared.tracing import client_span, current_carrier

if TYPE_CHECKING:
    # Exists in the generated stubs' types only: the stub of a grpc.aio channel.
    from inference.grpc_service_pb2_grpc import GRPCInferenceServiceAsyncStub as Stub

log = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_INTERVAL_S = 0.25
"""How often a replica that is unreachable or still loading is asked again (the
others wait for the refresh interval): a restarted stage serves again at once."""

StageCall = Callable[["Stub"], Awaitable[T]]
"""One typed RPC on a replica's stub (``lambda stub: stub.ModelInfer(request)``)."""


@dataclass(frozen=True)
class Discovery:
    """How the router finds replicas: the resolver and its timing."""

    resolver: Resolver = field(default_factory=Resolver)
    resolve_interval_s: float = 5.0
    """How often each endpoint's host is resolved again."""
    retire_grace_s: float = 5.0
    """How long a vanished replica's calls in flight may still run."""


class StageRouter:
    """Knows every replica of every stage and which models each serves."""

    def __init__(
        self,
        addresses: Sequence[StageAddress],
        *,
        channels_per_endpoint: int,
        max_message_bytes: int,
        tracer: trace.Tracer,
        refresh_interval_s: float,
        spare_streams: int = 0,
        discovery: Discovery | None = None,
        packed_forwarding: bool = True,
        lean_streams: bool = True,
    ) -> None:
        self.addresses = list(addresses)
        self._spare_streams = spare_streams
        self._packs = packed_forwarding
        self._channel_settings = (channels_per_endpoint, max_message_bytes, tracer, lean_streams)
        self._tracer = tracer
        # Channels are opened in start(): grpc.aio binds them to the running loop.
        self.endpoints: list[Endpoint] = []
        self.refresh_interval_s = refresh_interval_s
        self.discovery = discovery or Discovery()
        self._tasks: list[asyncio.Task[None]] = []
        self._retiring: set[asyncio.Task[None]] = set()
        self._turn = itertools.count()
        self.on_change: Callable[[], Awaitable[None]] | None = None

    async def start(self) -> None:
        """Resolve, connect, discover once, then keep re-resolving and refreshing
        in owned background tasks."""
        await self.resolve(initial=True)
        await self.refresh()
        self._tasks = [asyncio.create_task(self._refresh_loop(), name="stage-discovery")]
        if any(not is_address(split_target(a.target)[0]) for a in self.addresses):
            loop = self._resolve_loop()
            self._tasks.append(asyncio.create_task(loop, name="stage-resolution"))

    async def stop(self) -> None:
        """Stop refreshing and close every channel."""
        for task in [*self._tasks, *self._retiring]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._retiring, return_exceptions=True)
        for endpoint in self.endpoints:
            endpoint.ready = False
            endpoint.close_spares()
            for channel in [*endpoint.channels, *endpoint.plain_channels]:
                await channel.close()

    def _open(self, address: StageAddress, origin: StageAddress | None) -> Endpoint:
        endpoint = open_endpoint(address, *self._channel_settings)
        endpoint.spare_count = self._spare_streams
        endpoint.packs = self._packs
        endpoint.origin = origin
        return endpoint

    async def resolve(self, *, initial: bool = False) -> None:
        """Resolve every configured endpoint to its replicas now: open the new
        addresses (and ask them what they host), retire the ones that vanished."""
        wanted: dict[tuple[str, str], StageAddress] = {}
        current = {(e.address.stage, e.address.target): e for e in self.endpoints}
        # All names at once: one slow lookup does not hold the others back.
        answers = await asyncio.gather(
            *(self.discovery.resolver.expand(a.target) for a in self.addresses)
        )
        for address, targets in zip(self.addresses, answers, strict=True):
            if targets is None:
                # Unknown now: keep what this name had (at start: let gRPC resolve it).
                kept = [key for key, e in current.items() if e.origin == address]
                kept = kept or ([] if not initial else [(address.stage, address.target)])
                wanted.update((key, address) for key in kept)
                continue
            wanted.update(((address.stage, target), address) for target in targets)
        added = [
            self._open(StageAddress(stage, target), wanted[stage, target])
            for stage, target in wanted
            if (stage, target) not in current
        ]
        removed = [e for key, e in current.items() if key not in wanted]
        if not added and not removed:
            return
        self.endpoints = [e for e in self.endpoints if e not in removed] + added
        for endpoint in removed:
            self._retire(endpoint)
        if not initial:
            for endpoint in added:
                log.info("%s was added (resolved)", endpoint.describe())
            await asyncio.gather(*(self._refresh_one(e) for e in added))
            if self.on_change is not None:
                await self.on_change()

    def _retire(self, endpoint: Endpoint) -> None:
        log.info("%s vanished from resolution: retired", endpoint.describe())
        endpoint.ready = False
        endpoint.close_spares()
        task = asyncio.create_task(self._drain(endpoint), name="stage-retire")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _drain(self, endpoint: Endpoint) -> None:
        """Give a retired replica's calls in flight the grace, cut the rest, close."""
        deadline = asyncio.get_running_loop().time() + self.discovery.retire_grace_s
        # A counter, not an event: calls and stream releases change it in several places.
        while endpoint.in_flight and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        endpoint.abandon()
        await asyncio.sleep(0)  # the cut calls leave the channels first
        for channel in [*endpoint.channels, *endpoint.plain_channels]:
            await channel.close()

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discovery.resolve_interval_s)
            try:
                await self.resolve()
            except Exception:
                log.exception("stage resolution failed")

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(min(PROBE_INTERVAL_S, self.refresh_interval_s))
            try:
                if loop.time() - last >= self.refresh_interval_s:
                    last = loop.time()
                    await self.refresh()
                else:
                    await self.refresh(waiting_only=True)
            except Exception:
                log.exception("stage discovery failed")

    async def refresh(self, *, waiting_only: bool = False) -> None:
        """Ask every endpoint which models it has ready, and which failed (RepositoryIndex);
        ``waiting_only``: only those unreachable or still loading."""
        endpoints = [e for e in self.endpoints if not waiting_only or not e.ready or e.loading]
        before = {id(e): (e.ready, frozenset(e.models)) for e in endpoints}
        await asyncio.gather(*(self._refresh_one(e) for e in endpoints))
        after = {id(e): (e.ready, frozenset(e.models)) for e in endpoints}
        if before != after and self.on_change is not None:
            await self.on_change()

    async def _refresh_one(self, endpoint: Endpoint) -> None:
        try:
            index = await _index(endpoint)
            waiting = _waiting(index)
            if waiting and not await _starting(endpoint):
                # SERVING comes once the start-up loads are in: a load that ended
                # after the index was read is READY in a second read. (Without it,
                # such a model would be neither ready nor loading: unknown.)
                index = await _index(endpoint)
                waiting = set()
        except MeshError as exc:
            if endpoint.ready:
                log.warning("%s is unreachable: %s", endpoint.describe(), exc.message)
            endpoint.ready = False
            endpoint.close_spares()
            return
        if not endpoint.ready:
            log.info("%s is ready", endpoint.describe())
            endpoint.handoff = is_local(endpoint.address.target) and await _hands_off(endpoint)
        endpoint.models = {model.name for model in index.models if model.state == "READY"}
        endpoint.listed = {model.name for model in index.models}
        endpoint.load_errors = _load_errors(index)
        endpoint.loading = waiting
        endpoint.ready = True
        endpoint.fill_spares()

    def replicas(self, model: str) -> list[Endpoint]:
        """Every endpoint known to host ``model`` (ready or not)."""
        return [e for e in self.endpoints if model in e.models]

    def stage_names(self, model: str) -> list[str]:
        """Names of the stages hosting ``model``."""
        return sorted({e.address.stage for e in self.replicas(model)})

    def local(self, model: str) -> bool:
        """True when every replica known to serve ``model`` takes tensors in the
        orchestrator's shared-memory buffers (on this host, with the setting on)."""
        replicas = self.replicas(model)
        return bool(replicas) and all(e.handoff for e in replicas)

    def hosts(self, model: str) -> bool:
        """True when some ready replica serves ``model``."""
        return any(e.ready for e in self.replicas(model))

    def listing(self, model: str) -> set[str]:
        """The stages whose index lists ``model``, loaded or not: where loading it goes."""
        return {e.address.stage for e in self.endpoints if model in e.listed}

    def all_models(self) -> set[str]:
        """Every model some endpoint has reported."""
        return {m for e in self.endpoints for m in e.models}

    def _pick(self, model: str, exclude: set[int]) -> Endpoint:
        candidates = [e for e in self.replicas(model) if e.ready and id(e) not in exclude]
        if not candidates:
            known = self.replicas(model)
            if not known:
                raise self._not_hosted(model)
            where = ", ".join(e.describe() for e in known)
            raise Unavailable(f"model '{model}': no ready replica ({where})")
        fewest = min(e.in_flight for e in candidates)
        # Ties (idle replicas, at low load) take turns: else the first always wins.
        least = [e for e in candidates if e.in_flight == fewest]
        return least[next(self._turn) % len(least)]

    def _not_hosted(self, model: str) -> NotFound | Unavailable:
        """The error for a model no replica serves: still loading where a stage is
        starting (restarted, say), its load error where a stage failed to load it,
        else unknown (Triton's words first, for its clients)."""
        starting = [e for e in self.endpoints if e.ready and model in e.loading]
        if starting:
            return Unavailable(
                f"Request for unknown model: '{model}' has no available versions: not "
                f"loaded yet ({', '.join(e.describe() for e in starting)} is starting)"
            )
        failed = [e for e in self.endpoints if model in e.load_errors]
        if not failed:
            return NotFound(
                f"Request for unknown model: '{model}' is not found (no stage hosts it)"
            )
        where = failed[0]
        return Unavailable(
            f"Request for unknown model: '{model}' has no available versions: failed to load "
            f"'{model}' on {where.describe()}: {where.load_errors[model]}"
        )

    def stream(self, model: str) -> StageStream:
        """A ModelStreamInfer call to the least busy ready replica of ``model``.

        Its errors come on its reads; the caller decides what may be retried.
        """
        return self._pick(model, set()).stream()

    async def call(self, model: str, invoke: StageCall[T], *, retry: bool = True) -> T:
        """Run ``invoke`` on a replica of ``model``; one retry on another replica
        when the first cannot be reached (Unavailable: the request is not at fault)
        or cancelled the call itself (CANCELLED from a stage: it stopped with the
        call in flight; the caller's own going away is asyncio's CancelledError)."""
        return await self._call(model, lambda endpoint: invoke(endpoint.stub()), retry)

    async def forward(
        self, model: str, request: bytes, timeout_s: float | None, on_stream: str | None = None
    ) -> bytes:
        """A serialised ModelInferRequest answered by a replica of ``model``, the
        answer serialised as the replica sent it (retried as ``call`` is). With
        ``on_stream`` (the request's id) it travels on a stream of forwarded
        requests where the replica has them (forward_stream.py: packed several to
        a message where it can), its trace context with it, else as a ModelInfer."""

        # Outside any trace (the common case: tracing off) there is no client span to
        # open and no context to carry: skip both, a few microseconds a request.
        traced = trace.get_current_span().get_span_context().is_valid

        async def invoke(endpoint: Endpoint) -> bytes:
            while on_stream is not None and endpoint.forwards_on_streams:
                stream = endpoint.forward_stream()
                try:
                    if not traced:
                        return await stream.infer(request, on_stream)
                    with client_span(self._tracer, INFER_METHOD):
                        return await stream.infer(request, on_stream, current_carrier())
                except NotForwarding:
                    # No packs: one request per message then; no stream: ModelInfer.
                    if stream.packed:
                        endpoint.packs = False
                    else:
                        endpoint.forwards_on_streams = False
            answer: bytes = await endpoint.raw_infer()(request, timeout=timeout_s)
            return answer

        return await self._call(model, invoke, True)

    async def _call(self, model: str, invoke: Callable[[Endpoint], Awaitable[T]], retry: bool) -> T:
        tried: set[int] = set()
        attempts = 2 if retry else 1
        last: Unavailable | Cancelled | None = None
        for _ in range(attempts):
            try:
                endpoint = self._pick(model, tried)
            except Unavailable:
                if last is not None:
                    break
                raise
            tried.add(id(endpoint))
            endpoint.in_flight += 1
            task = asyncio.current_task()
            assert task is not None
            endpoint.calls.add(task)
            try:
                with remote():
                    return await invoke(endpoint)
            except (Unavailable, Cancelled) as exc:
                last = exc
                log.warning("%s failed a call for '%s': %s", endpoint.describe(), model, exc)
                endpoint.ready = False
            except asyncio.CancelledError:
                # Ours only when the replica was retired and nobody else cancelled.
                if not endpoint.abandoned or task.uncancel() > 0:
                    raise
                last = Unavailable(f"{endpoint.describe()} was retired with the call in flight")
                log.warning(
                    "%s was retired with a call for '%s' in flight", endpoint.describe(), model
                )
            finally:
                endpoint.calls.discard(task)
                endpoint.in_flight -= 1
        stages = ", ".join(self.stage_names(model)) or "?"
        detail = last.message if last is not None else "no replica"
        raise Unavailable(f"stage '{stages}' is unavailable for model '{model}': {detail}")

    async def model_config(self, model: str) -> mc.ModelConfig:
        """A model's config, from a replica of the stage hosting it."""
        request = pb.ModelConfigRequest(name=model)

        async def fetch(stub: Stub) -> pb.ModelConfigResponse:
            with remote(f"model '{model}': "):
                response: pb.ModelConfigResponse = await stub.ModelConfig(request, timeout=10)
            return response

        return (await self.call(model, fetch)).config


async def _index(endpoint: Endpoint) -> pb.RepositoryIndexResponse:
    """The replica's RepositoryIndex (its errors as ``shared.errors`` classes)."""
    with remote():
        request = pb.RepositoryIndexRequest()
        index: pb.RepositoryIndexResponse = await endpoint.stub().RepositoryIndex(
            request, timeout=5
        )
    return index


async def _hands_off(endpoint: Endpoint) -> bool:
    """Whether the replica lists the handoff extension (False when it cannot say)."""
    try:
        with remote():
            request = pb.ServerMetadataRequest()
            answer: pb.ServerMetadataResponse = await endpoint.stub().ServerMetadata(
                request, timeout=5
            )
    except MeshError:
        return False
    return HANDOFF_EXTENSION in answer.extensions


def _load_errors(index: pb.RepositoryIndexResponse) -> dict[str, str]:
    """Models the index says failed to load -> why (a reason says why a model is
    not loaded; none: never loaded, or unloaded)."""
    ready = {model.name for model in index.models if model.state == "READY"}
    return {
        model.name: model.reason
        for model in index.models
        if model.state == "UNAVAILABLE" and model.reason and model.name not in ready
    }


def _waiting(index: pb.RepositoryIndexResponse) -> set[str]:
    """Models listed but neither READY nor failed: loading, while the replica starts."""
    ready = {model.name for model in index.models if model.state == "READY"}
    return {model.name for model in index.models} - ready - _load_errors(index).keys()


async def _starting(endpoint: Endpoint) -> bool:
    """True while the replica's health is not SERVING: it loads its models at start
    (then SERVING) or drains. Just after it bound its port, its health may not know
    the service yet (NOT_FOUND): starting too. A stage without the health service
    (UNIMPLEMENTED) is never starting."""
    stub = health_pb2_grpc.HealthStub(endpoint.channels[0])
    try:
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return bool(exc.code() != grpc.StatusCode.UNIMPLEMENTED)
    return bool(answer.status != health_pb2.HealthCheckResponse.SERVING)
