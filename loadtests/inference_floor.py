"""The in-process floor of ``bench_inference.py``: the model run with no server.

The backend's own instance class runs in this process, each instance in its
own single thread as ``ThreadedInstance`` does in the server, at each batch size
in turn; the best images/s is what the server is measured against. CPU per
image (this process's, from ``os.times``) barely moves with neighbours, unlike
the rate, so it is reported too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from common import CpuUsage, sample_cpu, settle

from services.inference.main import backends
from shared.backend import BackendInstance, ModelSpec, config_parameters
from shared.instances import cuda_device_count, instance_specs
from shared.repository import ModelRepository

INPUT, OUTPUT = "input", "logits"
"""MobileNetV2's tensor names (both the ONNX and the TorchScript export)."""
QUIET_CORES = 0.15
"""Other processes' CPU below which a second counts as quiet (a measurement may start)."""
NOISY_CORES = 0.25
"""Other processes' CPU above which a measurement is flagged as disturbed."""


@dataclass(frozen=True)
class FloorSettings:
    """How the floor is measured."""

    batches: tuple[int, ...]
    """Batch sizes tried."""
    seconds: float
    """Loop time of each batch size."""
    settle_s: float
    """Longest extra wait, before each measurement, for other processes to leave the cores."""
    attempts: int
    """Measurements of each batch size at most, while other processes disturb them (>= 1)."""


@dataclass(frozen=True)
class FloorPoint:
    """The in-process floor at one batch size."""

    rate: float
    """Images/s, all instances running at once."""
    cpu_ms: float
    """CPU of this process per image: robust to neighbours, unlike the rate."""
    others: float
    """Cores other processes kept busy meanwhile."""


@dataclass(frozen=True)
class Floor:
    """The model run in this process, no server: the best the instances can do."""

    points: dict[int, FloorPoint]
    """By batch size."""
    logits: np.ndarray
    """Batch-1 output for the benchmark image, to check the server's answer against."""
    instances: int
    threads: int
    """Intra-op threads per instance (what the server gives each instance)."""

    @property
    def best(self) -> tuple[int, FloorPoint]:
        """(batch size, point) of the fastest batch size."""
        return max(self.points.items(), key=lambda item: item[1].rate)


def model_spec(repository: Path, name: str) -> ModelSpec:
    """The ModelSpec the server's model manager builds for version 1 of ``name``."""
    entry = ModelRepository(repository).entry(name)
    return ModelSpec(
        name=entry.name,
        version=1,
        path=entry.version_path(1),
        config=entry.config,
        parameters=config_parameters(entry.config),
    )


def measure_floor(spec: ModelSpec, image: np.ndarray, settings: FloorSettings) -> Floor:
    """Run the backend's own instances in this process at each floor batch size.

    Each instance is created and run in its own single thread, as
    ``ThreadedInstance`` does in the server (torch's thread count is set by the
    creating thread), so session options and thread counts are the server's.
    """
    layout = instance_specs(spec.config, cuda_device_count())  # KIND_GPU: on the GPU too
    backend = backends()[spec.config.backend]
    pools = [ThreadPoolExecutor(max_workers=1) for _ in layout]
    try:
        instances = [
            _tensor_instance(pool.submit(backend.create_instance, spec, where).result())
            for pool, where in zip(pools, layout, strict=True)
        ]
        logits = pools[0].submit(instances[0].run, {INPUT: image[None]}).result()[OUTPUT][0]
        points = {}
        for batch in settings.batches:
            measure = partial(_floor_point, instances, pools, image, batch, settings.seconds)
            points[batch] = _quietest(measure, settings)
        for pool, instance in zip(pools, instances, strict=True):
            pool.submit(instance.close).result()
    finally:
        for pool in pools:
            pool.shutdown(wait=True)
    return Floor(points, logits, len(layout), layout[0].intra_op_threads)


def _quietest(measure: Callable[[], FloorPoint], settings: FloorSettings) -> FloorPoint:
    """The least disturbed of up to ``settings.attempts`` floor measurements."""
    best: FloorPoint | None = None
    for _ in range(settings.attempts):
        # No processes under test but this one: settle leaves out only its CPU.
        asyncio.run(settle({}, settings.settle_s, QUIET_CORES))
        point = measure()
        best = point if best is None or point.others < best.others else best
        if best.others <= NOISY_CORES:
            break
    assert best is not None
    return best


def _tensor_instance(instance: BackendInstance) -> Any:
    if not hasattr(instance, "run"):
        raise TypeError(f"{type(instance).__name__} has no run(); not a tensor backend")
    return instance


def _floor_point(
    instances: Sequence[Any],
    pools: Sequence[ThreadPoolExecutor],
    image: np.ndarray,
    batch: int,
    seconds: float,
) -> FloorPoint:
    """Every instance looping on ``batch`` rows for ``seconds``."""
    inputs = {INPUT: np.ascontiguousarray(np.broadcast_to(image, (batch, *image.shape)))}
    # TorchScript specialises on the first runs of a shape; ORT allocates its arenas.
    pairs = list(zip(pools, instances, strict=True))
    warm = [pool.submit(_loop, one, inputs, 0.0, 3) for pool, one in pairs]
    for future in warm:
        future.result()
    before = sample_cpu({})
    runs = [pool.submit(_loop, one, inputs, before.wall + seconds) for pool, one in pairs]
    images = sum(future.result() for future in runs) * batch
    usage = CpuUsage.between(before, sample_cpu({}))
    return FloorPoint(images / usage.seconds, usage.client * 1000 / images, usage.others)


def _loop(instance: Any, inputs: dict[str, np.ndarray], deadline: float, at_least: int = 1) -> int:
    """Run until ``deadline`` (and at least ``at_least`` times); the number of runs."""
    runs = 0
    while runs < at_least or time.perf_counter() < deadline:
        instance.run(inputs)
        runs += 1
    return runs
