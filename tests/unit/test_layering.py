"""The layering the architecture promises: shared imports no service, services
import no gateway, and no module imports itself back through others.

One front door lives under services/: the batch worker turns a job's lines
into the same calls the HTTP adapter makes for the same documents, so it uses
the adapter's document translation (and nothing else of the gateway's): a
line of a job means exactly what the same request sent online means."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services", "gateway", "deploy", "models")
DOCUMENT_TRANSLATION = ("gateway.http.openai_documents", "gateway.http.rest")
"""What the batch worker may take from the gateway: JSON documents <-> protos."""


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in it, functions too)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                wanted = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(w for w in wanted if w in modules)
    return graph


def test_shared_imports_no_service_and_services_no_gateway() -> None:
    graph = imports(project_modules())
    assert "shared.manager" in graph["shared.stage"]  # the scan sees imports at all
    wrong = [
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if (module.startswith("shared") and target.split(".")[0] != "shared")
        or (
            module.startswith("services")
            and target.startswith(("gateway", "deploy"))
            and not (module.startswith("services.batch") and target in DOCUMENT_TRANSLATION)
        )
    ]
    assert wrong == []


def test_no_import_cycles() -> None:
    graph = imports(project_modules())
    cycles: list[list[str]] = []
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in sorted(graph[module]):
            if seen.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in seen:
                visit(target, [*path, target])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    assert cycles == []
