"""Copies of deploy/prometheus/ rules and deploy/grafana/ dashboards as Kubernetes objects.

    python -m deploy.k8s.sync            # rewrite the generated manifests
    python -m deploy.k8s.sync --check    # exit 1, naming the stale file, if one differs

kustomize refuses files above its root (short of ``--load-restrictor
LoadRestrictionsNone``, which ``kubectl apply -k`` does not take), so the rule
groups and dashboards are copied into the components here: the PrometheusRule
carries exactly the groups of deploy/prometheus/rules.yml, one ConfigMap every
dashboard JSON under deploy/grafana/dashboards/, and two more Grafana's
provisioning files (data sources, dashboard providers). A test runs ``--check``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent.parent
K8S = DEPLOY / "k8s"
RULES_SOURCE = DEPLOY / "prometheus" / "rules.yml"
DASHBOARDS_SOURCE = DEPLOY / "grafana"
RULES_TARGET = K8S / "components" / "monitoring" / "prometheusrule.yaml"
GRAFANA_TARGET = K8S / "components" / "grafana" / "generated.yaml"
GRAFANA_CONFIG_MAPS = {
    "meshserve-grafana-dashboards": "dashboards/*.json",
    "meshserve-grafana-datasources": "provisioning/datasources/*.yml",
    "meshserve-grafana-dashboard-providers": "provisioning/dashboards/*.yml",
}
"""Each generated ConfigMap and the files under deploy/grafana/ it holds."""
LABELS = {"app.kubernetes.io/name": "meshserve", "app.kubernetes.io/component": "monitoring"}


def _header(source: str) -> str:
    return f"# Generated from {source} by `python -m deploy.k8s.sync`; do not edit.\n"


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (PromQL, JSON), no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _string)


def _dump(document: dict[str, Any]) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=120)


def rule_groups() -> list[Any]:
    """The rule groups of deploy/prometheus/rules.yml."""
    groups: list[Any] = (yaml.safe_load(RULES_SOURCE.read_text()) or {}).get("groups") or []
    return groups


def prometheus_rule() -> str:
    """The PrometheusRule manifest holding every group of deploy/prometheus/rules.yml."""
    document = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "meshserve", "labels": LABELS},
        "spec": {"groups": rule_groups()},
    }
    return _header("deploy/prometheus/rules.yml") + _dump(document)


def grafana_files(pattern: str) -> list[Path]:
    """The files under deploy/grafana/ that match ``pattern``, sorted."""
    return sorted(DASHBOARDS_SOURCE.glob(pattern)) if DASHBOARDS_SOURCE.is_dir() else []


def grafana_config_maps() -> str:
    """The dashboards and Grafana's provisioning files, one ConfigMap per folder."""
    documents = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "labels": LABELS},
            "data": {path.name: path.read_text() for path in grafana_files(pattern)},
        }
        for name, pattern in GRAFANA_CONFIG_MAPS.items()
    ]
    return _header("deploy/grafana/") + "---\n".join(_dump(d) for d in documents)


def generated() -> dict[Path, str]:
    """Each generated manifest and the text it must hold."""
    return {RULES_TARGET: prometheus_rule(), GRAFANA_TARGET: grafana_config_maps()}


def stale() -> list[Path]:
    """The generated manifests whose text differs from their sources'."""
    return [
        path for path, text in generated().items() if not path.is_file() or path.read_text() != text
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the generated manifests, or with --check report the stale ones."""
    parser = argparse.ArgumentParser(prog="python -m deploy.k8s.sync", description=__doc__)
    parser.add_argument("--check", action="store_true", help="report stale files, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        for path in stale():
            print(f"{path} is stale: run python -m deploy.k8s.sync", file=sys.stderr)
        return 1 if stale() else 0
    for path, text in generated().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
