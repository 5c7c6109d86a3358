"""Which ensembles give way to a stage that serves a model of the same name: only
those read from the repository (a colocated stage runs those whole), never a plan
derived here, such as a LoRA adapter's pipeline, whose name is also the adapter's
own model on the engine's stage."""

from __future__ import annotations

import asyncio
from pathlib import Path

from google.protobuf import text_format

from inference import model_config_pb2 as mc
from services.orchestrator.ensembles import EnsembleRegistry
from shared.repository import ModelRepository

STEP = 'name: "double" backend: "python" max_batch_size: 8 ' + (
    'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ] '
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]'
)
ENSEMBLE = """platform: "ensemble" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "double" model_version: -1
  input_map { key: "X" value: "IN" } output_map { key: "Y" value: "OUT" } } ] }
"""


def test_only_repository_ensembles_give_way_to_a_stage(tmp_path: Path) -> None:
    (tmp_path / "pipeline" / "1").mkdir(parents=True)
    (tmp_path / "pipeline" / "config.pbtxt").write_text(f'name: "pipeline"\n{ENSEMBLE}')

    async def fetch(name: str) -> mc.ModelConfig:
        return text_format.Parse(STEP, mc.ModelConfig())

    # A stage serves a model of every name (the colocated stage's "pipeline", the
    # engine stage's adapter "derived").
    registry = EnsembleRegistry(ModelRepository(tmp_path), fetch, None, lambda name: True)
    derived = text_format.Parse(f'name: "derived"\n{ENSEMBLE}', mc.ModelConfig())

    async def load() -> None:
        await registry.load("pipeline")
        await registry.load("derived", derived)

    asyncio.run(load())
    assert registry.get("pipeline") is None  # forwarded to the stage that runs it whole
    assert registry.served_whole("pipeline") and not registry.runs_here("pipeline")
    assert registry.get("derived") is not None  # run here, as before
    assert not registry.served_whole("derived") and registry.runs_here("derived")
    registry.unload("pipeline")
    assert not registry.served_whole("pipeline")
