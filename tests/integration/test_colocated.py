"""Stages in one process: an ensemble whose steps are all that process's models
runs there whole, and the orchestrator forwards it as any model; an ensemble it
cannot run whole (a streaming step) still runs step by step on the orchestrator.

The stage (python and ensemble backends, as services/colocated/main.py registers
them) and the orchestrator are real grpc.aio servers on port 0 in the test's
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
from inference import grpc_service_pb2_grpc as pb_grpc
from services.colocated import main as colocated
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import DATA, build_repository
from tests.in_process import Mesh, running, running_stage
from tests.integration.test_orchestrator import DIAMOND, ensemble, scale_model

# The prompt ids through the streaming echo engine: a step that streams.
STREAMING = """
input [ { name: "IDS" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT64 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "echo_engine" model_version: -1
    input_map { key: "INPUT_IDS" value: "IDS" } output_map { key: "OUTPUT_IDS" value: "OUT" } }
] }
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    shutil.copytree(DATA / "models" / "add_sub", tmp_path / "add_sub")
    scale_model(tmp_path, "double_slow", 2)
    scale_model(tmp_path, "triple_slow", 3)
    ensemble(tmp_path, "diamond", DIAMOND)
    shutil.copytree(DATA / "models" / "echo_engine", tmp_path / "echo_engine")
    (tmp_path / "echo_pipeline" / "1").mkdir(parents=True)
    (tmp_path / "echo_pipeline" / "config.pbtxt").write_text(f'platform: "ensemble"\n{STREAMING}')
    return tmp_path


def in_colocated_mesh(repo: Path, scenario: Callable[[Mesh], Awaitable[None]]) -> None:
    async def run() -> None:
        async with running(repo, local_ensembles=True) as mesh:
            await asyncio.wait_for(scenario(mesh), 60)

    asyncio.run(run())


def diamond_request(a: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="diamond")
    encode_inputs(request, {"A": a, "B": np.ones(a.shape, dtype=np.float32)})
    return request


async def stage_statistics(address: str, model: str) -> pb.ModelStatistics:
    """The model's statistics, as the stage at ``address`` keeps them."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        stats = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=model))
    found: pb.ModelStatistics = stats.model_stats[0]
    return found


async def success_count(address: str, model: str) -> int:
    """The model's successful requests, as the stage at ``address`` counts them."""
    return int((await stage_statistics(address, model)).inference_stats.success.count)


def test_an_ensemble_of_one_stages_models_runs_there_whole(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        stage = mesh.stages[0].address
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        answers = await asyncio.gather(*(mesh.v2.ModelInfer(diamond_request(a)) for _ in range(5)))
        for answer in map(decode_outputs, answers):
            np.testing.assert_allclose(answer["SUM_X2"], (a + 1) * 2)
            np.testing.assert_allclose(answer["DIFF_X3"], (a - 1) * 3)
        # The stage ran the ensemble and each of its steps (on every row, the requests
        # that came together as one batch); the orchestrator forwarded it.
        assert await success_count(stage, "diamond") == 5
        for step in ("add_sub", "triple_slow"):
            assert 1 <= await success_count(stage, step) <= 5
            assert (await stage_statistics(stage, step)).inference_count == 10
        assert mesh.core.stages_of("diamond") == ["inference"]
        statistics = await mesh.v2.ModelStatistics(pb.ModelStatisticsRequest(name="diamond"))
        (diamond,) = statistics.model_stats
        assert diamond.inference_stats.success.count == 5
        assert (diamond.execution_count, diamond.inference_count) == (5, 10)  # 2 rows each
        index = await mesh.v2.RepositoryIndex(pb.RepositoryIndexRequest())
        rows = [(m.name, m.state) for m in index.models if m.name == "diamond"]
        assert rows == [("diamond", "READY")]  # listed once, by the stage that serves it
        metadata = await mesh.v2.ModelMetadata(pb.ModelMetadataRequest(name="diamond"))
        assert metadata.platform == "ensemble"
        assert sorted(t.name for t in metadata.outputs) == ["DIFF_X3", "SUM_X2"]

    in_colocated_mesh(repo, scenario)


def test_a_bad_input_names_the_tensor_and_the_stage_keeps_serving(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        request = pb.ModelInferRequest(model_name="diamond")
        encode_inputs(
            request, {"A": np.zeros((1, 3), np.float32), "B": np.zeros((1, 4), np.float32)}
        )
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await mesh.v2.ModelInfer(request)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'A'" in (failed.value.details() or "")
        a = np.zeros((1, 4), np.float32)
        answer = decode_outputs(await mesh.v2.ModelInfer(diamond_request(a)))
        np.testing.assert_allclose(answer["SUM_X2"], [[2, 2, 2, 2]])

    in_colocated_mesh(repo, scenario)


def test_an_ensemble_with_a_streaming_step_stays_on_the_orchestrator(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        async with grpc.aio.insecure_channel(mesh.stages[0].address) as channel:
            direct = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            on_stage = await direct.RepositoryIndex(pb.RepositoryIndexRequest())
        names = {m.name for m in on_stage.models}
        assert {"diamond", "echo_engine"} <= names
        assert "echo_pipeline" not in names  # a streaming step: the stage does not claim it
        assert mesh.core.stages_of("echo_pipeline") == ["orchestrator"]
        index = await mesh.v2.RepositoryIndex(pb.RepositoryIndexRequest())
        rows = [(m.name, m.state) for m in index.models if m.name == "echo_pipeline"]
        assert rows == [("echo_pipeline", "READY")]
        request = pb.ModelInferRequest(model_name="echo_pipeline")
        encode_inputs(request, {"IDS": np.array([5, 6, 7], dtype=np.int64)})
        streamed = []
        async for response in mesh.v2.ModelStreamInfer(iter([request])):
            assert not response.error_message
            outputs = decode_outputs(response.infer_response)
            if "OUT" in outputs:
                streamed.append(outputs["OUT"].tolist())
        assert streamed == [[5], [5, 6], [5, 6, 7]]

    in_colocated_mesh(repo, scenario)


def test_unloading_an_ensemble_a_stage_serves_whole_unloads_it_there_too(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        await mesh.v2.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="diamond"))
        await mesh.core.router.refresh()
        a = np.zeros((1, 4), np.float32)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await mesh.v2.ModelInfer(diamond_request(a))
        assert failed.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
        await mesh.v2.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="diamond"))
        answer = decode_outputs(await mesh.v2.ModelInfer(diamond_request(a)))
        np.testing.assert_allclose(answer["DIFF_X3"], [[-3, -3, -3, -3]])
        assert await success_count(mesh.stages[0].address, "diamond") == 1

    in_colocated_mesh(repo, scenario)


def test_text_embedding_runs_whole_on_a_colocated_stage_and_answers_as_step_by_step(
    prepared_repository: Path, tmp_path: Path
) -> None:
    """The real pipeline (MiniLM's tokenizer, MiniLM on ONNX Runtime, mean pooling)
    on one process with the backends ``services.colocated.main`` registers: the
    same embeddings as the orchestrator's step-by-step run on a stage without the
    ensemble backend."""
    names = ["text_embedding", "minilm_tokenizer", "minilm", "mean_pool"]
    repo = build_repository(tmp_path / "repo", [], names, prepared_repository)
    sentences = [
        b"A cat sits on the mat.",
        b"A kitten rests on a rug.",
        b"Stock prices fell.",
        b"The quarterly report showed that stock prices fell sharply after the "
        b"central bank raised interest rates again, to the surprise of analysts.",
    ]

    def request_for(texts: list[bytes]) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="text_embedding")
        encode_inputs(request, {"TEXT": np.array(texts, dtype=object).reshape(-1, 1)})
        return request

    async def embed(whole: bool) -> tuple[np.ndarray, np.ndarray, int]:
        registered = colocated.backends(["tokenizer", "inference", "postprocess"])
        if not whole:
            del registered["ensemble"]
        async with running_stage(repo, registered) as mesh:
            answer = decode_outputs(await mesh.v2.ModelInfer(request_for(sentences), timeout=60))
            # One request per sentence, all at once: on the colocated stage they go
            # through the steps together, padded to the longest.
            alone = await asyncio.gather(
                *(mesh.v2.ModelInfer(request_for([text]), timeout=60) for text in sentences)
            )
            each = np.concatenate([decode_outputs(one)["EMBEDDING"] for one in alone])
            stage = mesh.stages[0].address
            on_stage = await success_count(stage, "text_embedding") if whole else 0
            return answer["EMBEDDING"], each, on_stage

    whole, whole_each, ran_there = asyncio.run(embed(whole=True))
    stepwise, stepwise_each, _ = asyncio.run(embed(whole=False))
    assert ran_there == 1 + len(sentences)
    np.testing.assert_allclose(whole_each, whole, atol=1e-5)
    np.testing.assert_allclose(stepwise_each, stepwise, atol=1e-5)
    assert whole.shape == (len(sentences), 384)
    np.testing.assert_allclose(np.linalg.norm(whole, axis=1), 1.0, atol=1e-4)
    np.testing.assert_allclose(whole, stepwise, atol=1e-5)
    similar, unrelated = float(whole[0] @ whole[1]), float(whole[0] @ whole[2])
    assert similar > unrelated + 0.2
