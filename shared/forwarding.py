"""A stage's side of the requests a hop forwards to it on one open stream.

The orchestrator forwards a stage model's ModelInfer requests, still
serialised, as messages on an open stream rather than as RPCs of their own (its
side: services/orchestrator/forward_stream.py). Two streams carry them:

- ``meshserve.v1.ForwardingService/Forward`` (protos/meshserve/v1/forwarding.proto):
  as many requests to a message as were waiting when it was written, and as
  many answers to a message back as were ready, each side splitting what would
  make a message over its largest into several. Under load one message on an
  HTTP/2 stream costs each side about what a small model's request costs, so
  a pack of them costs little more than one; a lone request is a message alone,
  written at once.
- ``ModelStreamInfer`` with ``FORWARD_HEADER``: one request to a message each
  way, for a hop that has no packs.

Either way each request is answered as ModelInfer would answer it, by a task
of its own: its statistics, its error (the answer's ``error_message``, never
the end of the stream) and its trace span are its own. The tracing interceptor
makes each request's trace context current as the request is taken from its
message (``Pack.before_each``), and ends its span as its answer is written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from inference import grpc_service_pb2 as pb
from meshserve.v1 import forwarding_pb2
from shared.errors import Cancelled, InvalidArgument, MeshError, Unavailable
from shared.stream_tasks import StreamTasks
from shared.wireformat import (
    NOT_A_REQUEST,
    WireError,
    encode_varint,
    infer_header,
    length_delimited,
    repeated,
)

log = logging.getLogger(__name__)

FORWARD_HEADER = "x-meshserve-forward"
"""Metadata of a stream that forwards unary requests (the orchestrator's): each
request is answered exactly as ModelInfer answers it, with no final-response
flag, and the server says it does so by sending the header back in its initial
metadata (a server that does not is spoken to another way)."""
FORWARD_UNARY = "unary"
FORWARDING_SERVICE = forwarding_pb2.DESCRIPTOR.services_by_name["ForwardingService"].full_name
PACKED_METHOD = f"/{FORWARDING_SERVICE}/Forward"
_REQUESTS = _ANSWERS = 1
"""Field number of the requests (ForwardRequest) and the answers (ForwardResponse)."""
_WITHDRAWN = 2
"""Field number of the withdrawn requests' ids (ForwardRequest)."""

Answer = Callable[
    [pb.ModelInferRequest, Any, "MeshError | None"], Awaitable[pb.ModelStreamInferResponse]
]
"""A request's answer or its error (``BaseServicer.answer_forwarded``); the third
argument is an error the request already has (it did not decode)."""


class Pack:
    """The requests of one ForwardRequest message, in order, and the ids of
    earlier requests it withdraws."""

    __slots__ = ("before_each", "refused", "requests", "withdrawn")

    def __init__(self, requests: list[pb.ModelInferRequest], withdrawn: Iterable[str] = ()) -> None:
        self.requests = requests
        self.withdrawn = list(withdrawn)
        """Ids of requests sent earlier on the stream whose callers went away."""
        self.refused: dict[str, MeshError] = {}
        """Request id -> its error, for a request that did not decode (a stand-in
        with its model name and id is in ``requests``)."""
        self.before_each: Callable[[pb.ModelInferRequest], object] | None = None
        """Run on each request as it is taken from the pack (by the tracing interceptor)."""

    def __iter__(self) -> Iterator[pb.ModelInferRequest]:
        for request in self.requests:
            if self.before_each is not None:
                self.before_each(request)
            yield request

    def __len__(self) -> int:
        return len(self.requests)


def read_pack(data: bytes) -> Pack:
    """A ForwardRequest message as its requests; one that does not decode is kept
    as a stand-in and refused on its own (its neighbours are answered as usual).
    WireError when the message itself is malformed."""
    try:
        message = forwarding_pb2.ForwardRequest.FromString(data)
        return Pack(list(message.requests), message.withdrawn)
    except DecodeError:
        pass
    pack = Pack([])
    for number, start, end in length_delimited(data):
        if number == _WITHDRAWN:
            pack.withdrawn.append(data[start:end].decode("utf-8", "replace"))
            continue
        if number != _REQUESTS:
            raise WireError(f"unexpected field {number}")
        raw = data[start:end]
        try:
            pack.requests.append(pb.ModelInferRequest.FromString(raw))
        except DecodeError:
            header = infer_header(raw)
            pack.requests.append(
                pb.ModelInferRequest(
                    model_name=header.model_name, model_version=header.model_version, id=header.id
                )
            )
            pack.refused[header.id] = InvalidArgument(NOT_A_REQUEST)
    return pack


def write_answers(answers: list[pb.ModelStreamInferResponse]) -> bytes:
    """Answers as one ForwardResponse message."""
    return repeated(_ANSWERS, [answer.SerializeToString() for answer in answers])


def packed_size(size: int) -> int:
    """The bytes a serialised message of ``size`` takes as one entry of a pack (a
    ForwardRequest's or ForwardResponse's repeated field 1: its tag and length)."""
    return 1 + len(encode_varint(size)) + size


def fitting_count(sizes: Iterable[int], limit: int) -> int:
    """How many entries of these sizes, from the first, one message of at most
    ``limit`` bytes takes; at least one (an entry over the limit alone is its
    sender's to refuse)."""
    total, count = 0, 0
    for size in sizes:
        total += size
        if count and total > limit:
            break
        count += 1
    return count


class AnswerPacker:
    """Writes answers on a Forward stream: at once when no write is under way
    (after the other requests ready to run, when ``busy``), else with the others
    that are ready when it ends, as few messages as ``limit`` (the largest
    message, in bytes) allows."""

    def __init__(self, context: Any, busy: Callable[[], bool], limit: int) -> None:
        self._context = context
        self._busy = busy
        self._limit = limit
        self._ready: list[pb.ModelStreamInferResponse] = []
        self._writing = False

    async def send(self, answer: pb.ModelStreamInferResponse) -> None:
        """Write ``answer`` now, or leave it to the write under way (which takes
        it in its next message)."""
        self._ready.append(answer)
        if self._writing:
            return
        self._writing = True
        try:
            if self._busy():
                # The stream's other requests that are ready to run answer first,
                # into this message (a lone request's answer goes at once).
                await asyncio.sleep(0)
            while self._ready:
                await self._context.write(self._next_message())
        finally:
            self._writing = False

    def _next_message(self) -> list[pb.ModelStreamInferResponse]:
        """The ready answers that fit in one message, oldest first."""
        sizes = (packed_size(answer.ByteSize()) for answer in self._ready)
        count = fitting_count(sizes, self._limit)
        answers, self._ready = self._ready[:count], self._ready[count:]
        return answers


def one_at_a_time(context: Any) -> Callable[[pb.ModelStreamInferResponse], Awaitable[None]]:
    """A writer of stream messages on ``context`` that lets one write at a time
    reach the call (concurrent writes on a grpc.aio call are refused)."""
    writing = asyncio.Lock()  # one message at a time on the call

    async def send(answer: pb.ModelStreamInferResponse) -> None:
        async with writing:
            await context.write(answer)

    return send


async def serve_forwarded(
    answer: Answer, messages: AsyncIterator[Any], context: Any, *, packed: bool, limit: int
) -> None:
    """Answer every request of a forwarding stream (``messages``: Packs when
    ``packed``, else requests), concurrently, each answer written once ready, no
    message over ``limit`` bytes. When the caller goes away, this is cancelled and
    so is every request still running."""
    await context.send_initial_metadata(((FORWARD_HEADER, FORWARD_UNARY),))
    tasks = StreamTasks()
    send: Callable[[pb.ModelStreamInferResponse], Awaitable[None]] = (
        AnswerPacker(context, lambda: len(tasks) > 1, limit).send
        if packed
        else one_at_a_time(context)
    )

    handler = asyncio.current_task()
    unwritten: list[Exception] = []

    async def one(request: pb.ModelInferRequest, refused: MeshError | None) -> None:
        try:
            reply = await answer(request, context, refused)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or not tasks.withdrawn(task):
                raise
            task.uncancel()  # its caller went away: its answer says so (and ends its span)
            reply = await answer(request, context, Cancelled("the caller withdrew the request"))
        try:
            await send(reply)
        except Exception as exc:
            # An answer that cannot be written would leave its caller waiting for
            # good: the whole stream ends instead, and the caller hears at once of
            # every request it carried (the router may retry them elsewhere).
            if not unwritten and handler is not None:
                unwritten.append(exc)
                log.exception("a forwarded answer could not be written; the stream ends")
                handler.cancel()

    try:
        async for message in messages:
            if not packed:
                tasks.start(one(message, None))
                continue
            for request in message:
                refused = message.refused.get(request.id) if message.refused else None
                tasks.start(one(request, refused), request.id)
            for withdrawn in message.withdrawn:
                tasks.withdraw(withdrawn)
        await tasks.finish()
    except asyncio.CancelledError:
        if not unwritten or handler is None:
            raise
        handler.uncancel()
        raise Unavailable("the stage could not write an answer; the stream ended") from None
    finally:
        await tasks.cancel()


def add_forwarding(answer: Answer, server: grpc.aio.Server, limit: int) -> None:
    """Serve ``ForwardingService/Forward`` on ``server``, each request answered by
    ``answer``, no message of answers over ``limit`` bytes (the server's own)."""

    async def forward(packs: AsyncIterator[Pack], context: Any) -> None:
        await serve_forwarded(answer, packs, context, packed=True, limit=limit)

    handlers = {
        "Forward": grpc.stream_stream_rpc_method_handler(
            forward, request_deserializer=read_pack, response_serializer=write_answers
        )
    }
    generic = grpc.method_handlers_generic_handler(FORWARDING_SERVICE, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(FORWARDING_SERVICE, handlers)
