"""A caller that goes away takes its request out of the stage's queue.

Through the orchestrator, a request with a deadline is a ModelInfer call of its
own to the stage, and one without rides a stream of forwarded requests
(services/orchestrator/forward_stream.py); either way, once its caller cancels
(or, at the orchestrator's HTTP front door, closes its connection), the stage
stops it, so that work nobody waits for holds no place in a bounded queue that
other callers need. A real stage (the python backend's ``slow``,
its queue bounded to 4) and the orchestrator, in the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest

from gateway.http.in_orchestrator import HttpDoor, OrchestratorHttpConfig
from inference import grpc_service_pb2 as pb
from services.orchestrator.forward_stream import ForwardStream
from shared import forwarding
from shared.errors import MeshError
from shared.stream_messages import stream_failure
from shared.tensors import decode_outputs, encode_inputs
from shared.wireformat import id_field, repeated, repeated_field, with_id
from tests.conftest import DATA
from tests.in_process import Mesh, running

QUEUE = 4
"""The stage's bound on queued requests of ``slow``."""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    shutil.copytree(DATA / "models" / "slow", tmp_path / "slow")
    config = tmp_path / "slow" / "config.pbtxt"
    bound = f'parameters {{ key: "max_queue_size" value {{ string_value: "{QUEUE}" }} }}\n'
    config.write_text(config.read_text() + bound)
    return tmp_path


def slow(ms: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="slow")
    encode_inputs(request, {"MS": np.array([ms], np.int32)})
    return request


def waited(answer: pb.ModelInferResponse) -> int:
    return int(decode_outputs(answer)["MS_OUT"][0])


@pytest.mark.parametrize("deadline_s", [None, 30.0], ids=["forwarded", "own-call"])
def test_cancelled_requests_leave_the_stage_queue(repo: Path, deadline_s: float | None) -> None:
    """Both instances busy, the queue filled by a caller who then cancels: another
    caller's requests are all taken (none RESOURCE_EXHAUSTED) and answered."""

    async def scenario(mesh: Mesh) -> None:
        async def infer(ms: int, deadline: float | None = None) -> pb.ModelInferResponse:
            return await mesh.v2.ModelInfer(slow(ms), timeout=deadline)

        busy = [asyncio.create_task(infer(1500)) for _ in range(2)]
        await asyncio.sleep(0.3)
        gone = [asyncio.create_task(infer(1000, deadline_s)) for _ in range(QUEUE)]
        await asyncio.sleep(0.3)
        for call in gone:
            call.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        await asyncio.sleep(0.2)
        others = await asyncio.gather(*(infer(i) for i in range(QUEUE)))
        assert [waited(answer) for answer in others] == list(range(QUEUE))
        assert [waited(await call) for call in busy] == [1500, 1500]

    async def run() -> None:
        async with running(repo) as mesh:
            await asyncio.wait_for(scenario(mesh), 30)

    asyncio.run(run())


async def _hung_up(address: str, ms: int) -> None:
    """A KServe v2 REST call to ``slow`` whose client closes its connection 0.3 s
    after sending it, unanswered."""
    body = json.dumps({"inputs": [{"name": "MS", "shape": [1], "datatype": "INT32", "data": [ms]}]})
    head = (
        f"POST /v2/models/slow/infer HTTP/1.1\r\nHost: {address}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head.encode() + body.encode())
    await writer.drain()
    with pytest.raises(TimeoutError):  # no answer yet: the request waits at the stage
        await asyncio.wait_for(reader.read(1), 0.3)
    writer.close()
    await writer.wait_closed()


def test_a_rest_client_that_hangs_up_leaves_the_stage_queue(repo: Path) -> None:
    """As above through the orchestrator's own HTTP front door: a client that closes
    its connection while its request waits at the stage takes that request out of
    the queue (the door's handler is cancelled, and with it the core's call)."""

    async def scenario(mesh: Mesh) -> None:
        config = OrchestratorHttpConfig(http_port=0, grace_period_s=1.0)
        door = HttpDoor(config, mesh.core, mesh.orchestrator.parts)
        address = await door.start(mesh.orchestrator.address)

        async def infer(ms: int) -> pb.ModelInferResponse:
            return await mesh.v2.ModelInfer(slow(ms))

        try:
            busy = [asyncio.create_task(infer(1500)) for _ in range(2)]
            await asyncio.sleep(0.3)
            await asyncio.gather(*(_hung_up(address, 1000) for _ in range(QUEUE)))
            await asyncio.sleep(0.2)
            others = await asyncio.gather(*(infer(i) for i in range(QUEUE)))
            assert [waited(answer) for answer in others] == list(range(QUEUE))
            assert [waited(await call) for call in busy] == [1500, 1500]
        finally:
            await door.drain()

    async def run() -> None:
        async with running(repo) as mesh:
            await asyncio.wait_for(scenario(mesh), 30)

    asyncio.run(run())


def test_a_withdrawn_request_is_answered_cancelled_and_the_stream_goes_on(repo: Path) -> None:
    """On a raw Forward stream: requests queued behind busy instances, withdrawn
    by a later message, are answered CANCELLED at once; the rest as usual."""

    async def scenario(mesh: Mesh) -> None:
        async with grpc.aio.insecure_channel(mesh.stages[0].address) as channel:
            method = channel.stream_stream(forwarding.PACKED_METHOD)
            call = method(metadata=((forwarding.FORWARD_HEADER, "unary"),))
            busy = [with_id(slow(1500).SerializeToString(), f"busy-{i}") for i in range(2)]
            queued = [with_id(slow(1000).SerializeToString(), f"gone-{i}") for i in range(3)]
            await call.write(repeated(1, busy + queued))
            await asyncio.sleep(0.3)
            await call.write(repeated(2, [f"gone-{i}".encode() for i in range(3)]))
            answers: dict[str, pb.ModelStreamInferResponse] = {}
            loop = asyncio.get_running_loop()
            started = loop.time()
            while len(answers) < 3:
                for raw in repeated_field(await call.read(), 1):
                    answer = pb.ModelStreamInferResponse.FromString(raw)
                    answers[answer.infer_response.id] = answer
            assert loop.time() - started < 0.5  # not after the busy ones
            assert sorted(answers) == ["gone-0", "gone-1", "gone-2"]
            for answer in answers.values():
                error = stream_failure(answer)
                assert isinstance(error, MeshError)
                assert error.code == grpc.StatusCode.CANCELLED, answer.error_message
            while len(answers) < 5:
                for raw in repeated_field(await call.read(), 1):
                    answer = pb.ModelStreamInferResponse.FromString(raw)
                    answers[answer.infer_response.id] = answer
            assert not answers["busy-0"].error_message and not answers["busy-1"].error_message
            await call.done_writing()

    async def run() -> None:
        async with running(repo) as mesh:
            await asyncio.wait_for(scenario(mesh), 30)

    asyncio.run(run())


def test_a_withdrawal_never_makes_a_message_larger_than_the_limit(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A withdrawal written with the next request must still fit the largest
    message: beside a request that fills the limit alone, it goes in a message of
    its own (over the limit, the stage would refuse the message and fail every
    request on the stream)."""
    sizes: list[int] = []
    read_pack = forwarding.read_pack

    def recorded(data: bytes) -> forwarding.Pack:
        sizes.append(len(data))
        return read_pack(data)

    monkeypatch.setattr(forwarding, "read_pack", recorded)

    async def scenario(mesh: Mesh) -> None:
        full = slow(1).SerializeToString()
        limit = forwarding.packed_size(len(full) + len(id_field("~1")))  # the second tag
        async with grpc.aio.insecure_channel(mesh.stages[0].address) as channel:
            stream = ForwardStream(channel, packed=True, limit=limit)
            gone = asyncio.create_task(stream.infer(slow(1000).SerializeToString(), "gone"))
            await asyncio.sleep(0.3)  # written, and running at the stage
            kept = asyncio.create_task(stream.infer(full, "kept"))
            gone.cancel()  # the withdrawal waits to be written with ``kept``
            assert waited(pb.ModelInferResponse.FromString(await kept)) == 1
            with pytest.raises(asyncio.CancelledError):
                await gone
            stream.cancel()
        assert len(sizes) == 3 and max(sizes) <= limit, (sizes, limit)

    async def run() -> None:
        async with running(repo) as mesh:
            await asyncio.wait_for(scenario(mesh), 30)

    asyncio.run(run())
