"""Forwarded ModelInfer requests carried as messages on a few open streams.

A new unary RPC costs a grpc.aio client and server several times what one more
message on an open stream does (docs/performance.md), and a stage model's
request passes the orchestrator untouched anyway. So requests without a
deadline and outside any trace are written, still serialised, on a
ModelStreamInfer call per channel that says it forwards (``FORWARD_HEADER``):
the stage answers each as ModelInfer would. A request with a deadline keeps
its own RPC (the deadline and a cancel then reach the stage). A traced one
carries its trace context in its parameters, set on the wire like its id, and
the stage opens its server span from them (``shared.trace_interceptors``), so
traced and untraced requests take the same path.

Answers come back in any order: each request carries an id of the stream's own
(set on the wire, ``shared.wireformat``), and its answer is found by it and
given the caller's id back. A stream takes new requests for a while only
(``STREAM_REQUESTS``, ``STREAM_SECONDS``) and closes once it has none in flight,
so a stage that drains is not held open by it: its drain gate counts an open
stream as work in flight, and it refuses the stream that replaces it.

To a meshserve stage the stream is ``ForwardingService/Forward`` (``packed``),
one per replica: requests are written by one writer task, each message
carrying every request that waits when it is written, and the stage answers
the same way (shared/forwarding.py). A request never waits for company: under
load the requests that arrive while a message is written share the next one,
and a wait would only hold the stage idle (the path then forms convoys that
the orchestrator, the stage and the client serve in turn). To a server without
ForwardingService, a ModelStreamInfer per channel carries one request per message.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping

import grpc

from inference import grpc_service_pb2 as pb
from shared.config import MAX_MESSAGE_BYTES
from shared.errors import MeshError, Overloaded, Unavailable
from shared.forwarding import (
    FORWARD_HEADER,
    FORWARD_UNARY,
    PACKED_METHOD,
    fitting_count,
    packed_size,
)
from shared.h2grpc.client import LeanChannel, StreamCall
from shared.rpc import failure
from shared.stream_messages import stream_failure
from shared.wireformat import (
    WireError,
    id_field,
    infer_header,
    repeated_field,
    repeated_pieces,
    stream_answer,
    string_parameters,
    with_id,
)

STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
STREAM_REQUESTS = 256
"""Requests a stream takes before a new one replaces it."""
ACCEPT_TIMEOUT_S = 2.0
"""How long a new stream's server has to say that it forwards (a meshserve stage
says so at once; a server that sends its headers only with its first answer
would never say it, and is then spoken to with ModelInfer)."""
STREAM_SECONDS = 1.0
"""How long a stream takes new requests before a new one replaces it."""


class NotForwarding(Exception):
    """The server does not answer forwarded requests on a stream (not a meshserve stage)."""


class ForwardStream:
    """One call carrying forwarded requests and their answers: ForwardingService's
    Forward (``packed``), or ModelStreamInfer."""

    def __init__(
        self,
        channel: grpc.aio.Channel | LeanChannel,
        *,
        packed: bool = False,
        limit: int = MAX_MESSAGE_BYTES,
    ) -> None:
        # No (de)serialisers: requests go out and answers come in as bytes.
        method = channel.stream_stream(PACKED_METHOD if packed else STREAM_METHOD)
        self._call = method(metadata=((FORWARD_HEADER, FORWARD_UNARY),))
        self.packed = packed
        self._limit = limit
        """The largest message written (the channel's own limit)."""
        loop = asyncio.get_running_loop()
        self._closes_at = loop.time() + STREAM_SECONDS
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._tags = itertools.count()
        self._sent = 0
        self._waiting: list[tuple[str, tuple[bytes, ...], int]] = []
        """Requests not yet written, for the writer task: (tag, the request's pieces:
        its bytes and the fields set on it, joined only as they are written, and
        the bytes they take in a message)."""
        self._withdrawn: list[str] = []
        """Tags of sent requests whose callers went away, for the next message."""
        self._writer: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()  # one message at a time on the call
        self._accepted: asyncio.Future[bool] = loop.create_future()
        self._closing = False
        self._closer: asyncio.Task[None] | None = None
        self._wrote_last = False  # half-closed: nothing more may be written
        self._idle: asyncio.TimerHandle | None = None
        self._reader = asyncio.create_task(self._read(), name="forward-stream")

    @property
    def open(self) -> bool:
        """True while the stream takes new requests."""
        if self._closing or self._reader.done():
            return False
        if self._sent >= STREAM_REQUESTS or asyncio.get_running_loop().time() > self._closes_at:
            self._closing = True
            if not self._pending:
                self._finish()
            return False
        return True

    async def infer(
        self, request: bytes, caller_id: str, carried: Mapping[str, str] | None = None
    ) -> bytes:
        """The stage's answer to a serialised ModelInferRequest, its id the caller's;
        ``carried``: its trace context (``shared.tracing.current_carrier``). The
        stage's error as its MeshError, Unavailable if the stream broke,
        RESOURCE_EXHAUSTED for a request over the largest message (unsent), and
        NotForwarding when the server does not forward (nothing was sent)."""
        if self._accepted.done():  # every request but the first few: no wait to set up
            accepted = self._accepted.result()
        else:
            # Shielded: a caller that goes away must not cancel what the others wait on.
            try:
                waiting = asyncio.shield(self._accepted)
                accepted = await asyncio.wait_for(waiting, ACCEPT_TIMEOUT_S)
            except TimeoutError:
                accepted = False  # a server that sends its headers with its first answer
        if not accepted:
            self.cancel()
            raise NotForwarding
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        tag = f"~{next(self._tags)}"
        pieces: tuple[bytes, ...] = (request, id_field(tag))
        if carried:
            pieces += (string_parameters(carried),)
        size = sum(map(len, pieces))
        size = packed_size(size) if self.packed else size
        if size > self._limit:
            raise Overloaded(f"request larger than max ({size} vs. {self._limit} bytes)")
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[tag] = answer
        self._sent += 1
        self._waiting.append((tag, pieces, size))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="forward-stream-write")
        try:
            return with_id(await answer, caller_id)
        except asyncio.CancelledError:
            if answer.cancelled():  # unanswered: the caller's cancel reached it
                self._withdraw(tag)
            raise
        finally:
            del self._pending[tag]
            if not self._pending:
                self._went_idle()

    def _withdraw(self, tag: str) -> None:
        """The caller of request ``tag`` went away: unsent, it stays unsent; sent
        on a packed stream, the next message withdraws it, and the stage stops
        it (another server has no way to be told: it answers, unread)."""
        unsent = [waiting for waiting in self._waiting if waiting[0] != tag]
        if len(unsent) < len(self._waiting):
            self._waiting = unsent
            return
        if not self.packed or self._reader.done():
            return
        self._withdrawn.append(tag)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="forward-stream-write")

    async def _write(self) -> None:
        """Write the waiting requests until none waits: one message each, or on a
        packed stream as many to a message as the largest message takes. A
        failed write fails the requests it carried."""
        while self._waiting or self._withdrawn:
            taken = 1
            withdrawn, self._withdrawn = self._withdrawn, []
            ids = repeated_pieces(2, [(tag.encode(),) for tag in withdrawn]) if withdrawn else []
            if self.packed:
                room = self._limit - sum(map(len, ids))
                taken = fitting_count((size for _, _, size in self._waiting), room)
                if ids and taken and self._waiting[0][2] > room:
                    taken = 0  # beside the withdrawals it would pass the limit: they go alone
            batch, self._waiting = self._waiting[:taken], self._waiting[taken:]
            try:
                async with self._writing:
                    if self._wrote_last:
                        raise asyncio.InvalidStateError("the stream was half-closed")
                    if self.packed:
                        message = repeated_pieces(1, [pieces for _, pieces, _ in batch]) + ids
                        if isinstance(self._call, StreamCall):  # joined as it goes out
                            await self._call.write_parts(message)
                        else:
                            await self._call.write(b"".join(message))
                    else:
                        await self._call.write(b"".join(batch[0][1]))
            except grpc.aio.AioRpcError as exc:
                self._fail([tag for tag, _, _ in batch], _broken(exc))
            except (asyncio.InvalidStateError, grpc.aio.UsageError):
                unsent = Unavailable("the stage stream closed with the request unsent")
                self._fail([tag for tag, _, _ in batch], unsent)

    def _fail(self, tags: list[str], error: MeshError) -> None:
        for tag in tags:
            waiting = self._pending.get(tag)
            if waiting is not None and not waiting.done():
                waiting.set_exception(error)

    def _went_idle(self) -> None:
        """No request in flight: close now if retiring, else after STREAM_SECONDS
        unless a request comes first (an idle stream would hold a stage's drain)."""
        if self._closing:
            self._finish()
        elif self._idle is None:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(STREAM_SECONDS, self._finish)

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the stream has ended and its answers are all in."""
        self._reader.add_done_callback(lambda _: callback())

    def cancel(self) -> None:
        """End the stream now (its replica went away); requests on it fail Unavailable."""
        self._closing = True
        if self._idle is not None:
            self._idle.cancel()
        if self._writer is not None:
            self._writer.cancel()
        self._call.cancel()

    def _finish(self) -> None:
        # Closed, not cancelled: a cancel costs the stage a logged traceback.
        self._closing = True
        if self._closer is None:
            self._closer = asyncio.create_task(self._done_writing(), name="forward-stream-close")

    async def _done_writing(self) -> None:
        try:
            async with self._writing:
                self._wrote_last = True
                await self._call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # it ended already

    async def _read(self) -> None:
        ended: MeshError = Unavailable("the stage ended the forwarding stream")
        try:
            metadata = await self._call.initial_metadata()
            accepted = any(k == FORWARD_HEADER for k, _ in metadata or ())
            if not self._accepted.done():
                self._accepted.set_result(accepted)
            if not accepted:
                self._call.cancel()
                return
            async for message in self._call:
                self._place(message)
        except grpc.aio.AioRpcError as exc:
            ended = _broken(exc)
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and not self._accepted.done():
                self._accepted.set_result(False)  # a v2 server without streams
        except asyncio.CancelledError:
            ended = Unavailable("the stage stream was cancelled")
            raise
        finally:
            if not self._accepted.done():
                self._accepted.set_exception(ended)
            for answer in self._pending.values():
                if not answer.done():
                    answer.set_exception(ended)

    def _place(self, message: bytes) -> None:
        """Give each answer a message carries to the request waiting for it."""
        if not self.packed:
            self._answer(message)
            return
        try:
            answers = repeated_field(message, 1)
        except WireError:
            return  # not ours to place; its requests fail when the stream ends
        for answer in answers:
            self._answer(answer)

    def _answer(self, message: bytes) -> None:
        try:
            error, answer = stream_answer(message)
            tag = infer_header(answer).id
        except WireError:
            return  # not ours to place; its request fails when the stream ends
        waiting = self._pending.get(tag)
        if waiting is None or waiting.done():
            return
        if error:
            waiting.set_exception(stream_failure(pb.ModelStreamInferResponse.FromString(message)))
        else:
            waiting.set_result(answer)


def _broken(exc: grpc.aio.AioRpcError) -> MeshError:
    """The error of the requests a stream carried when the call itself failed.

    A stage answers a request's own error in-band; a failure of the whole call
    means the stream broke (the stage went away mid-write: gRPC may report that
    as INTERNAL or UNKNOWN), so its requests went unanswered: UNAVAILABLE, which
    the router retries on another replica."""
    if exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return Unavailable(f"the stage stream broke: {exc.details() or exc.code().name}")
    return failure(exc)
