"""Bounded queues by default: a model under more requests than its queue holds
refuses the excess with RESOURCE_EXHAUSTED at once, serves the rest, and stays
healthy (issue 24, item 10). A stage and the orchestrator run in this process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from services.inference.python import PythonBackend
from shared.queue_bounds import QUEUED_BATCHES_PER_INSTANCE
from shared.server import MeshServer
from shared.stage import StageConfig, build_stage_parts
from shared.tensors import encode_inputs
from tests.in_process import Mesh, running

MAX_BATCH = 4
BATCH_S = 0.3

# Batched, one instance, no queue policy in its config: the default bound applies.
SLOW_BATCHED_CONFIG = f"""
name: "slow_batched"
backend: "python"
max_batch_size: {MAX_BATCH}
dynamic_batching {{ }}
input [ {{ name: "MS" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "MS_OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

SLOW_BATCHED = f"""
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({BATCH_S})  # one slow batch, whatever its size
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("MS_OUT", pb_utils.get_input_tensor_by_name(r, "MS").as_numpy())]
            )
            for r in requests
        ]
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "slow_batched" / "1").mkdir(parents=True)
    (tmp_path / "slow_batched" / "config.pbtxt").write_text(SLOW_BATCHED_CONFIG)
    (tmp_path / "slow_batched" / "1" / "model.py").write_text(SLOW_BATCHED)
    return tmp_path


def _request(index: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="slow_batched", id=str(index))
    encode_inputs(request, {"MS": np.array([[index]], dtype=np.int32)})
    return request


async def _timed(mesh: Mesh, index: int) -> tuple[grpc.StatusCode, float]:
    started = time.monotonic()
    try:
        await mesh.v2.ModelInfer(_request(index), timeout=60)
        code = grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
    return code, time.monotonic() - started


def test_a_full_queue_refuses_the_excess_at_once_and_serves_the_rest(repo: Path) -> None:
    bound = QUEUED_BATCHES_PER_INSTANCE * MAX_BATCH  # the default: 8 full batches queued
    sent = 2 * bound + 3 * MAX_BATCH

    async def scenario() -> None:
        async with running(repo, load=["slow_batched"]) as mesh:
            results = await asyncio.gather(*(_timed(mesh, i) for i in range(sent)))
            codes = [code for code, _ in results]
            refused = [took for code, took in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
            served = codes.count(grpc.StatusCode.OK)
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            # At most the bound waits, plus the batches that were running meanwhile.
            assert refused and len(refused) >= sent - bound - 3 * MAX_BATCH, codes
            assert served >= bound, codes
            assert max(refused) < 2 * BATCH_S, refused  # answered at once, not after waiting
            # Still healthy: ready, and a new request is served.
            assert (await mesh.v2.ServerReady(pb.ServerReadyRequest(), timeout=5)).ready
            await mesh.v2.ModelInfer(_request(0), timeout=10)

    asyncio.run(scenario())


# The same model once more, its config bounding its own queue (0: unbounded, no timeout).
OWN_BOUNDS = SLOW_BATCHED_CONFIG.replace('"slow_batched"', '"own_bounds"') + (
    'parameters { key: "max_queue_size" value { string_value: "0" } }\n'
    'parameters { key: "queue_timeout_us" value { string_value: "0" } }\n'
)


def test_a_stage_wide_default_bounds_the_models_that_set_none(repo: Path) -> None:
    """``default_queued_batches`` and ``default_queue_timeout_s`` (mesh YAML, per stage)
    replace the built-in defaults for models whose config sets no bound, and only those."""
    (repo / "own_bounds" / "1").mkdir(parents=True)
    (repo / "own_bounds" / "config.pbtxt").write_text(OWN_BOUNDS)
    (repo / "own_bounds" / "1" / "model.py").write_text(SLOW_BATCHED)
    sent = 4 * MAX_BATCH  # all of it would be served under the built-in bound (8 batches)
    config = StageConfig(
        model_repository=repo,
        default_queued_batches=1,
        default_queue_timeout_s=BATCH_S / 2,
        grace_period_s=1,
    )

    async def burst(stub: pb_grpc.GRPCInferenceServiceStub, model: str) -> list[grpc.StatusCode]:
        async def one(index: int) -> grpc.StatusCode:
            request = _request(index)
            request.model_name = model
            try:
                await stub.ModelInfer(request, timeout=30)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        # The first alone, so that its batch runs before the rest arrive together.
        first = asyncio.create_task(one(0))
        await asyncio.sleep(BATCH_S / 3)
        rest = await asyncio.gather(*(one(i) for i in range(1, sent)))
        return [await first, *rest]

    async def scenario() -> None:
        stage = MeshServer(config, build_stage_parts(config, {"python": PythonBackend()}))
        await stage.start()
        try:
            async with grpc.aio.insecure_channel(stage.address) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
                bounded = await burst(stub, "slow_batched")
                own = await burst(stub, "own_bounds")
        finally:
            await stage.stop()
        # One batch runs, one batch's worth waits (then times out behind it), the rest
        # is refused at once.
        assert set(bounded) <= {
            grpc.StatusCode.OK,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE,
        }, bounded
        assert bounded.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= sent - 2 * MAX_BATCH, bounded
        assert grpc.StatusCode.UNAVAILABLE in bounded, bounded
        assert grpc.StatusCode.OK in bounded, bounded
        assert own == [grpc.StatusCode.OK] * sent, own

    asyncio.run(scenario())
