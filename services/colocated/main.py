"""Several stages in one process: their backends on one v2 server, and the
ensembles whose every step they host run here whole (local_ensembles.py).

On one small host a pipeline's steps then cost no gRPC hop each, as in a
one-process server; the orchestrator, Envoy and every front door stay as they
are, and the same models can still run as separate stages (or on other hosts)
when they outgrow it (docs/configuration.md#stages-in-one-process).

``python -m services.colocated.main --model-repository DIR [--stages tokenizer ...]``
(``--stages`` once per stage; default: tokenizer, preprocess, inference, postprocess)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field

from services.colocated.local_ensembles import LocalEnsembleBackend
from services.inference import main as inference
from services.postprocess import main as postprocess
from services.preprocess import main as preprocess
from services.tokenizer import main as tokenizer
from shared import launch
from shared.backend import Backend
from shared.config import load_config
from shared.launch import run_service
from shared.stage import StageConfig, build_stage_parts

Stage = Literal["tokenizer", "preprocess", "inference", "postprocess"]
ALL_STAGES: tuple[Stage, ...] = ("tokenizer", "preprocess", "inference", "postprocess")

STAGE_BACKENDS: dict[str, Callable[[], dict[str, Backend]]] = {
    "tokenizer": tokenizer.backends,
    "preprocess": preprocess.backends,
    "inference": inference.backends,
    "postprocess": postprocess.backends,
}
"""Each stage service's ``backends()``: what this process registers for it."""


class ColocatedConfig(StageConfig):
    """Settings of a process hosting several stages."""

    grpc_port: int = Field(8011, ge=0, le=65535)
    """gRPC port of the process."""
    stages: list[Stage] = Field(default_factory=lambda: list(ALL_STAGES), min_length=1)
    """The stages whose models this process hosts (their backends)."""


def backends(stages: Sequence[str]) -> dict[str, Backend]:
    """The backends of ``stages``, and the ensemble backend for their pipelines."""
    registered: dict[str, Backend] = {}
    for stage in stages:
        registered |= STAGE_BACKENDS[stage]()
    ensembles = LocalEnsembleBackend()
    return registered | {ensembles.name: ensembles}


def preload(argv: Sequence[str]) -> None:
    """What a standby imports before it takes over (deploy/local/standby.py): the
    inference stage's, when this process hosts it."""
    config = load_config(ColocatedConfig, argv, service="colocated")
    if "inference" in config.stages:
        inference.import_backends(config)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the stages' backends until SIGTERM."""
    config = load_config(ColocatedConfig, argv, service="colocated")
    registered = backends(config.stages)
    parts = build_stage_parts(config, registered)
    if "inference" in config.stages:
        inference.attach_metrics(registered, parts.registry)
    launch.run(run_service(config, parts), config)


# Also keeps vLLM's spawned engine processes, which import this module, from serving.
if __name__ == "__main__":
    main(sys.argv[1:])
