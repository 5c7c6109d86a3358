"""The orchestrator's ensemble queues (services/orchestrator/ensemble_queues.py):
with the step on a stage of its own, requests to the ensemble that wait
together cross to that stage as one batch, which the stage's batcher does not
hold for company; each caller gets its own rows, one caller's bad data fails
only that caller, a caller whose deadline passes leaves its batch to the
others, and a request that cannot share a batch (its inputs' rows disagree, or
are none or too many) fails alone, here and on a stage that runs the ensemble
whole.

The stage (python backend) and the orchestrator are real grpc.aio servers on
port 0 in the test's event loop (tests/in_process.py); the ensemble runs on
the orchestrator."""

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
from tests.integration.test_colocated import checked_repo, checked_waves, stage_statistics
from tests.integration.test_orchestrator import DIAMOND, ensemble, scale_model

__all__ = ["checked_repo"]  # the fixture, shared with test_colocated.py


def in_mesh(
    repo: Path, scenario: Callable[[Mesh], Awaitable[None]], local_ensembles: bool = False
) -> None:
    async def run() -> None:
        async with running(repo, local_ensembles=local_ensembles) as mesh:
            await asyncio.wait_for(scenario(mesh), 60)

    asyncio.run(run())


def test_requests_that_wait_together_cross_to_the_stage_as_one_batch(checked_repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        values = [2.0, 3.0, 4.0, 5.0, 6.0]
        answers = await checked_waves(mesh, values)
        for value, answer in zip(values, answers, strict=True):
            assert isinstance(answer, np.ndarray)
            np.testing.assert_allclose(answer, [[value * 10]])  # its own row, not another's
        step = await stage_statistics(mesh.stages[0].address, "checked")
        assert step.inference_count == 7  # every row once
        # The first alone; the second, and the five that came while it waited, as
        # at most three batches (the stage may run them as one: both are gathered).
        assert 2 <= step.execution_count <= 4
        # No batch sat out the step's 3 s delay: each was gathered already.
        assert step.inference_stats.queue.ns < 1e9
        statistics = await mesh.v2.ModelStatistics(
            pb.ModelStatisticsRequest(name="checked_pipeline")
        )
        assert statistics.model_stats[0].inference_stats.success.count == 7  # one per caller

    in_mesh(checked_repo, scenario)


def test_a_request_that_spoils_its_batch_fails_alone(checked_repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        good, bad, fine = await checked_waves(mesh, [2.0, -1.0, 3.0])
        assert isinstance(good, np.ndarray) and isinstance(fine, np.ndarray)
        np.testing.assert_allclose(good, [[20.0]])
        np.testing.assert_allclose(fine, [[30.0]])
        assert isinstance(bad, grpc.aio.AioRpcError)
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "X must not be negative" in (bad.details() or "")
        answer = (await checked_waves(mesh, [4.0]))[0]
        assert isinstance(answer, np.ndarray)  # and the mesh keeps serving
        np.testing.assert_allclose(answer, [[40.0]])

    in_mesh(checked_repo, scenario)


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
