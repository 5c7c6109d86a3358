"""The postprocess service: hosts ``classify``, ``embedding_pool`` and ``detokenize`` models.

``python -m services.postprocess.main --model-repository DIR [--grpc-port N]``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pydantic import Field

from services.postprocess.classify import ClassifyBackend
from services.postprocess.detokenize import DetokenizeBackend
from services.postprocess.pool import EmbeddingPoolBackend
from shared.backend import Backend
from shared.stage import StageConfig, run_stage


class PostprocessConfig(StageConfig):
    """Settings of the postprocess service."""

    grpc_port: int = Field(8006, ge=0, le=65535)
    """gRPC port of the postprocess service."""


def backends() -> dict[str, Backend]:
    """The backends this service registers, by name."""
    return {b.name: b for b in (ClassifyBackend(), EmbeddingPoolBackend(), DetokenizeBackend())}


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the postprocess backends until SIGTERM."""
    run_stage("postprocess", PostprocessConfig, backends(), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
