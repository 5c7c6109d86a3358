"""The default LLM runs in float32 on every x86-64 CPU, and the dtype in use is logged.

SmolLM2-135M answers "What is the capital of France?" with nonsense in bfloat16
and with Paris in float32, so the dtype must not depend on which CPU serves it.
These tests read the prepared repository's ``smollm2`` config through the vllm
backend's own ``EngineSettings`` and let vLLM's own ``ModelConfig`` resolve the
dtype (what the engine does at start, without starting it), with torch's check
for native bfloat16 (AVX512-BF16, AMX) forced either way: no CPU of the other
kind is at hand. A cache prepared before a config changed must not keep the old
one, and oneDNN must not be told to round float32 through bfloat16 (which only
CPUs with bfloat16 hardware would do).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest

from models import prepare
from models.prepare import prepare_repository
from services.inference.vllm import _pin_float_math
from services.inference.vllm_settings import EngineSettings, dtype_name, log_dtype
from shared.backend import ModelSpec, config_parameters
from shared.repository import parse_config
from tests.conftest import cache_dir

MODEL = "smollm2"
LOGGER = "services.inference.vllm_settings"


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    folder: Path = prepare_repository(cache_dir(), models=[MODEL], echo=lambda _: None) / MODEL
    config = parse_config(folder / "config.pbtxt")
    return ModelSpec(MODEL, 1, folder / "1", config, config_parameters(config))


@pytest.fixture(params=[False, True], ids=["no-native-bf16", "native-bf16"])
def native_bf16(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """This CPU seen as one with (or without) AVX512-BF16 and AMX."""
    import torch

    flag: bool = request.param
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: flag)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: flag)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # vLLM's caches in the project's cache folder, as the inference service keeps them.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
    return flag


def resolved(settings: EngineSettings, spec: ModelSpec) -> str:
    """The dtype vLLM's engine would run ``spec`` in with these settings."""
    return dtype_name(settings.engine_args(spec).create_model_config().dtype)


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_default_llm_config_names_float32(spec: ModelSpec) -> None:
    assert EngineSettings.from_spec(spec).dtype == "float32"


def test_default_llm_runs_in_float32_whatever_the_cpu(
    spec: ModelSpec, native_bf16: bool, caplog: pytest.LogCaptureFixture
) -> None:
    settings = EngineSettings.from_spec(spec)
    in_use = resolved(settings, spec)
    assert in_use == "float32"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log_dtype("model 'smollm2'", settings.dtype, in_use, on_cpu=True)
    assert logged(caplog) == [
        "model 'smollm2': dtype float32 in use (requested float32): as configured"
    ]


def test_auto_is_vllms_choice_on_every_cpu_and_logged_with_the_cpus_bfloat16(
    spec: ModelSpec, native_bf16: bool, caplog: pytest.LogCaptureFixture
) -> None:
    settings = dataclasses.replace(EngineSettings.from_spec(spec), dtype="auto")
    in_use = resolved(settings, spec)
    assert in_use == "bfloat16"  # the checkpoint's torch_dtype, with or without native bf16
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log_dtype("model 'smollm2'", settings.dtype, in_use, on_cpu=True)
    cpu = (
        "this CPU computes bfloat16 natively (AVX512-BF16/AMX)"
        if native_bf16
        else "this CPU has no native bfloat16 (no AVX512-BF16/AMX): emulated, slower"
    )
    assert logged(caplog) == [
        "model 'smollm2': dtype bfloat16 in use (requested auto): auto: vLLM's choice "
        f"from the checkpoint's torch_dtype, the same on every CPU; {cpu}"
    ]


def test_a_warm_cache_rebuilds_a_model_whose_config_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = "mean_pool"  # no model file to build: the config is the whole difference
    config = tmp_path / "repository" / model / "config.pbtxt"
    prepare_repository(tmp_path, models=[model], echo=lambda _: None)
    added = 'parameters {\n  key: "dtype"\n  value: { string_value: "float32" }\n}\n'
    changed = tuple(
        dataclasses.replace(r, config=r.config + added) if r.name == model else r
        for r in prepare.RECIPES
    )
    monkeypatch.setattr(prepare, "RECIPES", changed)
    messages: list[str] = []
    prepare_repository(tmp_path, models=[model], echo=messages.append)
    assert f"{model}: up to date" not in messages
    assert config.read_text(encoding="utf-8").endswith(added)


def test_the_engine_never_rounds_float32_through_bfloat16(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    with caplog.at_level(logging.WARNING, logger="services.inference.vllm"):
        _pin_float_math()
    assert os.environ["ONEDNN_DEFAULT_FPMATH_MODE"] == "STRICT"  # the engine's processes inherit it
    assert [r.getMessage() for r in caplog.records] == [
        "ONEDNN_DEFAULT_FPMATH_MODE=BF16 ignored: it would make float32 answers differ by CPU; "
        "set the model's dtype parameter instead"
    ]
