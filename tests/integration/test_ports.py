"""Ports picked for servers that start later stay clear of outgoing connections."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from shared import ports
from shared.ports import free_port, free_port_run


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def _bindable(port: int) -> bool:
    """Whether a server can listen on the port now."""
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


def test_picked_ports_lie_below_the_range_outgoing_connections_take_theirs_from() -> None:
    low = _ephemeral_low()
    picked = [free_port() for _ in range(50)]
    assert all(ports.LOWEST <= port < low for port in picked), picked
    assert len(set(picked)) > 40  # at random, not one port over and over
    assert all(_bindable(port) for port in picked)


def test_a_run_of_ports_is_consecutive_and_free() -> None:
    first = free_port_run(4)
    assert first + 4 <= _ephemeral_low()
    assert all(_bindable(first + i) for i in range(4))


def test_a_port_in_use_is_not_picked(monkeypatch: Any) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # Every random pick lands on the taken port until the last try, which lands
        # on one that binds (not taken + 1: a recent connection may hold that one).
        free = free_port()
        picks = iter([taken] * (ports.TRIES - 1) + [free])
        monkeypatch.setattr(ports._RANDOM, "randrange", lambda *_: next(picks))
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65000)
        assert free_port() == free


def test_without_room_below_the_range_the_kernel_picks(tmp_path: Path, monkeypatch: Any) -> None:
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", wide)
    assert _bindable(free_port())
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    first = free_port_run(2)
    assert _bindable(first) and _bindable(first + 1)
