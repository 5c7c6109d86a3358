"""The mesh's Grafana dashboards, written as JSON into deploy/grafana/dashboards/.

The JSON files are what Grafana provisions (deploy/grafana/provisioning/);
this module is where they are edited: ``python -m deploy.grafana.dashboards``
rewrites them, and a unit test checks that the files match it. Every panel's
PromQL is run against a real Prometheus scraping a real mesh
(tests/e2e/test_prometheus.py), with ``$model`` as ``.+`` and
``$__rate_interval`` as a minute.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
RATE = "$__rate_interval"
MODEL = 'model=~"$model"'


@dataclass(frozen=True)
class Panel:
    """One time-series panel: a title, a unit and its queries (legend per query)."""

    title: str
    unit: str
    queries: Sequence[tuple[str, str]]
    exemplars: bool = False
    """Show exemplars (trace ids) on the panel: latency histograms carry them."""


@dataclass(frozen=True)
class Dashboard:
    """A dashboard: a uid (its file name), a title, panels two to a row."""

    uid: str
    title: str
    panels: Sequence[Panel]
    model_variable: str = ""
    """A metric whose ``model`` label lists the models for the ``$model`` variable."""
    tags: Sequence[str] = field(default=("meshserve",))


def quantiles(metric: str, by: str, qs: Sequence[float]) -> list[tuple[str, str]]:
    """histogram_quantile queries of ``metric`` per ``by`` (and ``le``)."""
    return [
        (
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{MODEL}}}[{RATE}])))",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in qs
    ]


def _mean(metric: str) -> str:
    return (
        f"sum by (model) (rate({metric}_sum{{{MODEL}}}[{RATE}])) / "
        f"sum by (model) (rate({metric}_count{{{MODEL}}}[{RATE}]))"
    )


def _per_model(selector: str) -> str:
    """``sum by (model)`` of ``selector``, whose ``%s`` take the model filter (and window)."""
    return "sum by (model) (" + selector % (MODEL, RATE)[: selector.count("%s")] + ")"


# Success and failure in one selector: "a + b" would drop a model that never failed.
ANSWERED = '__name__=~"nv_inference_request_(success|failure)"'
REQUESTS = f"sum by (model) (rate({{{ANSWERED}, {MODEL}}}[{RATE}]))"
ERRORS = f"sum by (model, reason) (rate(nv_inference_request_failure{{{MODEL}}}[{RATE}]))"

OVERVIEW = Dashboard(
    "meshserve-overview",
    "meshserve: mesh overview",
    [
        Panel("Requests per second", "reqps", [(REQUESTS, "{{model}}")]),
        Panel(
            "Error ratio",
            "percentunit",
            [
                (
                    f"sum by (model) (rate(nv_inference_request_failure{{{MODEL}}}[{RATE}]))"
                    f" / on (model) ({REQUESTS})",
                    "{{model}}",
                )
            ],
        ),
        Panel(
            "p99 latency",
            "s",
            quantiles("meshserve_request_duration_seconds", "model", [0.99]),
            exemplars=True,
        ),
        Panel("Targets up", "short", [("sum by (job) (up)", "{{job}}")]),
        Panel(
            "Models ready",
            "short",
            [(f"max by (model) (meshserve_model_ready{{{MODEL}}})", "{{model}}")],
        ),
        Panel(
            "Queued requests",
            "short",
            [(f"sum by (model) (nv_inference_pending_request_count{{{MODEL}}})", "{{model}}")],
        ),
    ],
    model_variable="meshserve_model_ready",
)

MODELS = Dashboard(
    "meshserve-models",
    "meshserve: per model",
    [
        Panel("Requests per second", "reqps", [(REQUESTS, "{{model}}")]),
        Panel("Errors per second, by reason", "reqps", [(ERRORS, "{{model}} {{reason}}")]),
        Panel(
            "Latency p50 / p95 / p99",
            "s",
            quantiles("meshserve_request_duration_seconds", "model", [0.5, 0.95, 0.99]),
            exemplars=True,
        ),
        Panel(
            "Queue vs compute (mean)",
            "s",
            [
                (_mean("meshserve_queue_duration_seconds"), "queue {{model}}"),
                (_mean("meshserve_compute_duration_seconds"), "compute {{model}}"),
            ],
            exemplars=True,
        ),
        Panel(
            "Batch size",
            "short",
            [
                (_mean("meshserve_batch_size"), "mean {{model}}"),
                *quantiles("meshserve_batch_size", "model", [0.95]),
            ],
        ),
        Panel(
            "Queued vs queue bound",
            "short",
            [
                (f"sum by (model) (nv_inference_pending_request_count{{{MODEL}}})", "queued"),
                (f"sum by (model) (meshserve_queue_capacity{{{MODEL}}})", "bound {{model}}"),
            ],
        ),
    ],
    model_variable="nv_inference_request_success",
)

LLM = Dashboard(
    "meshserve-llm",
    "meshserve: LLM",
    [
        Panel(
            "Time to first token",
            "s",
            quantiles("meshserve_llm_time_to_first_token_seconds", "model", [0.5, 0.95]),
            exemplars=True,
        ),
        Panel(
            "Inter-token latency",
            "s",
            quantiles("meshserve_llm_inter_token_latency_seconds", "model", [0.5, 0.95]),
        ),
        Panel(
            "Tokens per second",
            "short",
            [
                (
                    _per_model("rate(meshserve_llm_generation_tokens_total{%s}[%s])"),
                    "generated {{model}}",
                ),
                (
                    _per_model("rate(meshserve_llm_prompt_tokens_total{%s}[%s])"),
                    "prompt {{model}}",
                ),
            ],
        ),
        Panel(
            "Requests running / waiting",
            "short",
            [
                (_per_model("meshserve_llm_requests_running{%s}"), "running {{model}}"),
                (_per_model("meshserve_llm_requests_waiting{%s}"), "waiting {{model}}"),
            ],
        ),
        Panel(
            "KV cache in use",
            "percentunit",
            [(f"max by (model) (meshserve_llm_kv_cache_usage_ratio{{{MODEL}}})", "{{model}}")],
        ),
        Panel(
            "Requests finished, by reason",
            "reqps",
            [
                (
                    "sum by (model, finish_reason) "
                    f"(rate(meshserve_llm_requests_finished_total{{{MODEL}}}[{RATE}]))",
                    "{{model}} {{finish_reason}}",
                )
            ],
        ),
    ],
    model_variable="meshserve_llm_requests_running",
)

STAGES = Dashboard(
    "meshserve-stages",
    "meshserve: per stage",
    [
        Panel(
            "CPU (cores)",
            "short",
            [(f"sum by (job, process) (rate(process_cpu_seconds_total[{RATE}]))", "{{process}}")],
        ),
        Panel(
            "Resident memory",
            "bytes",
            [("sum by (job, process) (process_resident_memory_bytes)", "{{process}}")],
        ),
        Panel(
            "Restarts (last hour)",
            "short",
            [("sum by (process) (increase(meshserve_process_restarts_total[1h]))", "{{process}}")],
        ),
        Panel(
            "Processes up and ready",
            "short",
            [("sum by (stage) (meshserve_process_up)", "{{stage}}")],
        ),
    ],
)

DASHBOARDS = (OVERVIEW, MODELS, LLM, STAGES)


def _panel(panel: Panel, index: int) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": [
            {
                "datasource": DATASOURCE,
                "refId": chr(ord("A") + n),
                "expr": expr,
                "legendFormat": legend,
                "exemplar": panel.exemplars,
            }
            for n, (expr, legend) in enumerate(panel.queries)
        ],
    }


def _variables(dashboard: Dashboard) -> list[dict[str, Any]]:
    if not dashboard.model_variable:
        return []
    query = f"label_values({dashboard.model_variable}, model)"
    return [
        {
            "name": "model",
            "label": "Model",
            "type": "query",
            "datasource": DATASOURCE,
            "query": {"query": query, "refId": "model"},
            "definition": query,
            "includeAll": True,
            "allValue": ".+",
            "multi": True,
            "current": {"text": "All", "value": "$__all"},
            "refresh": 2,
        }
    ]


def document(dashboard: Dashboard) -> dict[str, Any]:
    """The Grafana JSON model of ``dashboard``."""
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "tags": list(dashboard.tags),
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": _variables(dashboard)},
        "panels": [_panel(panel, i) for i, panel in enumerate(dashboard.panels)],
    }


def rendered() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    return {f"{d.uid}.json": json.dumps(document(d), indent=2) + "\n" for d in DASHBOARDS}


def queries(text: str) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target of a dashboard's JSON."""
    for panel in json.loads(text)["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def main() -> None:
    """Rewrite the JSON files from the definitions above."""
    FOLDER.mkdir(exist_ok=True)
    for name, text in rendered().items():
        (FOLDER / name).write_text(text)


if __name__ == "__main__":
    main()
