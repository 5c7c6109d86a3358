"""The inference service: runs pytorch, onnxruntime and python models.

``python -m services.inference.main --model-repository DIR [--grpc-port N]``
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from services.inference.onnx import OnnxBackend
from services.inference.python import PythonBackend
from services.inference.pytorch import PyTorchBackend
from shared.backend import Backend
from shared.config import ServiceConfig, load_config
from shared.launch import run_service
from shared.manager import ModelManager
from shared.repository import ModelRepository
from shared.server import ServiceParts
from shared.servicer import SERVICE_NAME, InferenceServicer, add_to_server
from shared.statistics import Metrics


class InferenceConfig(ServiceConfig):
    """Settings of the inference service."""

    grpc_port: int = Field(8003, ge=0, le=65535)
    """gRPC port of the inference service."""
    model_repository: Path = Path("model_repository")
    """Triton-layout model repository folder."""
    load_models: list[str] = Field(default_factory=list)
    """Models to load at start; empty loads every model this service hosts."""


def backends() -> dict[str, Backend]:
    """The backends this service registers, by name."""
    return {b.name: b for b in (PyTorchBackend(), OnnxBackend(), PythonBackend())}


def build_parts(config: InferenceConfig) -> ServiceParts:
    """The servicer, model manager and hooks of the inference service."""
    parts = ServiceParts(servicers=[], service_names=[SERVICE_NAME])
    manager = ModelManager(
        ModelRepository(config.model_repository), backends(), Metrics(parts.registry)
    )
    parts.servicers = [(add_to_server, InferenceServicer(manager))]

    async def load() -> None:
        await manager.load_all(config.load_models or None)

    parts.on_start = [load]
    parts.on_stop = [manager.unload_all]
    return parts


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the config once and serve until SIGTERM."""
    config = load_config(InferenceConfig, argv, service="inference")
    asyncio.run(run_service(config, build_parts(config)))


if __name__ == "__main__":
    main(sys.argv[1:])
