"""Streams through the orchestrator: decoupled models and streaming ensembles.

A decoupled model (an LLM) answers one request with many responses over
ModelStreamInfer. Calling one directly is relayed response by response; in an
ensemble, the steps after the decoupled step run once per streamed response.
Closing a relay (the caller went away, or the ensemble saw FINISH_REASON)
cancels the stage call, which aborts the generation inside the engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import Step, WireTensor
from services.orchestrator.router import StageRouter
from services.orchestrator.stage_stream import StageStream
from shared.errors import MeshError, Unavailable
from shared.stream_messages import stream_failure, until_final


async def relay(
    router: StageRouter,
    request: pb.ModelInferRequest,
    opened: Callable[[], None] | None = None,
) -> AsyncGenerator[pb.ModelInferResponse, None]:
    """Forward one request to a decoupled model; yield its responses until final.

    ``opened`` runs once the request is on its way.
    """
    stream, first = await _first_response(router, request, opened)

    async def messages() -> AsyncIterator[pb.ModelStreamInferResponse]:
        # A stage ends the stream after a decoupled model's last response; it marks
        # that response final only where the model or the caller asked for one.
        message = first
        while message is not None:
            yield message
            message = await stream.read()

    try:
        async for response in until_final(messages()):
            yield response
    finally:
        stream.cancel()


async def _first_response(
    router: StageRouter, request: pb.ModelInferRequest, opened: Callable[[], None] | None
) -> tuple[StageStream, pb.ModelStreamInferResponse | None]:
    """Send ``request`` on a stage stream; the stream and its first message (None:
    the stage ended the stream without one).

    A stream opened ahead may have ended meanwhile (its replica drained), so
    UNAVAILABLE before any response is retried once, on a new stream. Later
    it is not: once tokens flow, a retry would repeat them.
    """
    for attempt in range(2):
        stream = router.stream(request.model_name)
        stream.send(request)
        stream.done_sending()
        if opened is not None and attempt == 0:
            opened()
        try:
            return stream, await stream.read()
        except MeshError as exc:
            stream.cancel()
            _raise_unless_retried(exc, attempt)
        except BaseException:
            stream.cancel()
            raise
    raise AssertionError("unreachable")


def _raise_unless_retried(exc: MeshError, attempt: int) -> None:
    """Raise ``exc``, unless it is a first attempt's Unavailable (the replica went away)."""
    if attempt == 0 and isinstance(exc, Unavailable):
        return
    raise exc


def wire_outputs(response: pb.ModelInferResponse) -> dict[str, WireTensor]:
    """A response's outputs in wire form."""
    return {
        t.name: WireTensor(t.datatype, tuple(t.shape), raw)
        for t, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


class StepStreams:
    """Open ModelStreamInfer streams that carry one generation's repeated steps.

    A streaming ensemble runs the steps after its decoupled step once per
    generated response (the detokenizer once per token). A new RPC each time
    costs a stage server much more CPU than one more message on an open stream
    (docs/performance.md), so each step gets one
    stream for the whole generation. A step runs once at a time within one
    generation, so a stream has at most one request in flight and its next
    message is that request's answer. Steps are stateless: a stream that breaks
    with UNAVAILABLE (its replica went away) is reopened, on the replica the
    router picks then, and the request sent again, once.
    """

    def __init__(self, router: StageRouter) -> None:
        self._router = router
        self._streams: dict[int, StageStream] = {}

    async def infer(self, step: int, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        """Send ``request`` on step ``step``'s stream (taken on first use); its answer."""
        for attempt in range(2):
            stream = self._streams.get(step)
            if stream is None:
                stream = self._streams[step] = self._router.stream(request.model_name)
            try:
                message = await stream.ask(request)
            except MeshError as exc:
                del self._streams[step]
                stream.cancel()
                _raise_unless_retried(exc, attempt)
                continue
            if message.error_message:
                raise stream_failure(message)
            response: pb.ModelInferResponse = message.infer_response
            return response
        raise AssertionError("unreachable")

    def open_soon(self, steps: Iterable[Step]) -> None:
        """Take the streams of ``steps`` now: where no spare waits, a stage sets a
        new one up while the generation starts, instead of when the first token
        waits for it. Called once the generation's own request is on its way, so
        that request is not queued behind these."""
        for step in steps:
            if step.index not in self._streams:
                self._streams[step.index] = self._router.stream(step.model)

    def close(self) -> None:
        """End every stream (the stages see their callers leave)."""
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
