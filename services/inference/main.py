"""The inference service: runs pytorch, onnxruntime, python, vllm (and its LoRA adapters,
vllm_lora) and torchserve models.

``python -m services.inference.main --model-repository DIR [--grpc-port N]``
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry
from pydantic import Field

from services.inference.onnx import OnnxBackend
from services.inference.python import PythonBackend
from services.inference.pytorch import PyTorchBackend
from services.inference.torchserve import TorchServeBackend
from services.inference.vllm import VllmBackend
from services.inference.vllm import preload as vllm_preload
from services.inference.vllm_lora import LoraBackend
from shared import launch
from shared.backend import Backend
from shared.config import load_config
from shared.launch import run_service
from shared.repository import ModelRepository
from shared.stage import StageConfig, build_stage_parts


class InferenceConfig(StageConfig):
    """Settings of the inference service."""

    grpc_port: int = Field(8003, ge=0, le=65535)
    """gRPC port of the inference service."""


def backends() -> dict[str, Backend]:
    """The backends this service registers, by name."""
    llm = VllmBackend()
    every = (PyTorchBackend(), OnnxBackend(), PythonBackend(), llm, TorchServeBackend())
    return {b.name: b for b in every} | {LoraBackend.name: LoraBackend(llm)}


PRELOADS = {
    "onnxruntime": "onnxruntime",
    "onnxruntime_onnx": "onnxruntime",
    "pytorch": "torch",
    "pytorch_libtorch": "torch",
    "torchserve": "torch",
}
"""Backend -> the module its models import when they load (seconds each)."""


def preload(argv: Sequence[str]) -> None:
    """Import what the models this service would load need: a standby
    (deploy/local/standby.py) calls this with the service's arguments, so its
    restart skips those imports. With an LLM, vLLM's client too: its engine runs
    in processes of its own, but the client's import would hold the GIL, and with
    it the event loop, for seconds while the other models serve."""
    config = load_config(InferenceConfig, argv, service="inference")
    import_backends(config)


def import_backends(config: StageConfig) -> None:
    """The imports of ``preload`` for the models a stage with ``config`` loads."""
    repository = ModelRepository(config.model_repository)
    names = config.load_models or repository.names()
    backends = {repository.declared_backend(name) for name in names if repository.has(name)}
    for module in sorted({PRELOADS[b] for b in backends if b in PRELOADS}):
        importlib.import_module(module)
    if backends & {VllmBackend.name, LoraBackend.name}:
        vllm_preload()


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the inference backends until SIGTERM."""
    config = load_config(InferenceConfig, argv, service="inference")
    registered = backends()
    parts = build_stage_parts(config, registered)
    attach_metrics(registered, parts.registry)
    launch.run(run_service(config, parts), config)


def attach_metrics(registered: Mapping[str, Backend], registry: CollectorRegistry) -> None:
    """Put the metrics of the backends from ``backends()`` on the stage's /metrics."""
    # The LLM metrics (meshserve_llm_*); the engines that feed them start later,
    # in the load hook.
    llm = registered[VllmBackend.name]
    assert isinstance(llm, VllmBackend)
    llm.registry = registry
    archives = registered[TorchServeBackend.name]
    assert isinstance(archives, TorchServeBackend)
    archives.metrics.attach(registry)  # TorchServe's ts_* names


# Also keeps vLLM's spawned engine processes, which import this module, from serving.
if __name__ == "__main__":
    main(sys.argv[1:])
