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
from shared.model import QUEUED_BATCHES_PER_INSTANCE
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
