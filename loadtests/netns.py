"""A small cluster of "hosts" on this machine: one Linux network namespace each.

Used by the multi-host test (tests/integration/test_multihost.py) and its
benchmark (loadtests/bench_multihost.py). Needs root and ``ip``. Layout::

    root namespace                 switch namespace (ms<tag>sw)          host i (ms<tag>h<i>)
    ms<tag>r 198.18.K.1/24 --veth-- up0 -+- br0 -+- w<i> ~~veth~~ y<i>
                                                 |          netwire (delay)
                                                 |            x<i> --veth-- eth0 198.18.K.(10+i)

Every address is in 198.18.0.0/15 (the benchmarking range) on links between
namespaces this module makes, so no traffic leaves the machine. Each host's
link delays every frame by ``delay_ms`` each way (loadtests/netwire.py: this
kernel has no ``tc netem``). A process on a host is started with
``ip netns exec`` and binds the host's address. ``cut()`` takes a host's link
down at both ends (its peers see silence, not a reset), ``remove()`` ends its
processes (by PID) and deletes its namespace; ``close()`` removes everything,
also after a failure; a run killed outright (SIGKILL) leaves its namespaces to
the next ``Cluster``, which removes those whose creator is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
READY_MARKER = "MESHSERVE_READY"
OWNERS = Path("/run/meshserve-netns")
"""One file per live cluster, named by its tag, holding its creator's PID: what a
killed run left behind is found and removed by the next cluster."""


def missing() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"msprobe{secrets.token_hex(3)}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def ip(*args: str) -> None:
    """Run one ``ip`` command; a failure raises with its message."""
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Process:
    """A process started on a host (or here), stopped by its PID."""

    popen: subprocess.Popen[str]
    log: Path
    info: dict[str, Any] = field(default_factory=dict)

    def terminate(self) -> None:
        """SIGTERM, not waiting (``stop`` waits)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not end in ``timeout``."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def kill(self) -> None:
        """SIGKILL (a host that dies does not drain)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


@dataclass
class Host:
    """One namespace with one address on the cluster's switch."""

    index: int
    namespace: str
    address: str
    wire: Process | None = None
    processes: list[Process] = field(default_factory=list)


class Cluster:
    """Hosts on one switch; a context manager that removes everything it made."""

    def __init__(self, delay_ms: float = 0.5) -> None:
        sweep_orphans()
        self.delay_ms = delay_ms
        self.tag = secrets.token_hex(2)
        self.switch = f"ms{self.tag}sw"
        self.uplink = f"ms{self.tag}r"
        self.subnet = _free_subnet()
        self.gateway = f"198.18.{self.subnet}.1"
        self.hosts: list[Host] = []
        self._made_switch = False
        self._logs = Path(tempfile.mkdtemp(prefix="meshserve-netns-"))
        self._next = 0
        self.here: list[Process] = []
        """Processes started in the root namespace (stopped on close)."""

    def __enter__(self) -> Cluster:
        try:
            self._make_switch()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make_switch(self) -> None:
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / self.tag).write_text(str(os.getpid()))
        sw = ("-n", self.switch)
        ip("netns", "add", self.switch)
        self._made_switch = True
        _sysctl(self.switch, "net.ipv6.conf.all.disable_ipv6=1")
        ip(*sw, "link", "add", "br0", "type", "bridge")
        ip("link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", self.switch)
        ip(*sw, "link", "set", "up0", "master", "br0")
        for name in ("lo", "br0", "up0"):
            ip(*sw, "link", "set", name, "up")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.uplink)
        ip("link", "set", self.uplink, "up")

    def add_host(self) -> Host:
        """A new namespace on the switch, its link delayed by the wire."""
        index = self._next
        self._next += 1
        host = Host(index, f"ms{self.tag}h{index}", f"198.18.{self.subnet}.{10 + index}")
        self.hosts.append(host)
        sw = ("-n", self.switch)
        ip("netns", "add", host.namespace)
        _sysctl(host.namespace, "net.ipv6.conf.all.disable_ipv6=1")
        ip(
            *sw,
            "link",
            "add",
            f"x{index}",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host.namespace,
        )
        ip(*sw, "link", "add", f"w{index}", "type", "veth", "peer", "name", f"y{index}")
        ip(*sw, "link", "set", f"w{index}", "master", "br0")
        for name in (f"x{index}", f"w{index}", f"y{index}"):
            ip(*sw, "link", "set", name, "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        wire = [sys.executable, "-m", "loadtests.netwire", f"x{index}", f"y{index}"]
        host.wire = self._spawn(self.switch, [*wire, str(self.delay_ms)], "wire", ready=False)
        return host

    def start(self, host: Host | None, module: str, args: list[str]) -> Process:
        """Start ``python -m module args`` on ``host`` (None: here) without waiting:
        ``wait_ready`` waits for several started side by side."""
        process = self._spawn(
            host.namespace if host else None, [sys.executable, "-m", module, *args], module
        )
        (host.processes if host else self.here).append(process)
        return process

    def _spawn(
        self, namespace: str | None, argv: list[str], name: str, *, ready: bool = True
    ) -> Process:
        log = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=self._logs)[1])
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        with log.open("w") as stderr:  # the child keeps its own copy
            popen = subprocess.Popen(
                [*prefix, *argv],
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=subprocess.PIPE if ready else subprocess.DEVNULL,
                stderr=stderr,
                text=True,
            )
        return Process(popen, log)

    def cut(self, host: Host) -> None:
        """Take the host's link down at both ends: its frames stop, nothing resets."""
        ip("-n", self.switch, "link", "set", f"x{host.index}", "down")
        ip("-n", host.namespace, "link", "set", "eth0", "down")

    def remove(self, host: Host) -> None:
        """End the host's processes (SIGKILL: it died) and delete its namespace."""
        for process in host.processes:
            process.kill()
        if host.wire is not None:
            host.wire.stop(timeout=2)
        for command in (
            ("netns", "del", host.namespace),
            ("-n", self.switch, "link", "del", f"w{host.index}"),
        ):
            subprocess.run(["ip", *command], check=False, capture_output=True)
        if host in self.hosts:
            self.hosts.remove(host)

    def close(self) -> None:
        """Stop every process this cluster started and delete every namespace and link."""
        wires = [host.wire for host in self.hosts if host.wire is not None]
        processes = [*self.here, *(p for host in self.hosts for p in host.processes), *wires]
        for process in processes:  # all drain at once
            process.terminate()
        for process in processes:
            process.stop(timeout=5)
        for host in list(self.hosts):
            self.remove(host)
        if self._made_switch:
            subprocess.run(["ip", "netns", "del", self.switch], check=False, capture_output=True)
            self._made_switch = False
        subprocess.run(["ip", "link", "del", self.uplink], check=False, capture_output=True)
        (OWNERS / self.tag).unlink(missing_ok=True)
        shutil.rmtree(self._logs, ignore_errors=True)


def wait_ready(processes: list[Process], timeout: float = 60.0) -> None:
    """Wait for each process's ready line (they start side by side)."""
    deadline = time.monotonic() + timeout
    for process in processes:
        if process.info:
            continue
        stdout = process.popen.stdout
        assert stdout is not None
        while time.monotonic() < deadline:
            line = stdout.readline()
            if line.startswith(READY_MARKER):
                process.info = json.loads(line[len(READY_MARKER) :])
                # Keep draining stdout so the process never blocks on a full pipe.
                threading.Thread(target=stdout.read, daemon=True).start()
                break
            if not line and process.popen.poll() is not None:
                raise RuntimeError(f"exited with {process.popen.returncode}:\n{tail(process)}")
        else:
            raise TimeoutError(f"not ready in {timeout:.0f} s:\n{tail(process)}")


def tail(process: Process, lines: int = 40) -> str:
    """The end of a process's stderr."""
    return "\n".join(process.log.read_text(errors="replace").splitlines()[-lines:])


def sweep_orphans() -> None:
    """Remove the namespaces, links and processes of clusters whose creator died."""
    if not OWNERS.is_dir():
        return
    for owner in OWNERS.iterdir():
        try:
            alive = Path(f"/proc/{int(owner.read_text())}").exists()
        except (OSError, ValueError):
            alive = False
        if alive:
            continue
        listed = subprocess.run(
            ["ip", "netns", "list"], check=False, capture_output=True, text=True
        )
        for namespace in (line.split()[0] for line in listed.stdout.splitlines() if line.strip()):
            if namespace.startswith(f"ms{owner.name}"):
                _remove_namespace(namespace)
        subprocess.run(["ip", "link", "del", f"ms{owner.name}r"], check=False, capture_output=True)
        owner.unlink(missing_ok=True)


def _remove_namespace(namespace: str) -> None:
    """SIGKILL what runs in ``namespace`` (only this module starts processes there), delete it."""
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], check=False, capture_output=True, text=True
    ).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)


def _sysctl(namespace: str, setting: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", namespace, "sysctl", "-qw", setting],
        check=False,
        capture_output=True,
    )


def _free_subnet() -> int:
    """A third octet K whose 198.18.K.0/24 no route here uses yet."""
    routes = subprocess.run(
        ["ip", "-4", "route"], check=False, capture_output=True, text=True
    ).stdout
    for _ in range(100):
        candidate = 100 + secrets.randbelow(150)
        if f"198.18.{candidate}." not in routes:
            return candidate
    raise RuntimeError("no free /24 in 198.18.100.0-198.18.249.0")
