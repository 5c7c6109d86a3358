"""Stage names to replica addresses: a hosts file first, then DNS.

A configured stage endpoint names a host (``preprocess=preprocess:8005``). In
Kubernetes that host is a headless Service, whose name has one A record per
ready pod; locally a hosts file can list several addresses for one name. The
router asks here, every re-resolve period, for all the addresses a name has
now, and opens or retires replicas by the difference.

What a lookup can answer:

- an address literal is itself (``127.0.0.1:8003`` never changes);
- a name in the hosts file is every address the file gives it, in file order
  (unlike the C library, which stops at the first line that matches);
- any other name goes to the system resolver (``getaddrinfo``: DNS, and
  ``/etc/hosts``); IPv4 addresses are kept when a name has both families, so a
  dual-stack ``localhost`` is one replica, not two;
- a name that does not exist (NXDOMAIN) has no addresses: its replicas are
  gone; a lookup that could not tell (timeout, unreadable file) is ``None``,
  and the caller keeps what it had.

No gRPC here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
"""getaddrinfo's answers that say the name has no address (not a failed lookup)."""


def split_target(target: str) -> tuple[str, str]:
    """``host:port`` or ``[v6]:port`` -> (host, port)."""
    host, _, port = target.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), port


def join_target(host: str, port: str) -> str:
    """(host, port) -> a gRPC target, brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_address(host: str) -> bool:
    """True for an IPv4 or IPv6 literal (nothing to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_local(target: str) -> bool:
    """Whether ``host:port`` is on this host: a loopback address or ``localhost``."""
    host, _ = split_target(target)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_hosts(text: str) -> dict[str, list[str]]:
    """A hosts file (``ADDRESS NAME [ALIAS...]``, ``#`` comments) -> name -> addresses.

    Every line counts: a name on several lines has all their addresses.
    Lines whose first field is no address are skipped."""
    names: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.partition("#")[0].split()
        if len(fields) < 2 or not is_address(fields[0]):
            continue
        for name in fields[1:]:
            known = names.setdefault(name.lower(), [])
            if fields[0] not in known:
                known.append(fields[0])
    return names


def prefer_ipv4(addresses: list[str]) -> list[str]:
    """The IPv4 addresses when there are any, else all (one family per name)."""
    v4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
    return v4 or addresses


class Resolver:
    """Looks stage hosts up: address literals, the hosts file, then the system resolver."""

    def __init__(self, hosts_file: Path | None = None) -> None:
        self.hosts_file = hosts_file

    async def resolve(self, host: str) -> list[str] | None:
        """Every address of ``host`` now; ``[]`` when it has none, ``None`` when unknown."""
        if is_address(host):
            return [host]
        if self.hosts_file is not None:
            table = await self._read_hosts()
            if table is None:
                return None
            if host.lower() in table:
                return table[host.lower()]
        return await self._lookup(host)

    async def expand(self, target: str) -> list[str] | None:
        """``host:port`` -> one ``address:port`` target per address of the host."""
        host, port = split_target(target)
        addresses = await self.resolve(host)
        if addresses is None:
            return None
        return [join_target(address, port) for address in addresses]

    async def _read_hosts(self) -> Mapping[str, list[str]] | None:
        assert self.hosts_file is not None
        try:
            # Small, but a file read is still I/O: off the event loop.
            text = await asyncio.to_thread(self.hosts_file.read_text)
        except OSError as exc:
            log.warning("cannot read hosts file %s: %s", self.hosts_file, exc.strerror)
            return None
        return parse_hosts(text)

    async def _lookup(self, host: str) -> list[str] | None:
        loop = asyncio.get_running_loop()
        try:
            # The loop runs getaddrinfo in its executor: the loop never blocks.
            found = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_SUCH_NAME:
                return []
            log.warning("cannot resolve %s: %s", host, exc.strerror)
            return None
        addresses: list[str] = []
        for *_, sockaddr in found:
            address = str(sockaddr[0])
            if address not in addresses:
                addresses.append(address)
        return prefer_ipv4(addresses)
