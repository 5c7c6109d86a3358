"""Ports picked now for servers that bind them later.

A port found by binding port 0 comes from the kernel's ephemeral range, the
range it also gives every outgoing connection its local port from. Between
the pick and the server's own bind, a connection opened meanwhile (one
process of a mesh dialling another) may take that port, and the server then
fails to start with "address already in use", again on every restart, since
it is given the same port. So a port is picked at random below the ephemeral
range, where no outgoing connection lands, and found free by a bind; the
kernel's own pick remains where the range leaves no room below it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000
"""The lowest port picked (fewer system services listen above it)."""
ROOM = 1000
"""Fewer ports than this between LOWEST and the ephemeral range: the kernel picks."""
TRIES = 200

_RANDOM = random.Random()  # its own state: a test seeding `random` picks no differently


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no outgoing connection will take."""
    return free_port_run(1)


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free ports (see free_port)."""
    top = _ephemeral_low()
    if top is not None and top - LOWEST - count >= ROOM:
        for _ in range(TRIES):
            first = _RANDOM.randrange(LOWEST, top - count + 1)
            if all(_bindable(first + i) for i in range(count)):
                return first
    for _ in range(TRIES):
        first = _kernel_pick()
        if first + count <= 65536 and all(_bindable(first + i) for i in range(1, count)):
            return first
    raise OSError(f"no run of {count} free ports on 127.0.0.1")


def _ephemeral_low() -> int | None:
    """The lowest port of the kernel's ephemeral range, None where it cannot be read."""
    try:
        low, _high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    return low


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_pick() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
