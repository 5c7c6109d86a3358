"""A model's instances: how ``instance_group`` expands into them, and how each
runs its batches.

Each instance of a model served through the batcher is a ``ThreadedInstance``:
the backend's instance behind a thread of its own, so the event loop never
blocks on model compute. One that says a batch is cheap (a ``QuickInstance``),
or whose batches are measured cheaper than the hand-off to that thread
(``shared/inline_budget.py``), runs them on the loop.
"""

from __future__ import annotations

import asyncio
import glob
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from inference import model_config_pb2 as mc
from shared.backend import BackendInstance, InstanceSpec, QuickInstance, default_intra_op_threads
from shared.errors import ConfigError
from shared.inline_budget import InlineBudget, LoopSafeInstance, inline_bound_us
from shared.request import InferRequest, InferResponse
from shared.statistics import StatsRecorder


class ThreadedInstance:
    """A backend instance behind its own thread, as the batcher sees it."""

    def __init__(
        self,
        spec: InstanceSpec,
        instance: BackendInstance,
        executor: ThreadPoolExecutor,
        stats: StatsRecorder,
        batched: bool,
        budget: InlineBudget | None = None,
    ) -> None:
        self.name = spec.name
        self.spec = spec
        self.instance = instance
        self._executor = executor
        self._stats = stats
        self._batched = batched
        self._inline = instance.runs_inline if isinstance(instance, QuickInstance) else None
        self._budget = budget
        """Learns the batch times of a LoopSafeInstance (shared/inline_budget.py)."""

    async def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Run the batch in this instance's thread (on the loop when the instance
        says it is cheap, or its batches are measured cheap) and record its statistics."""
        results = self._run_inline(requests)
        if results is None:
            started = time.monotonic_ns()
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self._executor, self._timed, requests)
            self._batch_done(requests, started)
        return results

    def _timed(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """The batch run in this thread, its CPU time learned (shared/inline_budget.py)."""
        if self._budget is None:
            return self.instance.execute(requests)
        started = time.thread_time_ns()
        try:
            return self.instance.execute(requests)
        finally:
            self._budget.measured(time.thread_time_ns() - started)

    def _run_inline(self, requests: list[InferRequest]) -> list[InferResponse | Exception] | None:
        """The batch run here, on the loop, when it is cheap; else None."""
        budget = self._budget
        if budget is not None:
            if not budget.allows():
                return None
        elif self._inline is None or not self._inline(requests):
            return None
        started, cpu_started = time.monotonic_ns(), time.thread_time_ns()
        try:
            results = self.instance.execute(requests)
        finally:
            if budget is not None:
                budget.measured(time.thread_time_ns() - cpu_started)
        self._batch_done(requests, started)
        return results

    def _batch_done(self, requests: list[InferRequest], started_ns: int) -> None:
        rows = sum(request.batch_size(self._batched) for request in requests)
        self._stats.batch_done(rows, 0, time.monotonic_ns() - started_ns, 0)

    def close(self) -> None:
        """Release the backend instance in its own thread, then the thread."""
        try:
            self._executor.submit(self.instance.close).result(timeout=30)
        finally:
            self._executor.shutdown(wait=False)


class QuickThreadedInstance(ThreadedInstance):
    """A ThreadedInstance of a QuickInstance backend, or of a LoopSafeInstance
    measured cheap: the batcher may also run a cheap request on it at once
    (ImmediateInstance). Other model backends get the plain ThreadedInstance, so
    their requests never take that detour."""

    def execute_now(self, requests: list[InferRequest]) -> list[InferResponse | Exception] | None:
        """The batch run here, on the loop, when the instance says it is cheap; else None."""
        return self._run_inline(requests)


def inline_budget_for(config: mc.ModelConfig, instance: BackendInstance) -> InlineBudget | None:
    """A budget for a loop-safe instance whose model allows running on the loop."""
    bound_us = inline_bound_us(config)  # checked for every model: a bad value is an error
    if not bound_us or not isinstance(instance, LoopSafeInstance) or not instance.loop_safe:
        return None
    return InlineBudget(bound_us)


def instance_specs(config: mc.ModelConfig, cuda_devices: int) -> list[InstanceSpec]:
    """Expand instance_group into one spec per instance (Triton's naming and rules)."""
    groups = list(config.instance_group) or [mc.ModelInstanceGroup(count=1)]
    specs: list[tuple[str, str, str]] = []
    for index, group in enumerate(groups):
        name = group.name or f"{config.name}_{index}"
        count = group.count or 1  # Triton treats an unset count as 1
        kind = group.kind
        if kind == mc.ModelInstanceGroup.KIND_AUTO:
            kind = (
                mc.ModelInstanceGroup.KIND_GPU if cuda_devices else mc.ModelInstanceGroup.KIND_CPU
            )
        if kind == mc.ModelInstanceGroup.KIND_GPU:
            if cuda_devices == 0:
                raise ConfigError(
                    f"model '{config.name}': instance_group '{name}' asks for KIND_GPU, "
                    "but CUDA is not available on this host"
                )
            gpus = list(group.gpus) or list(range(cuda_devices))
            bad = [gpu for gpu in gpus if gpu < 0 or gpu >= cuda_devices]
            if bad:
                raise ConfigError(
                    f"model '{config.name}': instance_group '{name}' lists gpus {bad}, "
                    f"but this host has {cuda_devices} CUDA device(s)"
                )
            specs += [
                (f"{name}_{gpu}_{i}", "KIND_GPU", f"cuda:{gpu}")
                for gpu in gpus
                for i in range(count)
            ]
        else:
            specs += [(f"{name}_{i}", "KIND_CPU", "cpu") for i in range(count)]
    cpu_instances = sum(1 for _, kind, _ in specs if kind == "KIND_CPU")
    threads = _configured_threads(config) or default_intra_op_threads(cpu_instances)
    return [InstanceSpec(name=n, kind=k, device=d, intra_op_threads=threads) for n, k, d in specs]


def _configured_threads(config: mc.ModelConfig) -> int:
    for key in ("intra_op_thread_count", "INTRA_OP_THREAD_COUNT"):
        if key in config.parameters:
            value = config.parameters[key].string_value
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"model '{config.name}': parameter {key} must be a "
                    f"positive integer, got {value!r}"
                )
            return int(value)
    return 0


GPU_DEVICES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")
"""Device nodes without which torch finds no CUDA device (NVIDIA; WSL's; ROCm's for AMD)."""


def cuda_device_count() -> int:
    """CUDA devices torch can see (0 without torch or CUDA).

    On a host with no GPU device node torch is not imported to say so: a stage
    that runs no torch (tokenizer, preprocess) would spend seconds importing it.
    """
    if "torch" not in sys.modules and not any(glob.glob(pattern) for pattern in GPU_DEVICES):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
