"""Development credentials for the edge: a TLS certificate and JWT signing keys.

    python -m gateway.envoy.credentials --out DIR [--subject client-name] [--days 30]
        [--roles user[,admin]]

writes ``DIR/tls.crt`` + ``DIR/tls.key`` (self-signed for localhost and
127.0.0.1), ``DIR/jwks.json`` (the public key Envoy verifies tokens with),
``DIR/signing.pem`` (the private key) and ``DIR/token`` (a bearer token for
the subject, with ``--roles``, default ``user``; ``admin`` may also load and
unload models and change log and trace settings). Point the edge at them
with ``--jwks-file``, ``--tls-cert`` and ``--tls-key``; send
``Authorization: Bearer $(cat DIR/token)``.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import ipaddress
import json
import time
from collections.abc import Sequence
from pathlib import Path

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

KEY_ID = "meshserve-dev"


def _b64(number: int) -> str:
    raw = number.to_bytes((number.bit_length() + 7) // 8, "big")
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def write_tls(out: Path, days: int) -> tuple[Path, Path]:
    """A self-signed certificate for localhost / 127.0.0.1, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshserve-dev")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = out / "tls.crt", out / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def write_jwt_keys(out: Path) -> tuple[Path, Path]:
    """An RSA signing key and the JWKS that verifies its tokens."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    numbers = key.public_key().public_numbers()
    jwks = {
        "keys": [
            {
                "kty": "RSA",
                "alg": "RS256",
                "use": "sig",
                "kid": KEY_ID,
                "n": _b64(numbers.n),
                "e": _b64(numbers.e),
            }
        ]
    }
    jwks_path, pem_path = out / "jwks.json", out / "signing.pem"
    jwks_path.write_text(json.dumps(jwks, indent=2))
    pem_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pem_path.chmod(0o600)
    return jwks_path, pem_path


def issue_token(
    signing_pem: Path,
    subject: str,
    days: int,
    issuer: str = "meshserve-dev",
    audience: str = "meshserve",
    roles: Sequence[str] = ("user",),
) -> str:
    """A signed RS256 bearer token for ``subject`` with ``roles`` in its ``roles`` claim."""
    now = int(time.time())
    claims = {
        "iss": issuer,
        "aud": audience,
        "sub": subject,
        "roles": list(roles),
        "iat": now,
        "exp": now + days * 86400,
    }
    return jwt.encode(claims, signing_pem.read_bytes(), algorithm="RS256", headers={"kid": KEY_ID})


def main(argv: Sequence[str] | None = None) -> None:
    """Write all development credentials into --out."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--subject", default="dev-client")
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument(
        "--roles",
        default="user",
        help="comma-separated roles of the token: user (inference), admin (management too)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cert, key = write_tls(args.out, args.days)
    jwks, pem = write_jwt_keys(args.out)
    (args.out / "token").write_text(
        issue_token(pem, args.subject, args.days, roles=args.roles.split(","))
    )
    for path in (cert, key, jwks, pem, args.out / "token"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
