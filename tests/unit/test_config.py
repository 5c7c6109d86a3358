"""Per-service config: defaults < mesh YAML < environment < flags, validated once."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import ServiceConfig, load_config
from shared.errors import ConfigError


def test_defaults() -> None:
    config = load_config(ServiceConfig, [], {}, service="tokenizer")
    assert config.service_name == "tokenizer"
    assert config.host == "127.0.0.1"
    assert config.otlp_endpoint is None


def test_precedence_yaml_env_flags(tmp_path: Path) -> None:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(
        "defaults:\n  grace_period_s: 3\n  grpc_port: 9000\n"
        "services:\n  tokenizer:\n    grpc_port: 9100\n    metrics_port: 9101\n"
    )
    env = {"MESHSERVE_METRICS_PORT": "9201"}
    config = load_config(
        ServiceConfig, ["--config", str(mesh), "--log-level", "DEBUG"], env, service="tokenizer"
    )
    assert config.grace_period_s == 3.0
    assert config.grpc_port == 9100
    assert config.metrics_port == 9201
    assert config.log_level == "DEBUG"
    flagged = load_config(
        ServiceConfig, ["--config", str(mesh), "--grpc-port", "9300"], env, service="tokenizer"
    )
    assert flagged.grpc_port == 9300


def test_out_of_bounds_value_names_the_field() -> None:
    with pytest.raises(ConfigError, match="grpc_port"):
        load_config(ServiceConfig, ["--grpc-port", "70000"], {}, service="x")


def test_unknown_yaml_key_is_rejected(tmp_path: Path) -> None:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text("services:\n  x:\n    grpc_prot: 1\n")
    with pytest.raises(ConfigError, match="grpc_prot"):
        load_config(ServiceConfig, ["--config", str(mesh)], {}, service="x")


def test_config_is_frozen() -> None:
    config = load_config(ServiceConfig, [], {}, service="x")
    with pytest.raises(ValueError, match="frozen"):
        config.grpc_port = 1  # type: ignore[misc]
