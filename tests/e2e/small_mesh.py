"""A mesh with the whole chat and image paths but no vLLM, for tests that need
every service (Envoy, HTTP adapter, orchestrator, each stage, the supervisor)
and not the LLM engine's start-up: the engine is a python stand-in with vLLM's
contract (tests/data/models/echo_engine) under the engine's name."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import DATA
from tests.e2e.conftest import start_mesh
from tests.harness import ROOT

REAL_MODELS = (
    "llm",
    "smollm2_tokenizer",
    "smollm2_detokenizer",
    "image_classifier",
    "image_preprocess",
    "mobilenet_v2_onnx",
    "imagenet_top5",
)


def start_small_mesh(
    prepared: Path, folder: Path, otlp_endpoint: str
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start it (free ports; spans to ``otlp_endpoint``); the supervisor and its ready info."""
    repository = folder / "repository"
    repository.mkdir()
    for name in REAL_MODELS:
        (repository / name).symlink_to(prepared / name, target_is_directory=True)
    engine = repository / "smollm2"
    shutil.copytree(DATA / "models" / "echo_engine", engine)
    config_file = engine / "config.pbtxt"
    config_file.write_text(config_file.read_text().replace('"echo_engine"', '"smollm2"'))
    default = (ROOT / "deploy" / "local" / "mesh.yaml").read_text()
    config = folder / "mesh.yaml"
    endpoint = f"defaults:\n  otlp_endpoint: {otlp_endpoint}\n"
    config.write_text(default.replace("defaults:\n", endpoint, 1))
    return start_mesh(repository, config, ["--grace-s", "2"])
