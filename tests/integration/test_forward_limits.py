"""Forwarded requests and answers near the largest message a hop takes.

Real stages (the image preprocess step and MobileNetV2 in ONNX Runtime) run
with ``--max-message-bytes`` at its floor (4 MiB), spoken to as the
orchestrator does: its ForwardStream, packed, on the asyncio HTTP/2 client.
Requests and answers that fit alone but not together go in several messages
and are all answered; one that does not fit alone fails alone with
RESOURCE_EXHAUSTED, and the stream serves on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from models.prepare import prepare_repository
from models.sources import sample_image
from services.orchestrator.forward_stream import ForwardStream
from shared.errors import MeshError
from shared.h2grpc.client import LeanChannel
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import build_repository, cache_dir
from tests.harness import ServiceProcess

LIMIT = 4 * 1024 * 1024
"""The smallest largest message a service may be given."""
IMAGE_BYTES = 3 * 224 * 224 * 4
"""One preprocessed image (FP32), the preprocess step's answer row and MobileNetV2's input row."""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prepared = prepare_repository(cache_dir())
    return build_repository(
        tmp_path_factory.mktemp("limits-repo"),
        [],
        ["image_preprocess", "mobilenet_v2_onnx"],
        prepared,
    )


def _stage(module: str, repo: Path) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        module,
        [
            "--model-repository",
            str(repo),
            "--metrics-port",
            "-1",
            "--max-message-bytes",
            str(LIMIT),
        ],
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def preprocess(repo: Path) -> Iterator[ServiceProcess]:
    yield from _stage("services.preprocess.main", repo)


@pytest.fixture(scope="module")
def inference(repo: Path) -> Iterator[ServiceProcess]:
    yield from _stage("services.inference.main", repo)


def images(rows: int) -> bytes:
    request = pb.ModelInferRequest(model_name="image_preprocess")
    photos = np.empty((rows, 1), dtype=object)
    photos[:, 0] = sample_image("coffee.png").read_bytes()
    encode_inputs(request, {"IMAGE": photos})
    return request.SerializeToString()


def pixels(rows: int) -> bytes:
    request = pb.ModelInferRequest(model_name="mobilenet_v2_onnx")
    data = np.random.default_rng(rows).random((rows, 3, 224, 224), dtype=np.float32)
    encode_inputs(request, {"input": data})
    return request.SerializeToString()


def outputs(answer: bytes) -> dict[str, np.ndarray]:
    return decode_outputs(pb.ModelInferResponse.FromString(answer))


async def _infer_all(stream: ForwardStream, requests: list[bytes]) -> list[bytes | BaseException]:
    """Every request at once (one message, were it not for the limit); 60 s at most."""
    calls = [stream.infer(request, f"caller-{i}") for i, request in enumerate(requests)]
    return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)


def test_answers_that_fit_alone_but_not_together_all_arrive(preprocess: ServiceProcess) -> None:
    """Six answers of 2.4 MB, ready at once, go back in several messages; an
    answer of 4.8 MB is its request's RESOURCE_EXHAUSTED and the others' are
    unharmed; the stream then answers on."""

    async def scenario() -> None:
        channel = LeanChannel(preprocess.address, LIMIT)
        stream = ForwardStream(channel, packed=True, limit=LIMIT)
        try:
            answers = await _infer_all(stream, [images(4)] * 6 + [images(8)])
            *fitting, too_large = answers
            for answer in fitting:
                assert isinstance(answer, bytes), answer
                assert outputs(answer)["PIXELS"].shape == (4, 3, 224, 224)
            assert isinstance(too_large, MeshError)
            assert too_large.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "'image_preprocess': answer larger than max" in too_large.message
            assert str(LIMIT) in too_large.message
            (after,) = await _infer_all(stream, [images(1)])
            assert isinstance(after, bytes), after
            assert outputs(after)["PIXELS"].shape == (1, 3, 224, 224)
        finally:
            stream.cancel()
            await channel.close()

    asyncio.run(scenario())


def test_requests_that_fit_alone_but_not_together_are_all_answered(
    inference: ServiceProcess,
) -> None:
    """Four requests of 1.8 MB, written at once, go in several messages, where
    one (7.2 MB) would have been over the stage's largest, and refused with
    every request it carried; a request over the largest alone fails at once,
    unsent, and the stream serves on."""
    assert 4 * 3 * IMAGE_BYTES > LIMIT > 3 * IMAGE_BYTES

    async def scenario() -> None:
        channel = LeanChannel(inference.address, LIMIT)
        stream = ForwardStream(channel, packed=True, limit=LIMIT)
        try:
            answers = await _infer_all(stream, [pixels(3)] * 4)
            for answer in answers:
                assert isinstance(answer, bytes), answer
                assert outputs(answer)["logits"].shape == (3, 1000)
            with pytest.raises(MeshError) as refused:
                await stream.infer(pixels(8), "too-large")
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "request larger than max" in refused.value.message
            (after,) = await _infer_all(stream, [pixels(1)])
            assert isinstance(after, bytes), after
            assert outputs(after)["logits"].shape == (1, 1000)
        finally:
            stream.cancel()
            await channel.close()

    asyncio.run(scenario())
