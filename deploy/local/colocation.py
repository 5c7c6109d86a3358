"""The stages the mesh YAML lists, run in one process (``--colocate``).

Stages differ only in the backends they register, so one process can host
several (services/colocated/main.py); it also runs whole each ensemble whose
steps are all its models, one hop instead of one per step
(docs/configuration.md#stages-in-one-process).
"""

from __future__ import annotations

from typing import Any

COLOCATED_STAGES = {
    f"services.{name}.main" for name in ("tokenizer", "preprocess", "inference", "postprocess")
}
"""The stage modules ``--colocate`` runs in one process."""


def colocated(mesh: dict[str, Any]) -> dict[str, Any]:
    """``mesh`` with its tokenizer, preprocess, inference and postprocess stages
    replaced by one ``services.colocated.main`` process hosting them all, which
    runs the ensembles of their models whole (docs/configuration.md#stages-in-one-process)."""
    settings = dict(mesh.get("supervisor") or {})
    stages = list(settings.get("stages", []))
    covered = [stage for stage in stages if stage.get("module") in COLOCATED_STAGES]
    if not covered:
        return mesh
    standby = any(bool(stage.get("standby", False)) for stage in covered)
    one = {"name": "colocated", "module": "services.colocated.main", "standby": standby}
    kept = [stage for stage in stages if stage not in covered]
    settings["stages"] = [one, *kept]
    return {**mesh, "supervisor": settings}
