"""A minimal grpc-web client (what a browser sends), for tests through Envoy."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class GrpcWebReply:
    """Status, message and the first data frame of a grpc-web unary call."""

    status: int
    message: str
    payload: bytes
    headers: dict[str, str] = field(default_factory=dict)
    """The response's headers, names in lower case."""


def call(
    base_url: str, method: str, request: bytes, headers: dict[str, str] | None = None
) -> GrpcWebReply:
    """POST one framed message; parse data and trailer frames (or trailers-only headers)."""
    body = b"\x00" + len(request).to_bytes(4, "big") + request
    http = urllib.request.Request(
        f"{base_url}/{method.lstrip('/')}",
        data=body,
        method="POST",
        headers={
            "content-type": "application/grpc-web+proto",
            "x-grpc-web": "1",
            **(headers or {}),
        },
    )
    try:
        with urllib.request.urlopen(http, timeout=30) as reply:
            raw, reply_headers = reply.read(), dict(reply.headers.items())
    except urllib.error.HTTPError as exc:
        raw, reply_headers = exc.read(), dict(exc.headers.items())
    lowered = {k.lower(): v for k, v in reply_headers.items()}
    payload, trailers = b"", {}
    offset = 0
    while offset + 5 <= len(raw):
        flag, length = raw[offset], int.from_bytes(raw[offset + 1 : offset + 5], "big")
        frame = raw[offset + 5 : offset + 5 + length]
        offset += 5 + length
        if flag & 0x80:
            for line in frame.decode().split("\r\n"):
                if ":" in line:
                    key, value = line.split(":", 1)
                    trailers[key.strip().lower()] = value.strip()
        elif not payload:
            payload = frame
    status = trailers.get("grpc-status", lowered.get("grpc-status", "-1"))
    message = trailers.get("grpc-message", lowered.get("grpc-message", ""))
    return GrpcWebReply(int(status), urllib.request.unquote(message), payload, lowered)
