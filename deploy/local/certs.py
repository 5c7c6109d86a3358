"""A development CA and one mesh certificate, for mutual TLS between services.

    python -m deploy.local.certs [--out DIR] [--name extra.host ...] [--days 30]

writes ``DIR/ca.crt`` (the CA every service trusts), ``DIR/mesh.crt`` and
``DIR/mesh.key`` (one certificate for server and client use, valid for
localhost, 127.0.0.1 and every ``--name``), keeping ``DIR/ca.key`` to sign
more; DIR defaults to ``$MESHSERVE_CACHE/mtls`` (``~/.cache/meshserve/mtls``).
It prints the mesh YAML lines that turn mutual TLS on. A production mesh
brings its own CA (a mounted secret); these files are for one machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from models.prepare import default_cache

LOCAL_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class MeshCertificates:
    """The files one mesh needs: its CA, and the certificate and key every service uses."""

    ca: Path
    cert: Path
    key: Path

    def yaml(self) -> str:
        """The ``defaults:`` lines of the mesh YAML that turn mutual TLS on."""
        return f"  mtls_cert: {self.cert}\n  mtls_key: {self.key}\n  mtls_ca: {self.ca}\n"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _alt_names(names: Sequence[str]) -> list[x509.GeneralName]:
    found: list[x509.GeneralName] = []
    for name in dict.fromkeys([*LOCAL_NAMES, *names]):
        try:
            found.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            found.append(x509.DNSName(name))
    return found


def write_ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA that may sign leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("meshserve-dev-ca"))
        .issuer_name(_name("meshserve-dev-ca"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    (out / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _pem_key(key, out / "ca.key")
    return cert, key


def write_leaf(
    out: Path,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    names: Sequence[str],
    days: int,
    stem: str = "mesh",
) -> tuple[Path, Path]:
    """A certificate the CA signed, for both ends of a TLS connection (server and client)."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"meshserve-{stem}"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(_alt_names(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = out / f"{stem}.crt", out / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _pem_key(key, key_path)
    return cert_path, key_path


def make_certificates(out: Path, names: Sequence[str] = (), days: int = 30) -> MeshCertificates:
    """A fresh CA in ``out`` and the mesh certificate it signed."""
    out.mkdir(parents=True, exist_ok=True)
    ca = write_ca(out, days)
    cert, key = write_leaf(out, ca, names, days)
    return MeshCertificates(ca=out / "ca.crt", cert=cert, key=key)


def main(argv: Sequence[str] | None = None) -> None:
    """Write the CA and the mesh certificate, then print the YAML that uses them."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="default: the cache's mtls/")
    parser.add_argument(
        "--name", action="append", default=[], help="another host name or address to certify"
    )
    parser.add_argument("--days", type=int, default=30)
    args = parser.parse_args(argv)
    made = make_certificates(args.out or default_cache() / "mtls", args.name, args.days)
    print(f"wrote {made.ca}, {made.cert}, {made.key}\nin the mesh YAML:\ndefaults:")
    print(made.yaml(), end="")


if __name__ == "__main__":
    main()
