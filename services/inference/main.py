"""The inference service: runs pytorch, onnxruntime and python models.

``python -m services.inference.main --model-repository DIR [--grpc-port N]``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pydantic import Field

from services.inference.onnx import OnnxBackend
from services.inference.python import PythonBackend
from services.inference.pytorch import PyTorchBackend
from shared.backend import Backend
from shared.stage import StageConfig, run_stage


class InferenceConfig(StageConfig):
    """Settings of the inference service."""

    grpc_port: int = Field(8003, ge=0, le=65535)
    """gRPC port of the inference service."""


def backends() -> dict[str, Backend]:
    """The backends this service registers, by name."""
    return {b.name: b for b in (PyTorchBackend(), OnnxBackend(), PythonBackend())}


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the inference backends until SIGTERM."""
    run_stage("inference", InferenceConfig, backends(), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
