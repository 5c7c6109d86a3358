"""gRPC's own header values, as both doors that speak gRPC read and write them
(the asyncio server, shared/h2grpc/; the wire door, shared/wire_door.py).

    grpc_timeout    ``grpc-timeout`` (``100m``, ``5S``) -> seconds
    grpc_message    a status's details -> ``grpc-message`` (percent-encoded, bounded)
"""

from __future__ import annotations

import urllib.parse

from shared.errors import bounded

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_UNESCAPED = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
"""What grpc-message carries as it is (gRPC's percent-encoding: printable ASCII but %)."""


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
