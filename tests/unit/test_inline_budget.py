"""When a model's batch runs on the event loop: the learned rule (made-up
durations), the instance that follows it (which thread ran each batch), and a
real TorchScript model served through a ModelVersion."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from inference import model_config_pb2 as mc
from shared.backend import InstanceSpec, ModelSpec, config_parameters
from shared.errors import ConfigError
from shared.inline_budget import DEFAULT_BOUND_US, SAMPLES, InlineBudget, inline_bound_us
from shared.instances import QuickThreadedInstance
from shared.model import ModelVersion
from shared.request import InferRequest, InferResponse
from shared.statistics import StatsRecorder

US = 1_000
INSTANCE = InstanceSpec(name="m_0", kind="KIND_CPU", device="cpu", intra_op_threads=1)


def test_a_batch_runs_inline_only_after_enough_cheap_measurements() -> None:
    budget = InlineBudget(500)
    for _ in range(SAMPLES - 1):
        budget.measured(100 * US)
        assert not budget.allows()
    budget.measured(100 * US)
    assert budget.allows()


def test_one_slow_batch_sends_the_next_to_the_thread_until_cheap_ones_bring_it_back() -> None:
    budget = InlineBudget(500)
    for _ in range(SAMPLES):
        budget.measured(100 * US)
    budget.measured(5_000 * US)
    assert not budget.allows() and budget.estimate_ns == 5_000 * US
    cheap_batches = 0
    while not budget.allows():
        budget.measured(100 * US)
        cheap_batches += 1
    # The average falls back by an eighth of the gap per batch: 4.9 ms -> 0.4 ms.
    assert 15 <= cheap_batches <= 25


def test_a_bound_of_zero_never_runs_inline() -> None:
    budget = InlineBudget(0)
    for _ in range(3 * SAMPLES):
        budget.measured(1)
    assert not budget.allows()


def config(extra: str = "") -> mc.ModelConfig:
    text = 'name: "m" backend: "pytorch" max_batch_size: 8 ' + extra
    return text_format.Parse(text, mc.ModelConfig())


def bound(value: str) -> str:
    return f'parameters {{ key: "inline_execution_us" value: {{ string_value: "{value}" }} }}'


def test_the_bound_is_the_models_parameter_or_the_default() -> None:
    assert inline_bound_us(config()) == DEFAULT_BOUND_US
    assert inline_bound_us(config(bound("0"))) == 0
    assert inline_bound_us(config(bound("2000"))) == 2000
    for bad in ("-1", "fast", "1e3", "100001"):
        with pytest.raises(ConfigError, match="model 'm': parameter inline_execution_us"):
            inline_bound_us(config(bound(bad)))


class _Spinner:
    """A loop-safe backend instance that computes for ``seconds`` of CPU per batch
    and says which thread ran it."""

    loop_safe = True

    def __init__(self) -> None:
        self.seconds = 0.0
        self.threads: list[int] = []

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        self.threads.append(threading.get_ident())
        started = time.thread_time()
        while time.thread_time() - started < self.seconds:
            pass
        return [InferResponse(outputs={"Y": r.inputs["X"] + 1}) for r in requests]

    def close(self) -> None:
        """Nothing held."""


def test_a_slow_batch_moves_a_cheap_instance_back_to_its_thread() -> None:
    spinner = _Spinner()
    executor = ThreadPoolExecutor(1)
    stats = StatsRecorder("m", "1", None)
    threaded = QuickThreadedInstance(INSTANCE, spinner, executor, stats, True, InlineBudget(20_000))
    batch = [InferRequest("m", "1", {"X": np.zeros((1, 2), np.float32)})]

    async def main() -> int:
        for _ in range(SAMPLES + 2):  # the first SAMPLES in the thread, then the loop
            await threaded.execute(batch)
        spinner.seconds = 0.05  # over the 20 ms bound: this one still runs inline...
        await threaded.execute(batch)
        spinner.seconds = 0.0
        await threaded.execute(batch)  # ...the next goes to the thread
        assert threaded.execute_now(batch) is None  # and none skips the queue
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(main())
    finally:
        executor.shutdown()
    on_loop = [thread == loop_thread for thread in spinner.threads]
    assert on_loop == [False] * SAMPLES + [True, True, True, False]
    assert stats.stats.execution_count == SAMPLES + 4


MODEL_PY = """
import torch


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
"""


def _mlp_repository(root: Path) -> ModelSpec:
    (root / "1").mkdir(parents=True)
    (root / "1" / "model.py").write_text(MODEL_PY)
    text = """
    name: "mlp" backend: "pytorch" max_batch_size: 8
    input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
    output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
    parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
    parameters { key: "inline_execution_us" value: { string_value: "100000" } }
    """
    parsed = text_format.Parse(text, mc.ModelConfig())
    return ModelSpec("mlp", 1, root / "1", parsed, config_parameters(parsed))


def test_a_small_torch_model_runs_on_the_loop_with_its_own_thread_count(tmp_path: Path) -> None:
    import torch

    from services.inference.pytorch import PyTorchBackend

    # A bound no batch of this model reaches on a loaded host (one slow batch at the
    # default 500 us would send the rest back to the thread, as it should).
    spec = _mlp_repository(tmp_path / "mlp")
    rows = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    expected = layers(torch.from_numpy(rows)).detach()
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what the loop's thread would use on its own

    async def main() -> tuple[list[np.ndarray], int]:
        version = ModelVersion(spec, PyTorchBackend(), None)
        await version.load()
        try:
            answers = []
            for _ in range(SAMPLES + 4):
                response = await version.infer(InferRequest("mlp", "1", {"INPUT": rows}))
                answers.append(response.outputs["OUTPUT"])
            instance = version.instances[0]
            assert isinstance(instance, QuickThreadedInstance) and instance.execute_now
            assert instance._budget is not None and instance._budget.allows()
            return answers, torch.get_num_threads()
        finally:
            await version.unload()

    try:
        answers, loop_threads = asyncio.run(main())
    finally:
        torch.set_num_threads(before)
    assert loop_threads == 1  # set by the forwards that ran on the loop
    for answer in answers:
        np.testing.assert_allclose(answer, expected.numpy(), rtol=1e-6)
