"""An ensemble's steps on the stages' open streams: through the ensemble's queue
each step of a batch is a message on an open stream (as a forwarded request
travels), the caller's deadline or not; where the ensemble runs each request
alone (``ensemble_batching: false``), a request with a deadline makes a
ModelInfer per step. Either way each caller gets its own answer under its own
id, and a step's error names the step. The orchestrator and a python-backend
stage run in this process (tests/in_process.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from shared.tensors import decode_outputs, encode_inputs
from tests.in_process import Mesh, running

STEP = """
name: "plus_one"
backend: "python"
max_batch_size: 8
dynamic_batching { }
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                error = pb_utils.TritonError("negative input")
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                y = pb_utils.Tensor("Y", (x + 1).astype(np.float32))
                responses.append(pb_utils.InferenceResponse([y]))
        return responses
"""

# The same step model twice: x + 1, then + 1 again.
CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "plus_one" model_version: -1
    input_map { key: "X" value: "X" } output_map { key: "Y" value: "t" } },
  { model_name: "plus_one" model_version: -1
    input_map { key: "X" value: "t" } output_map { key: "Y" value: "Y" } }
] }
"""


# The same, each request alone through the steps (Triton's way).
ALONE = CHAIN.replace('name: "chain"', 'name: "chain_alone"') + (
    'parameters { key: "ensemble_batching" value: { string_value: "false" } }\n'
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ensemble-streams")
    (root / "plus_one" / "1").mkdir(parents=True)
    (root / "plus_one" / "config.pbtxt").write_text(STEP)
    (root / "plus_one" / "1" / "model.py").write_text(MODEL)
    (root / "chain" / "1").mkdir(parents=True)
    (root / "chain" / "config.pbtxt").write_text(CHAIN)
    (root / "chain_alone" / "1").mkdir(parents=True)
    (root / "chain_alone" / "config.pbtxt").write_text(ALONE)
    return root


def chain_request(value: float, request_id: str, model: str = "chain") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    encode_inputs(request, {"X": np.full((1, 4), value, np.float32)})
    return request


async def answers(mesh: Mesh, deadline_s: float | None, model: str = "chain") -> None:
    """Twelve requests at once, some without an id: each gets x + 2 and its id."""
    requests = [chain_request(i, f"caller-{i}" if i % 3 else "", model) for i in range(12)]
    replies = await asyncio.gather(*(mesh.v2.ModelInfer(r, timeout=deadline_s) for r in requests))
    for index, (request, reply) in enumerate(zip(requests, replies, strict=True)):
        assert reply.id == request.id
        assert decode_outputs(reply)["Y"].tolist() == [[index + 2.0] * 4]


def test_steps_travel_on_open_streams_unless_alone_with_a_deadline(repo: Path) -> None:
    async def scenario() -> None:
        async with running(repo) as mesh:
            (endpoint,) = mesh.core.router.endpoints
            await answers(mesh, deadline_s=10, model="chain_alone")
            assert not endpoint.forward_streams, "a lone request with a deadline used a stream"
            await answers(mesh, deadline_s=10)
            assert endpoint.forward_streams, "no batch's step travelled on a stream"
            await answers(mesh, deadline_s=None)
            await answers(mesh, deadline_s=None, model="chain_alone")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await mesh.v2.ModelInfer(chain_request(-5, "bad"))
            details = caught.value.details() or ""
            assert "ensemble 'chain' step 0 ('plus_one')" in details
            assert "negative input" in details
            await answers(mesh, deadline_s=None)  # the stream still serves after an error

    asyncio.run(asyncio.wait_for(scenario(), 60))
