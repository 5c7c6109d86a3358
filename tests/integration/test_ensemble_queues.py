"""An ensemble's requests that wait together, as one batch through its steps:
on the orchestrator (services/orchestrator/ensemble_queues.py), with the step on
a stage of its own, and on a stage that runs the ensemble whole
(services/colocated/). The step's batcher does not hold a gathered batch for
company; each caller gets its own rows; one caller's bad data fails only that
caller; a caller whose deadline passes leaves its batch to the others; a
request that cannot share a batch (its inputs' rows disagree, or are none or
too many) fails alone.

The stage (python backend, and the ensemble backend where it runs ensembles
whole) and the orchestrator are real grpc.aio servers on port 0 in the test's
event loop (tests/in_process.py)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import DATA
from tests.in_process import Mesh, running
from tests.integration.test_colocated import stage_statistics
from tests.integration.test_orchestrator import DIAMOND, ensemble, scale_model

# X * 10 after 150 ms; a request with a negative value is refused INVALID_ARGUMENT.
CHECKED_MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.15)
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                code = pb_utils.TritonError.INVALID_ARG
                error = pb_utils.TritonError("X must not be negative", code)
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 10)]))
        return responses
"""
# Its own queue would hold a partial batch for 3 s (Triton's fixed delay): an
# ensemble's batch, gathered already, must not wait there.
CHECKED_CONFIG = """
name: "checked" backend: "python" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 3000000 }
parameters { key: "queue_delay_policy" value: { string_value: "fixed" } }
"""
CHECKED_PIPELINE = """
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "checked" model_version: -1
    input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } }
] }
"""


async def checked_waves(mesh: Mesh, values: list[float]) -> list[np.ndarray | grpc.aio.AioRpcError]:
    """Two requests that keep the one ``checked`` instance busy (the first runs at
    once, the second waits for it), then ``values`` while they run: those wait
    together in the ensemble's queue and go through the step as one batch."""

    async def call(value: float) -> np.ndarray | grpc.aio.AioRpcError:
        request = pb.ModelInferRequest(model_name="checked_pipeline")
        encode_inputs(request, {"X": np.array([[value]], dtype=np.float32)})
        try:
            return decode_outputs(await mesh.v2.ModelInfer(request))["Y"]
        except grpc.aio.AioRpcError as exc:
            return exc

    busy = [asyncio.create_task(call(1.0))]
    await asyncio.sleep(0.05)
    busy.append(asyncio.create_task(call(1.0)))
    await asyncio.sleep(0.05)
    answers = await asyncio.gather(*(call(value) for value in values))
    for answer in await asyncio.gather(*busy):
        assert isinstance(answer, np.ndarray)
        np.testing.assert_allclose(answer, [[10.0]])
    return list(answers)


@pytest.fixture
def checked_repo(tmp_path: Path) -> Path:
    (tmp_path / "checked" / "1").mkdir(parents=True)
    (tmp_path / "checked" / "1" / "model.py").write_text(CHECKED_MODEL)
    (tmp_path / "checked" / "config.pbtxt").write_text(CHECKED_CONFIG)
    ensemble(tmp_path, "checked_pipeline", CHECKED_PIPELINE)
    return tmp_path


def in_mesh(
    repo: Path, scenario: Callable[[Mesh], Awaitable[None]], local_ensembles: bool = False
) -> None:
    async def run() -> None:
        async with running(repo, local_ensembles=local_ensembles) as mesh:
            await asyncio.wait_for(scenario(mesh), 60)

    asyncio.run(run())


@pytest.mark.parametrize("local_ensembles", [False, True], ids=["orchestrator", "colocated"])
def test_requests_that_wait_together_cross_the_step_as_one_batch(
    checked_repo: Path, local_ensembles: bool
) -> None:
    async def scenario(mesh: Mesh) -> None:
        values = [2.0, 3.0, 4.0, 5.0, 6.0]
        answers = await checked_waves(mesh, values)
        for value, answer in zip(values, answers, strict=True):
            assert isinstance(answer, np.ndarray)
            np.testing.assert_allclose(answer, [[value * 10]])  # its own row, not another's
        step = await stage_statistics(mesh.stages[0].address, "checked")
        assert step.inference_count == 7  # every row once
        # The first alone; the second (in the queue's other lane), and the five that
        # came while it waited, as at most three batches (the step may run them as
        # one: all are gathered).
        assert 2 <= step.execution_count <= 4
        # No batch sat out the step's 3 s delay: each was gathered already (the
        # second request waited ~0.1 s for the instance the first held).
        assert step.inference_stats.queue.ns < 1e9
        statistics = await mesh.v2.ModelStatistics(
            pb.ModelStatisticsRequest(name="checked_pipeline")
        )
        assert statistics.model_stats[0].inference_stats.success.count == 7  # one per caller

    in_mesh(checked_repo, scenario, local_ensembles)


@pytest.mark.parametrize("local_ensembles", [False, True], ids=["orchestrator", "colocated"])
def test_a_request_that_spoils_its_batch_fails_alone(
    checked_repo: Path, local_ensembles: bool
) -> None:
    async def scenario(mesh: Mesh) -> None:
        good, bad, fine = await checked_waves(mesh, [2.0, -1.0, 3.0])
        assert isinstance(good, np.ndarray) and isinstance(fine, np.ndarray)
        np.testing.assert_allclose(good, [[20.0]])
        np.testing.assert_allclose(fine, [[30.0]])
        assert isinstance(bad, grpc.aio.AioRpcError)
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "X must not be negative" in (bad.details() or "")
        step = await stage_statistics(mesh.stages[0].address, "checked")
        # The batch of three failed once, then each ran alone; only the bad one failed.
        assert step.inference_stats.fail.count == 2
        answer = (await checked_waves(mesh, [4.0]))[0]
        assert isinstance(answer, np.ndarray)  # and the mesh keeps serving
        np.testing.assert_allclose(answer, [[40.0]])

    in_mesh(checked_repo, scenario, local_ensembles)


def test_a_callers_deadline_ends_its_own_wait_and_not_its_batch(checked_repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        async def call(value: float, deadline_s: float | None = None) -> np.ndarray:
            request = pb.ModelInferRequest(model_name="checked_pipeline")
            encode_inputs(request, {"X": np.array([[value]], dtype=np.float32)})
            return decode_outputs(await mesh.v2.ModelInfer(request, timeout=deadline_s))["Y"]

        busy = asyncio.create_task(call(1.0))  # holds the one instance for 150 ms
        await asyncio.sleep(0.05)
        # These two wait for the instance together; one caller gives up first.
        hurried = asyncio.create_task(call(2.0, deadline_s=0.1))
        patient = asyncio.create_task(call(3.0))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await hurried
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        np.testing.assert_allclose(await patient, [[30.0]])
        np.testing.assert_allclose(await busy, [[10.0]])
        np.testing.assert_allclose(await call(4.0, deadline_s=5.0), [[40.0]])  # still serving

    in_mesh(checked_repo, scenario)


def diamond_request(a: np.ndarray, b: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="diamond")
    encode_inputs(request, {"A": a, "B": b})
    return request


ONE = np.ones((1, 4), dtype=np.float32)


def short_raw() -> pb.ModelInferRequest:
    request = diamond_request(ONE, ONE)
    request.raw_input_contents[0] = b"\0" * 7
    return request


# A request that cannot share a batch, and what its caller hears.
ODD_REQUESTS = [
    ("rows_disagree", lambda: diamond_request(np.ones((2, 4), np.float32), ONE), "same batch size"),
    ("no_rows", lambda: diamond_request(np.ones((0, 4), np.float32), ONE[:0]), "batch size 0"),
    ("too_many_rows", lambda: diamond_request(np.ones((9, 4), np.float32), ONE.repeat(9, 0)), "9"),
    ("short_raw", short_raw, "tensor 'A'"),
    ("wrong_shape", lambda: diamond_request(ONE[:, :3], ONE[:, :3]), "input 'A'"),
]


@pytest.mark.parametrize("local_ensembles", [False, True], ids=["orchestrator", "colocated"])
def test_a_request_that_cannot_share_a_batch_fails_alone(
    tmp_path: Path, local_ensembles: bool
) -> None:
    shutil.copytree(DATA / "models" / "add_sub", tmp_path / "add_sub")
    scale_model(tmp_path, "double_slow", 2, sleep_ms=100)
    scale_model(tmp_path, "triple_slow", 3, sleep_ms=100)
    ensemble(tmp_path, "diamond", DIAMOND)

    async def scenario(mesh: Mesh) -> None:
        async def call(request: pb.ModelInferRequest) -> dict[str, np.ndarray] | Exception:
            try:
                return decode_outputs(await mesh.v2.ModelInfer(request))
            except grpc.aio.AioRpcError as exc:
                return exc

        for name, odd, heard in ODD_REQUESTS:
            busy = asyncio.create_task(call(diamond_request(ONE, ONE)))
            await asyncio.sleep(0.03)  # the odd one arrives among others that wait together
            before, answer, after = await asyncio.gather(
                call(diamond_request(ONE * 2, ONE)),
                call(odd()),
                call(diamond_request(ONE * 3, ONE)),
            )
            for value, neighbour in ((2, before), (3, after), (1, await busy)):
                assert not isinstance(neighbour, Exception), (name, neighbour)
                np.testing.assert_allclose(neighbour["SUM_X2"], (ONE * value + 1) * 2)
            assert isinstance(answer, grpc.aio.AioRpcError), (name, answer)
            assert answer.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert heard in (answer.details() or ""), (name, answer.details())

    in_mesh(tmp_path, scenario, local_ensembles)
