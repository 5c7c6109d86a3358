"""The preprocess service: hosts ``image_preprocess`` models (image bytes -> pixels).

``python -m services.preprocess.main --model-repository DIR [--grpc-port N]``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pydantic import Field

from services.preprocess.backend import ImagePreprocessBackend
from shared.backend import Backend
from shared.stage import StageConfig, run_stage


class PreprocessConfig(StageConfig):
    """Settings of the preprocess service."""

    grpc_port: int = Field(8005, ge=0, le=65535)
    """gRPC port of the preprocess service."""


def backends() -> dict[str, Backend]:
    """The backends this service registers, by name."""
    return {b.name: b for b in (ImagePreprocessBackend(),)}


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the image preprocess backend until SIGTERM."""
    run_stage("preprocess", PreprocessConfig, backends(), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
