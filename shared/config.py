"""Per-service configuration: one frozen, validated object per process.

Values come from, in rising precedence: field defaults, the optional mesh
YAML (``defaults:`` then ``services.<name>:``), environment variables
(``MESHSERVE_<FIELD>``), then command-line flags (``--field-name``). The
object is built once in ``main`` and passed down; nothing reads flags or the
environment at import time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from shared.cpu_policy import CpuPolicy
from shared.errors import ConfigError
from shared.event_loop import EventLoop

ENV_PREFIX = "MESHSERVE_"


MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The largest gRPC message a service sends or receives unless configured otherwise."""


class ServiceConfig(BaseModel):
    """What every service process needs: where to listen and how to behave."""

    # Attribute docstrings become field descriptions: they are each flag's --help.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    service_name: str = Field("meshserve", min_length=1, max_length=64)
    """The OpenTelemetry ``service.name`` and the Prometheus ``service`` label."""
    host: str = Field("127.0.0.1", min_length=1)
    """Address the gRPC server binds to."""
    grpc_port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (printed on start)."""
    metrics_port: int = Field(-1, ge=-1, le=65535)
    """Prometheus /metrics port; 0 picks a free one, -1 turns it off."""
    wire_port: int = Field(-1, ge=-1, le=65535)
    """Port of the wire door (shared/wire_door.py): the unary methods a service offers
    there, over HTTP/1.1 for Envoy's gRPC reverse bridge; 0 picks a free one, -1: off."""
    grpc_server: Literal["asyncio", "grpcio"] = "asyncio"
    """What serves the gRPC port: grpcio's server (grpc.aio), or the project's own on
    asyncio (shared/h2grpc/), which costs a fraction of the CPU per call; cleartext
    only, so with mutual TLS grpcio's serves."""
    event_loop: EventLoop = "uvloop"
    """The process's event loop (shared/event_loop.py): uvloop, as vLLM's server runs,
    or Python's own asyncio loop."""
    cpu_policy: CpuPolicy = "batch"
    """The scheduling policy of the process's threads (shared/cpu_policy.py): batch
    (Linux SCHED_BATCH: a woken thread does not preempt a running one, so the hops
    of a request on shared cores run in longer stretches) or normal (the kernel's
    default, which stages keep)."""
    max_message_bytes: int = Field(MAX_MESSAGE_BYTES, ge=4 * 1024 * 1024, le=2**31 - 1)
    """Largest gRPC message sent or received."""
    grace_period_s: float = Field(10.0, ge=0.0, le=600.0)
    """On SIGTERM, how long in-flight RPCs may run before they are cancelled."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC trace collector (host:port); None exports no spans."""
    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Share of requests traced where a trace starts (a request with a traceparent keeps
    its caller's sampled flag); 1 records every request."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Root log level."""
    log_format: Literal["text", "json"] = "text"
    """Log lines as text, or as JSON with the current trace_id and span_id (shared/logs.py)."""
    allow_client_shm: bool = False
    """Let callers register system shared-memory regions and pass tensors through them
    (Triton's --allow-client-shm): only where every caller may read this host's
    shared memory."""
    shm_handoff: bool = False
    """Pass an ensemble's large tensors (64 KB and up) between the services of one host
    through shared memory instead of in messages: set on every service or on none."""
    mtls_cert: Path | None = None
    """Mutual TLS between services (with mtls_key, mtls_ca): this process's certificate
    chain (PEM), served on its port and shown to the services it calls."""
    mtls_key: Path | None = None
    """Private key (PEM) of mtls_cert."""
    mtls_ca: Path | None = None
    """CA certificate (PEM) every peer's certificate must be signed by."""
    mtls_server_name: str | None = None
    """Name the peers' certificates are checked against instead of the host dialled."""

    @model_validator(mode="after")
    def _mtls_complete(self) -> ServiceConfig:
        given = [self.mtls_cert, self.mtls_key, self.mtls_ca]
        if any(given) and not all(given):
            raise ValueError("mtls_cert, mtls_key and mtls_ca go together: set all three")
        return self


C = TypeVar("C", bound=ServiceConfig)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help(name: str, info: FieldInfo, default: Any, repeatable: bool) -> str:
    """A flag's --help: the field's docstring, its default and its environment variable."""
    # Empty only where the source (and so the docstring) is not shipped; a test
    # checks that every setting has one.
    description = " ".join((info.description or "").split())
    shown = "none" if default is None or default == [] else str(default)
    env = f"env {ENV_PREFIX}{name.upper()}"
    where = (
        f"repeatable; default: {shown}; {env}, comma-separated"
        if repeatable
        else (f"default: {shown}; {env}")
    )
    return f"{description} ({where})".lstrip().replace("%", "%%")  # argparse %-formats help


def _add_flags(
    parser: argparse.ArgumentParser, cls: type[ServiceConfig], defaults: Mapping[str, Any]
) -> None:
    """One ``--field-name`` flag per field; ``defaults`` overrides what --help shows."""
    for name, info in cls.model_fields.items():
        annotation = info.annotation
        default = defaults.get(name, info.get_default(call_default_factory=True))
        if get_origin(annotation) in (list, tuple):
            text = _help(name, info, default, repeatable=True)
            parser.add_argument(_flag(name), dest=name, action="append", default=None, help=text)
            continue
        text = _help(name, info, default, repeatable=False)
        kind: Any = str
        choices = None
        if annotation in (int, float):
            kind = annotation
        elif annotation is bool:
            kind = _parse_bool
        elif get_origin(annotation) is Literal:
            choices = get_args(annotation)
        parser.add_argument(
            _flag(name), dest=name, type=kind, default=None, choices=choices, help=text
        )


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _from_yaml(path: Path, service: str) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read mesh config: {exc}") from exc
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: the mesh config must be a mapping")
    values: dict[str, Any] = dict(document.get("defaults") or {})
    values.update((document.get("services") or {}).get(service) or {})
    return values


def _from_env(cls: type[ServiceConfig], env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        is_sequence = get_origin(info.annotation) in (list, tuple) or any(
            get_origin(arg) in (list, tuple) for arg in get_args(info.annotation)
        )
        values[name] = [item for item in raw.split(",") if item] if is_sequence else raw
    return values


def load_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    service: str,
) -> C:
    """Build ``cls`` from defaults, mesh YAML, environment and flags, validated once."""
    parser = argparse.ArgumentParser(prog=f"meshserve-{service}", description=cls.__doc__)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"mesh YAML file (defaults:, then services.{service}:); env {ENV_PREFIX}CONFIG",
    )
    _add_flags(parser, cls, {"service_name": service})
    args = vars(parser.parse_args(list(argv) if argv is not None else None))
    env = os.environ if env is None else env

    values: dict[str, Any] = {"service_name": service}
    config_path = args.pop("config") or (
        Path(env[ENV_PREFIX + "CONFIG"]) if ENV_PREFIX + "CONFIG" in env else None
    )
    if config_path is not None:
        values.update(_from_yaml(config_path, service))
    values.update(_from_env(cls, env))
    values.update({key: value for key, value in args.items() if value is not None})
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid {service} configuration: {problems}") from exc
