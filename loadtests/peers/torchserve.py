"""Real TorchServe (0.12, from the project's venv; its front end needs a JRE) on a model store.

``torchserve(store, folder, model)`` starts it on free ports with one worker
for ``model``, waits until the worker is READY and yields the inference URL
base and the PIDs of the launcher, Java and its Python workers (the server's
CPU is theirs). On exit every one of them is stopped by PID: the launcher does
not pass SIGTERM on. ``bench_torchserve.py`` and the peer benchmark share it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from deploy.local.procfs import child_pids
from shared.ports import free_port

JRE_HINT = "no java here: apt-get install openjdk-17-jre-headless"


def java_missing() -> str | None:
    """Why TorchServe cannot start here, or None."""
    return None if shutil.which("java") else JRE_HINT


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += child_pids(current)
    return found


@contextlib.contextmanager
def torchserve(store: Path, folder: Path, model: str) -> Iterator[tuple[str, dict[str, int]]]:
    """Real TorchServe serving ``<store>/<model>.mar``; (inference URL base, its PIDs)."""
    ports = [free_port() for _ in range(3)]
    config = folder / "config.properties"
    config.write_text(
        f"inference_address=http://127.0.0.1:{ports[0]}\n"
        f"management_address=http://127.0.0.1:{ports[1]}\n"
        f"metrics_address=http://127.0.0.1:{ports[2]}\n"
        "default_workers_per_model=1\ndisable_token_authorization=true\n"
        "install_py_dep_per_model=false\n"
    )
    launcher = Path(sys.executable).parent / "torchserve"
    command = [str(launcher), "--start", "--foreground", "--ncs", "--ts-config", str(config)]
    command += ["--model-store", str(store), "--models", f"{model}={model}.mar"]
    command += ["--disable-token-auth"]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "LOG_LOCATION": str(folder)}
    env["TMPDIR"] = str(folder)  # its pid file and sockets: one run never meets another
    log = (folder / "torchserve.log").open("w")
    proc = subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_model(f"http://127.0.0.1:{ports[1]}/models/{model}", proc, folder)
        pids = {f"torchserve-{i}": pid for i, pid in enumerate(tree(proc.pid))}
        yield f"http://127.0.0.1:{ports[0]}", pids
    finally:
        stop_tree(proc)
        log.close()


def stop_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``proc`` and its descendants, then SIGKILL whatever is left after 30 s."""
    pids = tree(proc.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
        proc.poll()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    return False


def _wait_model(url: str, proc: subprocess.Popen[bytes], folder: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(url, timeout=5) as answer,
        ):
            workers = json.loads(answer.read())[0]["workers"]
            if workers and all(w["status"] == "READY" for w in workers):
                return
        time.sleep(1)
    tail = (folder / "torchserve.log").read_text()[-3000:]
    raise RuntimeError(f"TorchServe did not get the model ready:\n{tail}")
