"""Mutual TLS between the mesh's services: one CA, a certificate per process.

When a service's config names ``mtls_cert``, ``mtls_key`` and ``mtls_ca``, its
gRPC port (and the HTTP adapter's port) accepts only TLS connections whose
client presents a certificate signed by that CA, and every channel it opens to
another service shows its own certificate and checks the peer's against the
same CA. A process on the host without such a certificate cannot call a
stage's RPCs at all, management ones included. Nothing here knows which
service runs; ``deploy/local/certs.py`` makes a development CA and certificate.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from shared.config import ServiceConfig
from shared.errors import ConfigError


@dataclass(frozen=True)
class MeshTls:
    """This process's certificate and key, and the CA every peer must chain to (PEM)."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    cert: bytes
    key: bytes
    ca: bytes
    server_name: str | None = None
    """Checked against the peer's certificate instead of the host dialled."""

    @classmethod
    def from_config(cls, config: ServiceConfig) -> MeshTls | None:
        """The config's mutual TLS settings, files read once; None when it has none."""
        if config.mtls_cert is None or config.mtls_key is None or config.mtls_ca is None:
            return None
        return cls(
            cert_file=config.mtls_cert,
            key_file=config.mtls_key,
            ca_file=config.mtls_ca,
            cert=_read("mtls_cert", config.mtls_cert),
            key=_read("mtls_key", config.mtls_key),
            ca=_read("mtls_ca", config.mtls_ca),
            server_name=config.mtls_server_name,
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve TLS; a client without a certificate from the CA is refused in the handshake."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Show this process's certificate; trust only servers the CA signed."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel options the credentials need (the name to check, when one is set)."""
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]

    def server_ssl_context(self) -> ssl.SSLContext:
        """The same policy for an HTTP server (the adapter): client certificates required."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca_file))
        context.load_cert_chain(str(self.cert_file), str(self.key_file))
        context.verify_mode = ssl.CERT_REQUIRED
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context


def _read(field: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from exc
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{field}: {path} is not a PEM file")
    return data
