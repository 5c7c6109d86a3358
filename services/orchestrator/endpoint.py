"""One stage replica as the router holds it: its channels and stubs, the
streams it keeps open ahead, and what it hosts.

A replica gets a small pool of HTTP/2 channels (``open_endpoint``); calls take
them in turn. Beside the typed stubs it keeps ModelInfer without serialisers
(a request forwarded as bytes), a stream per channel for forwarded requests
(forward_stream.py) and spare ModelStreamInfer calls (stage_stream.py). The
router (router.py) fills in what each replica hosts from its RepositoryIndex
and chooses the replica for each call.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import grpc
from opentelemetry import trace

from inference import grpc_service_pb2_grpc as pb_grpc
from services.orchestrator.forward_stream import ForwardStream
from services.orchestrator.stage_stream import StageStream
from shared.channels import open_channels, open_stream_channels
from shared.config import MAX_MESSAGE_BYTES
from shared.errors import InvalidArgument
from shared.h2grpc.client import LeanChannel

if TYPE_CHECKING:
    # Exists in the generated stubs' types only: the stub of a grpc.aio channel.
    from inference.grpc_service_pb2_grpc import GRPCInferenceServiceAsyncStub as Stub

REFILL_DELAY_S = 0.05
"""How long after a stream's release its replica's spares are topped up."""

RawCall: TypeAlias = "grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]"
"""ModelInfer on serialised messages: a request forwarded without decoding it."""
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(frozen=True)
class StageAddress:
    """One configured endpoint: a stage name and ``host:port``."""

    stage: str
    target: str

    @classmethod
    def parse(cls, text: str) -> StageAddress:
        """``name=host:port`` or plain ``host:port`` (the name is then the address)."""
        name, sep, target = text.partition("=")
        if not sep:
            name, target = text, text
        if not target or ":" not in target:
            raise InvalidArgument(f"stage endpoint {text!r}: expected name=host:port")
        return cls(stage=name.strip(), target=target.strip())


@dataclass
class Endpoint:
    """A stage replica: a small pool of channels, and what it hosts."""

    address: StageAddress
    stubs: list[Stub]
    channels: list[grpc.aio.Channel]
    raw_calls: list[RawCall] = field(default_factory=list)
    """ModelInfer without (de)serialisers, one per channel: a request forwarded as it is."""
    plain_channels: list[grpc.aio.Channel | LeanChannel] = field(default_factory=list)
    """Channels for the streams of forwarded requests (each request carries its own
    trace; shared.channels.open_stream_channels); they connect on first use."""
    forward_streams: dict[int, ForwardStream] = field(default_factory=dict)
    """Channel index -> its stream carrying forwarded requests (forward_stream.py)."""
    retiring_streams: set[ForwardStream] = field(default_factory=set)
    """Streams that take no new requests, until their answers are in."""
    message_limit: int = MAX_MESSAGE_BYTES
    """The largest message written to the replica (the channels' limit)."""
    forwards_on_streams: bool = True
    """False once the replica turned out not to answer forwarded requests on a stream."""
    packs: bool = True
    """Whether forwarded requests go several to a message (a meshserve stage's
    ForwardingService); False once the replica turned out not to serve it."""
    models: set[str] = field(default_factory=set)
    """Models READY on this replica (calls go only to these)."""
    listed: set[str] = field(default_factory=set)
    """Every model this replica's stage hosts, loaded or not (its RepositoryIndex):
    where a model that is not loaded would load."""
    load_errors: dict[str, str] = field(default_factory=dict)
    """Models this replica failed to load -> the error (RepositoryIndex reason)."""
    loading: set[str] = field(default_factory=set)
    """Models this replica lists but has not loaded yet while it starts (its health
    is NOT_SERVING until every model it loads at start is in): UNAVAILABLE, not unknown."""
    ready: bool = False
    handoff: bool = False
    """Whether the replica is on this host and takes tensors in the orchestrator's
    shared-memory buffers (its ServerMetadata lists the extension; handoff.py)."""
    in_flight: int = 0
    spare_count: int = 0
    """How many streams to keep opened ahead (StageStream)."""
    spares: collections.deque[StageStream] = field(default_factory=collections.deque)
    streamed: bool = False
    """Whether a stream was ever asked of this replica: only then are spares kept."""
    origin: StageAddress | None = None
    """The configured endpoint this replica was resolved from (None: it is that one)."""
    calls: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks with a unary call in flight here (cut when the replica is retired)."""
    abandoned: bool = False
    """Retired and its calls cut: a call cancelled here is retried elsewhere."""
    _next: itertools.cycle[int] = field(default_factory=lambda: itertools.cycle([0]))
    _refill: asyncio.TimerHandle | None = None

    def stub(self) -> Stub:
        """The next channel's stub (round robin over the pool)."""
        return self.stubs[next(self._next)]

    def raw_infer(self) -> RawCall:
        """ModelInfer on the next channel, on serialised messages both ways."""
        return self.raw_calls[next(self._next)]

    def forward_stream(self) -> ForwardStream:
        """The stream for forwarded requests: the replica's packed one, else the
        next channel's (a new one when it stopped taking them)."""
        # Packed: one stream, so that every request waiting can join its message.
        index = 0 if self.packs else next(self._next)
        stream = self.forward_streams.get(index)
        if stream is None or not stream.open:
            if stream is not None:
                self._retire_stream(stream)
            channel = self.plain_channels[index]
            stream = self.forward_streams[index] = ForwardStream(
                channel, packed=self.packs, limit=self.message_limit
            )
        return stream

    def _retire_stream(self, stream: ForwardStream) -> None:
        # Held until its last answers are in: nothing else refers to it.
        self.retiring_streams.add(stream)
        stream.when_ended(lambda: self.retiring_streams.discard(stream))

    def stream(self) -> StageStream:
        """A ModelStreamInfer call: a spare when one is still open, else a new one.
        It counts as in flight until released."""
        while self.spares:
            stream = self.spares.popleft()
            if stream.alive:
                break
        else:
            stream = StageStream(self.stub())
        self.streamed = True
        self.in_flight += 1
        stream.on_release = self._released
        return stream

    def fill_spares(self) -> None:
        """Drop spares that ended; open new ones up to ``spare_count``."""
        if any(not stream.alive for stream in self.spares):
            self.spares = collections.deque(s for s in self.spares if s.alive)
        while self.streamed and self.ready and len(self.spares) < self.spare_count:
            self.spares.append(StageStream(self.stub()))

    def close_spares(self) -> None:
        """Cancel every spare and forwarding stream (the replica went away, or the
        router stops)."""
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None
        while self.spares:
            self.spares.popleft().cancel()
        for stream in self.forward_streams.values():
            stream.cancel()
        self.forward_streams.clear()

    def _released(self) -> None:
        self.in_flight -= 1
        if self.spare_count and self._refill is None:
            # Not at once: the release comes as the request's last answer leaves,
            # and opening streams then (here and on the stage) delays it.
            self._refill = asyncio.get_running_loop().call_later(REFILL_DELAY_S, self._refilled)

    def _refilled(self) -> None:
        self._refill = None
        self.fill_spares()

    def abandon(self) -> None:
        """Cut every unary call still in flight (the replica was retired)."""
        self.abandoned = True
        for task in self.calls:
            task.cancel()

    def describe(self) -> str:
        """``stage 'name' (host:port)`` for error messages."""
        return f"stage '{self.address.stage}' ({self.address.target})"


def open_endpoint(
    address: StageAddress,
    channels: int,
    max_message_bytes: int,
    tracer: trace.Tracer,
    lean_streams: bool = True,
) -> Endpoint:
    """Open ``channels`` HTTP/2 connections to one replica (and as many for its
    streams of forwarded requests, on asyncio's sockets with ``lean_streams``)."""
    opened = open_channels(address.target, channels, max_message_bytes, tracer)
    # The stub's type follows its channel's, which grpc leaves untyped: say it.
    stubs = [cast("Stub", pb_grpc.GRPCInferenceServiceStub(c)) for c in opened]
    # No serialisers: the bytes go out and come back as they are.
    raw_calls = [c.unary_unary(INFER_METHOD) for c in opened]
    plain = open_stream_channels(address.target, channels, max_message_bytes, tracer, lean_streams)
    endpoint = Endpoint(address, stubs, opened, raw_calls, plain, message_limit=max_message_bytes)
    endpoint._next = itertools.cycle(range(channels))
    return endpoint
