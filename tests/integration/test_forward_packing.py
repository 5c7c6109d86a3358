"""Forwarded requests several to a message (meshserve.v1.ForwardingService).

A real stage (the python backend's add_sub) on port 0 in the test's event loop,
spoken to with a raw Forward call and with the orchestrator's ForwardStream; and
a StageRouter against v2 servers that have no packs (an older stage) or no
streams at all (any other v2 server).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from services.orchestrator.endpoint import StageAddress
from services.orchestrator.forward_stream import ForwardStream
from services.orchestrator.router import StageRouter
from shared import forwarding
from shared.errors import MeshError
from shared.h2grpc.client import LeanChannel
from shared.h2grpc.server import LeanServer
from shared.interceptors import ErrorInterceptor
from shared.servicer import FORWARD_HEADER, BaseServicer
from shared.stream_messages import STATUS_CODE, stream_failure
from shared.tensors import decode_outputs, encode_inputs
from shared.wireformat import repeated, repeated_field, with_id
from tests.conftest import DATA
from tests.in_process import Mesh, running


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    shutil.copytree(DATA / "models" / "add_sub", tmp_path / "add_sub")
    return tmp_path


def add_sub(value: float, model: str = "add_sub", rows: int = 2) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    a = np.full((rows, 4), value, np.float32)
    encode_inputs(request, {"INPUT0": a, "INPUT1": np.ones((rows, 4), np.float32)})
    return request


def in_stage(repo: Path, scenario: Any) -> None:
    async def run() -> None:
        async with running(repo) as mesh:
            await asyncio.wait_for(scenario(mesh), 30)

    asyncio.run(run())


def sum_of(answer: bytes) -> list[list[float]]:
    outputs: list[list[float]] = decode_outputs(pb.ModelInferResponse.FromString(answer))[
        "OUTPUT0"
    ].tolist()
    return outputs


def test_a_bad_request_packed_among_good_ones_fails_alone(repo: Path) -> None:
    """One message with good requests, one that does not decode, one the model
    refuses and one for an unknown model: each gets its own answer or error
    (with its status code), the stream carries on, and the model's statistics
    count the requests it ran."""
    undecodable = add_sub(9).SerializeToString() + b"\x2a\x02\xff\xff"  # inputs: garbage
    wrong_shape = add_sub(1)
    wrong_shape.inputs[0].shape[:] = [2, 3]
    pack = [
        with_id(add_sub(1).SerializeToString(), "good-1"),
        with_id(undecodable, "undecodable"),
        with_id(wrong_shape.SerializeToString(), "wrong-shape"),
        with_id(add_sub(1, model="nothing").SerializeToString(), "unknown"),
        with_id(add_sub(5).SerializeToString(), "good-2"),
    ]

    async def scenario(mesh: Mesh) -> None:
        async with grpc.aio.insecure_channel(mesh.stages[0].address) as channel:
            method = channel.stream_stream(forwarding.PACKED_METHOD)
            call = method(metadata=((FORWARD_HEADER, "unary"),))
            assert (FORWARD_HEADER, "unary") in list(await call.initial_metadata())
            await call.write(repeated(1, pack))
            answers: dict[str, pb.ModelStreamInferResponse] = {}
            while len(answers) < len(pack):
                for raw in repeated_field(await call.read(), 1):
                    answer = pb.ModelStreamInferResponse.FromString(raw)
                    answers[answer.infer_response.id] = answer
            good = answers["good-1"].infer_response.SerializeToString()
            assert sum_of(good) == [[2.0] * 4] * 2
            assert not answers["good-2"].error_message
            errors: dict[str, MeshError] = {
                key: stream_failure(answers[key]) for key in ("undecodable", "wrong-shape")
            }
            errors["unknown"] = stream_failure(answers["unknown"])
            assert errors["undecodable"].code == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid inference.ModelInferRequest" in errors["undecodable"].message
            assert errors["wrong-shape"].code == grpc.StatusCode.INVALID_ARGUMENT
            assert "INPUT0" in errors["wrong-shape"].message
            assert errors["unknown"].code == grpc.StatusCode.NOT_FOUND
            assert STATUS_CODE in answers["unknown"].infer_response.parameters
            # The stream carries on after its bad requests.
            await call.write(repeated(1, [with_id(add_sub(2).SerializeToString(), "after")]))
            (last,) = repeated_field(await call.read(), 1)
            assert pb.ModelStreamInferResponse.FromString(last).infer_response.id == "after"
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="add_sub"))
            assert stats.model_stats[0].inference_stats.success.count == 3

    in_stage(repo, scenario)


def _pack_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of requests in each pack the stage reads, filled in as they come."""
    sizes: list[int] = []
    read_pack = forwarding.read_pack

    def recorded(data: bytes) -> forwarding.Pack:
        pack = read_pack(data)
        sizes.append(len(pack))
        return pack

    monkeypatch.setattr(forwarding, "read_pack", recorded)
    return sizes


def test_a_lone_request_goes_alone_and_waiting_ones_together(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request with nothing else waiting is written at once as a message of its
    own (nothing waits for company); requests that arrive while a message is being
    written go out together in the next one, and each caller gets its own answer
    under its own id."""
    sizes = _pack_sizes(monkeypatch)

    async def scenario(mesh: Mesh) -> None:
        async with grpc.aio.insecure_channel(mesh.stages[0].address) as channel:
            stream = ForwardStream(channel, packed=True)
            lone = await stream.infer(add_sub(3).SerializeToString(), "lone")
            assert pb.ModelInferResponse.FromString(lone).id == "lone"
            assert sizes == [1]
            answers = await asyncio.gather(
                *(stream.infer(add_sub(i).SerializeToString(), f"c{i}") for i in range(8))
            )
            for index, answer in enumerate(answers):
                assert pb.ModelInferResponse.FromString(answer).id == f"c{index}"
                assert sum_of(answer) == [[index + 1.0] * 4] * 2
            assert sizes == [1, 8]
            stream.cancel()

    in_stage(repo, scenario)


class OlderStage(BaseServicer):
    """A v2 server that forwards on ModelStreamInfer but has no ForwardingService."""

    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        model = pb.RepositoryIndexResponse.ModelIndex(name="m", version="1", state="READY")
        return pb.RepositoryIndexResponse(models=[model])

    async def ModelInfer(self, request: Any, context: Any) -> pb.ModelInferResponse:
        return pb.ModelInferResponse(model_name="m", id=request.id, model_version="1")


class OtherServer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Any other v2 server: unary calls only (no stream answers a forwarding call)."""

    RepositoryIndex = OlderStage.RepositoryIndex
    ModelInfer = OlderStage.ModelInfer

    async def ModelStreamInfer(self, requests: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no streams here")


@pytest.mark.parametrize("server", [OlderStage, OtherServer], ids=["no-packs", "no-streams"])
def test_a_server_without_packs_is_still_served(server: type) -> None:
    """The router falls back to one request per message on ModelStreamInfer, and
    to ModelInfer where no stream forwards; the answers are the same."""

    async def scenario() -> None:
        grpc_server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(server(), grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        router = StageRouter(
            [StageAddress("s", f"127.0.0.1:{port}")],
            channels_per_endpoint=1,
            max_message_bytes=1 << 20,
            tracer=trace.NoOpTracer(),
            refresh_interval_s=300,
        )
        try:
            await router.start()
            for caller in ("first", "second"):
                request = pb.ModelInferRequest(model_name="m", id=caller).SerializeToString()
                answer = await asyncio.wait_for(router.forward("m", request, None, caller), 10)
                assert pb.ModelInferResponse.FromString(answer).id == caller
            (endpoint,) = router.endpoints
            assert not endpoint.packs
            assert endpoint.forwards_on_streams is (server is OlderStage)
        finally:
            await router.stop()
            await grpc_server.stop(0)

    asyncio.run(scenario())


def test_on_a_busy_stream_a_request_is_written_without_waiting_for_company(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With requests held at the stage, a new one is written at once in a message
    of its own and answered while they are still held: nothing waits for others
    to share its message (a wait would hold the stage idle)."""
    held = 4
    sizes = _pack_sizes(monkeypatch)

    async def scenario() -> None:
        release, all_held, seen = asyncio.Event(), asyncio.Event(), asyncio.Event()
        arrived: list[str] = []

        class Holding(OlderStage):
            async def ModelInfer(self, request: Any, context: Any) -> pb.ModelInferResponse:
                arrived.append(request.model_name)
                if request.model_name == "hold":
                    if arrived.count("hold") == held:
                        all_held.set()
                    await release.wait()
                seen.set()
                return pb.ModelInferResponse(model_name=request.model_name, id=request.id)

        server = grpc.aio.server()
        stage = Holding()
        forwarding.add_forwarding(stage.answer_forwarded, server, stage.max_message_bytes)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = ForwardStream(channel, packed=True)

                def infer(model: str, caller: str) -> asyncio.Task[bytes]:
                    request = pb.ModelInferRequest(model_name=model).SerializeToString()
                    return asyncio.create_task(stream.infer(request, caller))

                holding = [infer("hold", f"h{i}") for i in range(held)]
                await asyncio.wait_for(all_held.wait(), 5)
                first = infer("m", "first")
                await asyncio.wait_for(seen.wait(), 5)  # no other request is coming
                answer = await asyncio.wait_for(first, 5)
                assert pb.ModelInferResponse.FromString(answer).id == "first"
                assert not any(task.done() for task in holding)
                release.set()
                await asyncio.wait_for(asyncio.gather(*holding), 5)
                stream.cancel()
        finally:
            await server.stop(0)
        assert sizes == [held, 1]

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["asyncio", "grpcio"])
def test_an_answer_that_cannot_be_written_ends_the_stream_and_nothing_hangs(kind: str) -> None:
    """A stage whose write of one answer fails (here: the answer is not a message)
    ends the whole stream UNAVAILABLE, so its callers hear at once and may retry,
    where the answer would otherwise be lost and its caller wait for good; the
    stage serves the next stream as before. On either gRPC server a stage may run."""

    async def answer(request: pb.ModelInferRequest, context: Any, refused: Any) -> Any:
        if request.model_name == "unwritable":
            return object()
        reply = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        return pb.ModelStreamInferResponse(infer_response=reply)

    async def scenario() -> None:
        limit = 1 << 22
        server: Any = (
            LeanServer([ErrorInterceptor()], limit)
            if kind == "asyncio"
            else grpc.aio.server(interceptors=[ErrorInterceptor()])
        )
        forwarding.add_forwarding(answer, server, limit)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = LeanChannel(f"127.0.0.1:{port}", limit)
        try:

            def infer(stream: ForwardStream, model: str) -> Any:
                request = pb.ModelInferRequest(model_name=model).SerializeToString()
                return stream.infer(request, model)

            stream = ForwardStream(channel, packed=True, limit=limit)
            calls = [infer(stream, "unwritable"), infer(stream, "m")]
            unwritable, _ = await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), 5
            )
            assert isinstance(unwritable, MeshError), unwritable
            assert unwritable.code == grpc.StatusCode.UNAVAILABLE
            assert "could not write an answer" in unwritable.message
            after = ForwardStream(channel, packed=True, limit=limit)
            answer_bytes = await asyncio.wait_for(infer(after, "m"), 5)
            assert pb.ModelInferResponse.FromString(answer_bytes).id == "m"
            after.cancel()
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())
