"""The frozen heap (shared/gc_heap.py): a service freezes what it holds once it
is ready, and what a model's unload drops is still collected, reference cycles
and all, although it was frozen; a heap nobody froze is left as it was."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared import gc_heap
from shared.backend import InstanceSpec, ModelSpec, TensorInstance
from shared.manager import ModelManager
from shared.repository import ModelRepository


class _Cycle:
    """An object only the cyclic collector can free: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    """The test process's heap unfrozen again, whatever the test did."""
    yield
    gc.unfreeze()


def test_a_frozen_cycle_dropped_is_collected_when_a_thawed_block_ends(
    unfrozen_after: None,
) -> None:
    kept = _Cycle()
    ref = weakref.ref(kept)
    gc_heap.freeze()
    assert gc.get_freeze_count() > 0
    del kept
    gc.collect()
    assert ref() is not None  # frozen: no collection looks at it
    with gc_heap.thawed():
        assert gc.get_freeze_count() == 0
    assert ref() is None
    assert gc.get_freeze_count() > 0  # frozen again


def test_overlapping_blocks_freeze_again_once_the_last_ends(unfrozen_after: None) -> None:
    gc_heap.freeze()
    with gc_heap.thawed():
        with gc_heap.thawed():
            pass
        assert gc.get_freeze_count() == 0  # another load is still under way
    assert gc.get_freeze_count() > 0


def test_a_heap_nobody_froze_is_left_unfrozen() -> None:
    assert gc.get_freeze_count() == 0
    kept = _Cycle()
    ref = weakref.ref(kept)
    with gc_heap.thawed():
        del kept
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


CONFIG = """
name: "probe"
backend: "gc_probe"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def test_a_model_loaded_before_the_freeze_is_collected_when_unloaded(
    tmp_path: Path, unfrozen_after: None
) -> None:
    made: list[weakref.ref[Any]] = []

    class Probe(TensorInstance):
        def __init__(self, model: ModelSpec) -> None:
            super().__init__(model)
            self.me = self  # as a model's objects often do (vLLM's engine among them)
            made.append(weakref.ref(self))

        def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {"Y": inputs["X"]}

    class ProbeBackend:
        def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> Probe:
            return Probe(model)

    (tmp_path / "probe" / "1").mkdir(parents=True)
    (tmp_path / "probe" / "config.pbtxt").write_text(CONFIG)
    manager = ModelManager(ModelRepository(tmp_path), {"gc_probe": ProbeBackend()})

    async def serve() -> None:
        await manager.load("probe")
        assert made
        gc_heap.freeze()  # as the service does once it is ready
        await manager.unload("probe")

    asyncio.run(serve())
    assert [ref() for ref in made] == [None] * len(made)
    assert gc.get_freeze_count() > 0
