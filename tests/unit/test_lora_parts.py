"""The LoRA and prefix-cache pieces that need no engine: adapter settings and folders,
the vLLM management bodies, the derived pipeline config, the prefix counters."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from google.protobuf import text_format
from prometheus_client import CollectorRegistry

from gateway.http.lora import adapter_name
from gateway.http.openai_protocol import InvalidParam
from inference import model_config_pb2 as mc
from models import smollm2, smollm2_lora
from services.inference.vllm_lora import LoraSettings
from services.inference.vllm_prefix import PrefixCacheMetrics
from services.inference.vllm_settings import EngineSettings
from services.orchestrator.adapters import _derived_config
from services.orchestrator.ensemble import EnsemblePlan
from shared.backend import ModelSpec
from shared.errors import ConfigError, InvalidArgument


def _spec(path: Path, **parameters: str) -> ModelSpec:
    return ModelSpec("smollm2_hello", 1, path, mc.ModelConfig(), dict(parameters))


def test_an_adapter_needs_its_base_and_its_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="base_model"):
        LoraSettings.from_spec(_spec(tmp_path))
    settings = LoraSettings.from_spec(_spec(tmp_path, base_model="smollm2"))
    with pytest.raises(ConfigError, match="adapter_config.json"):
        settings.folder(_spec(tmp_path, base_model="smollm2"))
    (tmp_path / "adapter_config.json").write_text("{}")
    assert settings.folder(_spec(tmp_path, base_model="smollm2")) == tmp_path


def test_lora_engine_settings_are_checked_by_name() -> None:
    spec = ModelSpec("m", 1, Path("."), mc.ModelConfig(), {"max_lora_rank": "12"})
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineSettings.from_spec(spec)
    spec = ModelSpec("m", 1, Path("."), mc.ModelConfig(), {"max_loras": "0"})
    with pytest.raises(ConfigError, match="max_loras"):
        EngineSettings.from_spec(spec)
    on = {"enable_lora": "true", "max_lora_rank": "8", "max_num_batched_tokens": "512"}
    settings = EngineSettings.from_spec(ModelSpec("m", 1, Path("."), mc.ModelConfig(), on))
    assert (settings.enable_lora, settings.max_lora_rank) == (True, 8)
    assert settings.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{}", "lora_name"),
        (b'{"lora_name": 3}', "lora_name"),
        (b'{"lora_name": "a", "lora_path": "/somewhere"}', "lora_path"),
    ],
)
def test_management_bodies_name_the_bad_field(body: bytes, field: str) -> None:
    with pytest.raises(InvalidParam) as raised:
        adapter_name(body)
    assert raised.value.param == field


def test_management_body_gives_the_adapter_name() -> None:
    assert adapter_name(b'{"lora_name": "smollm2_hello", "lora_path": ""}') == "smollm2_hello"
    with pytest.raises(InvalidArgument, match="JSON object"):
        adapter_name(b"[]")


def test_the_adapter_pipeline_swaps_only_the_engine_step() -> None:
    config = text_format.Parse(smollm2.LLM_CONFIG, mc.ModelConfig())
    parent = EnsemblePlan(config, [], SimpleNamespace())  # type: ignore[arg-type]
    derived = _derived_config(parent, "smollm2_hello", "smollm2")
    steps = [step.model_name for step in derived.ensemble_scheduling.step]
    assert steps == ["smollm2_tokenizer", "smollm2_hello", "smollm2_detokenizer"]
    assert derived.name == "smollm2_hello" and config.name == "llm"


def test_the_adapter_config_has_the_base_tensors() -> None:
    adapter = text_format.Parse(smollm2_lora.ADAPTER_CONFIG, mc.ModelConfig())
    base = text_format.Parse(smollm2.MODEL_CONFIG, mc.ModelConfig())
    assert adapter.backend == "vllm_lora"
    assert adapter.parameters["base_model"].string_value == "smollm2"
    assert list(adapter.input) == list(base.input)
    assert list(adapter.output) == list(base.output)


def test_prefix_counters_add_each_steps_lookups() -> None:
    registry = CollectorRegistry()
    series = PrefixCacheMetrics(registry).series(("smollm2", "1"))
    series.record(SimpleNamespace(queries=64, hits=0))
    series.record(SimpleNamespace(queries=64, hits=48))
    series.record(None)
    labels = {"model": "smollm2", "version": "1"}
    assert registry.get_sample_value("meshserve_llm_prefix_cache_queries_total", labels) == 128
    assert registry.get_sample_value("meshserve_llm_prefix_cache_hits_total", labels) == 48
