"""gRPC's own header values, as both doors that speak gRPC read and write them
(the asyncio server, shared/h2grpc/; the wire door, shared/wire_door.py).

    grpc_timeout    ``grpc-timeout`` (``100m``, ``5S``) -> seconds
    grpc_message    a status's details -> ``grpc-message`` (percent-encoded, bounded)
    call_metadata   a header block's fields -> a call's metadata (``-bin`` decoded)
    metadata_block  a call's metadata -> HPACK fields
"""

from __future__ import annotations

import base64
import urllib.parse
from collections.abc import Sequence

from shared.errors import bounded
from shared.hpack import literal

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_UNESCAPED = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
"""What grpc-message carries as it is (gRPC's percent-encoding: printable ASCII but %)."""
_RESERVED = frozenset(
    (b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding")
)
"""Header fields of the protocol itself, not of a call's metadata."""


def grpc_timeout(value: str) -> float | None:
    """Seconds in a ``grpc-timeout`` header (``100m``, ``5S``); None if it is malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def grpc_message(details: str) -> str:
    """``details`` as ``grpc-message`` carries them: bounded, then percent-encoded."""
    return urllib.parse.quote(bounded(details), safe=_UNESCAPED)


def call_metadata(pairs: list[tuple[bytes, bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    """A header block's fields as a call's metadata: no pseudo-headers nor the
    protocol's own fields, ``-bin`` values decoded."""
    out: list[tuple[str, str | bytes]] = []
    for name, value in pairs:
        if name.startswith(b":") or name in _RESERVED:
            continue
        key = name.decode("ascii", "replace")
        if key.endswith("-bin"):
            out.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            out.append((key, value.decode("latin-1")))
    return tuple(out)


def metadata_block(metadata: Sequence[tuple[str, str | bytes]]) -> bytes:
    """A call's metadata as HPACK fields (literals, no table), ``-bin`` values encoded."""
    block = b""
    for key, value in metadata:
        name = key.lower().encode("ascii")
        if name.endswith(b"-bin"):
            raw = value if isinstance(value, bytes) else value.encode()
            encoded = base64.b64encode(raw).rstrip(b"=")
        else:
            encoded = value.encode("latin-1") if isinstance(value, str) else value
        block += literal(name, encoded)
    return block
