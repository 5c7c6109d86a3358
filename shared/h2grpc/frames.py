"""HTTP/2 frames (RFC 9113): the types, flags, settings and error codes a gRPC
server or client needs, and a frame's bytes. No sockets here."""

from __future__ import annotations

from typing import TypeVar

BytesLike = TypeVar("BytesLike", bytes, memoryview)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What a client sends first on a connection."""

DATA, HEADERS, PRIORITY_FRAME, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9

END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY = 0x4, 0x8, 0x20

HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x6, 0x7, 0x8, 0xB

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
LARGEST_FRAME = (1 << 24) - 1
LAST_STREAM_ID = (1 << 31) - 1
HEAD_BYTES = 9


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame: the 9-byte head, then ``payload``."""
    return frame_head(kind, flags, stream, len(payload)) + payload


def frame_head(kind: int, flags: int, stream: int, length: int) -> bytes:
    """The 9-byte head of a frame with ``length`` bytes of payload (a large payload
    can then be written after it as it is, without a copy joined to its head)."""
    return length.to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")


def settings_payload(values: dict[int, int]) -> bytes:
    """A SETTINGS frame's payload: each (identifier, value) as 6 bytes."""
    return b"".join(
        key.to_bytes(2, "big") + value.to_bytes(4, "big") for key, value in values.items()
    )


def parse_settings(payload: bytes) -> dict[int, int]:
    """A SETTINGS payload's values (the last of a repeated identifier wins)."""
    return {
        int.from_bytes(payload[at : at + 2], "big"): int.from_bytes(payload[at + 2 : at + 6], "big")
        for at in range(0, len(payload) - 5, 6)
    }


def window_update(stream: int, increment: int) -> bytes:
    """A WINDOW_UPDATE frame."""
    return frame(WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


def rst_stream(stream: int, code: int) -> bytes:
    """An RST_STREAM frame."""
    return frame(RST_STREAM, 0, stream, code.to_bytes(4, "big"))


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    """A GOAWAY frame."""
    return frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def unpadded(payload: BytesLike, flags: int) -> BytesLike:
    """A DATA or HEADERS frame's payload less its padding (PADDED)."""
    if not flags & PADDED:
        return payload
    end = len(payload) - payload[0] if payload else -1
    if end < 1:
        raise ValueError("padding longer than the frame")
    return payload[1:end]


def header_block(payload: bytes, flags: int) -> bytes:
    """A HEADERS frame's header block fragment: its payload less padding and priority."""
    block = unpadded(payload, flags)
    return block[5:] if flags & PRIORITY else block
