"""The mesh's port plan, checked before any process starts.

Every port a process of the mesh will listen on (gRPC, HTTP, metrics) is in
the plan with the process that wants it. Two processes wanting one port, or a
fixed port that something else already holds, stop the mesh before it starts,
naming the processes and the port: otherwise the second one would crash-loop
on "Address already in use" while the first serves.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass


class PortPlanError(Exception):
    """The plan cannot work: two processes want one port, or a port is already taken."""


@dataclass(frozen=True)
class Listener:
    """One port one process will listen on."""

    process: str
    """The process's name in the mesh, e.g. ``tokenizer-1``."""
    role: str
    """What listens there: ``gRPC``, ``HTTP`` or ``metrics``."""
    port: int
    """The port; 0 (any free port) and -1 (off) are never in conflict."""

    def __str__(self) -> str:
        return f"{self.process} ({self.role})"


def collisions(listeners: Iterable[Listener]) -> list[str]:
    """A sentence for each port that two listeners of the plan want."""
    owners: dict[int, Listener] = {}
    found = []
    for listener in listeners:
        if listener.port <= 0:
            continue
        first = owners.setdefault(listener.port, listener)
        if first is not listener:
            found.append(f"{first} and {listener} both want port {listener.port}")
    return found


def taken(listeners: Iterable[Listener], host: str) -> list[str]:
    """A sentence for each fixed port of the plan that cannot be bound on ``host`` now."""
    found = []
    for listener in listeners:
        if listener.port <= 0:
            continue
        try:
            _probe(host, listener.port)
        except OSError as exc:
            found.append(
                f"port {listener.port} that {listener} wants on {host} is not free "
                f"({exc.strerror or exc}); is another mesh still running?"
            )
    return found


def _probe(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the services bind: a port left in TIME_WAIT by a mesh just stopped is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


def check_ports(listeners: Iterable[Listener], host: str) -> None:
    """Raise PortPlanError naming every collision, or else every port already taken."""
    planned = list(listeners)
    problems = collisions(planned) or taken(planned, host)
    if problems:
        raise PortPlanError("; ".join(problems))
