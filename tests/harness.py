"""Test harness: real service processes on free ports, and out-of-process clients.

Services run as their own processes (``python -m services.<name>.main``) with
port 0; the harness reads the ``MESHSERVE_READY`` line to learn the ports.
tritonclient cannot share a process with our generated ``inference`` package
(duplicate protobuf symbols), so its calls run in a child process too.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = Path(__file__).resolve().parent / "clients"
READY_MARKER = "MESHSERVE_READY"

_LOGS = Path(tempfile.mkdtemp(prefix="meshserve-test-logs-"))
"""The services' stderr files: one folder per test process, removed when it exits
(a service that fails to start puts its log in the error)."""
atexit.register(shutil.rmtree, _LOGS, ignore_errors=True)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""Prometheus samples: (metric name, label pairs) -> value."""

RUNNING: dict[int, tuple[str, Path]] = {}
"""Services (and meshes) started and not yet stopped: PID -> (module, stderr file).
A failed test's report shows the end of each log."""


def scrape_metrics(port: int) -> Samples:
    """The samples a process serves on 127.0.0.1:port/metrics, by name and labels."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            pairs = re.findall(r'(\w+)="([^"]*)"', labels)
            samples[name, frozenset(pairs)] = float(value)
    return samples


def new_log(module: str) -> Path:
    """A fresh file for a process's stderr, removed when the test process exits."""
    return Path(tempfile.mkstemp(prefix=f"{module}-", suffix=".log", dir=_LOGS)[1])


def log_tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of a log file."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class ServiceProcess:
    """One service process started by a test; stopped (by PID) at the end."""

    def __init__(
        self,
        module: str,
        args: list[str],
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.log_path = new_log(module)
        self._log = self.log_path.open("w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--grpc-port", "0", *args],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        RUNNING[self.proc.pid] = (module, self.log_path)
        self.info = self._wait_ready(timeout)
        self.address: str = self.info["grpc"]
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                if self.proc.poll() is not None:
                    RUNNING.pop(self.proc.pid, None)
                    raise RuntimeError(
                        f"service exited with {self.proc.returncode}:\n{self.logs()}"
                    )
                continue
            if line.startswith(READY_MARKER):
                info: dict[str, Any] = json.loads(line[len(READY_MARKER) :])
                return info
        self.stop()
        raise TimeoutError(f"service not ready in {timeout}s:\n{self.logs()}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def logs(self) -> str:
        """Everything the service wrote to stderr so far (also after stop())."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def metrics(self) -> Samples:
        """Scrape the service's /metrics endpoint."""
        return scrape_metrics(self.info["metrics_port"])

    def signal(self, sig: int) -> None:
        """Send a signal to the service's own PID."""
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, SIGKILL as a last resort; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        RUNNING.pop(self.proc.pid, None)
        self._log.close()
        return self.proc.returncode


@contextmanager
def orchestrator_with_stage(
    repository: Path, *args: str, stage: str = "inference"
) -> Iterator[ServiceProcess]:
    """A ``stage`` service (``services.<stage>.main``) hosting ``repository`` and an
    orchestrator routing to it.

    Yields the orchestrator; ``args`` go to both processes (e.g. an OTLP
    endpoint). Both are stopped on exit, the orchestrator first.
    """
    hosting = ["--model-repository", str(repository)]
    served = ServiceProcess(f"services.{stage}.main", [*hosting, *args])
    try:
        orchestrator = ServiceProcess(
            "services.orchestrator.main",
            [*hosting, "--stages", f"{stage}={served.address}", "--metrics-port", "-1", *args],
        )
        try:
            yield orchestrator
        finally:
            orchestrator.stop()
    finally:
        served.stop()


def run_client(script: str, *args: Any, timeout: float = 240.0) -> Any:
    """Run ``tests/clients/<script>`` in a child process; returns its JSON stdout.

    ``timeout`` stays under the tests' own (pytest-timeout's 300 s), so a client
    that hangs is ended here and what it printed reaches the failure report.
    """
    command = [sys.executable, str(CLIENTS / script), *[json.dumps(a) for a in args]]
    try:
        done = subprocess.run(  # noqa: PLW1510 - the exit code is checked below
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        printed = [_text(exc.stdout), _text(exc.stderr)]
        raise AssertionError(
            f"{script} did not finish in {timeout:.0f}s; it printed:\n" + "\n".join(printed)
        ) from None
    if done.returncode != 0:
        raise AssertionError(f"{script} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _text(output: str | bytes | None) -> str:
    # TimeoutExpired carries what was read so far, as bytes even in text mode.
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
