"""The tokenizer service: hosts ``tokenizer`` models (text and chat -> token ids).

``python -m services.tokenizer.main --model-repository DIR [--grpc-port N]``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pydantic import Field

from services.tokenizer.backend import TokenizerBackend
from shared.backend import Backend
from shared.stage import StageConfig, run_stage


class TokenizerConfig(StageConfig):
    """Settings of the tokenizer service."""

    grpc_port: int = Field(8004, ge=0, le=65535)
    """gRPC port of the tokenizer service."""


def backends() -> dict[str, Backend]:
    """The backends this service registers, by name."""
    return {b.name: b for b in (TokenizerBackend(),)}


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the tokenizer backend until SIGTERM."""
    run_stage("tokenizer", TokenizerConfig, backends(), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
