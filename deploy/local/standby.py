"""A service process started ahead of need: imported, idle, waiting for its turn.

    python -m deploy.local.standby MODULE [ARGS...]

Restarting a crashed service costs its interpreter start and its imports
(grpc, numpy, ONNX Runtime, torch: seconds, tens of seconds on a busy host)
before it can bind its port. The supervisor keeps one of these beside a
service whose stage sets ``standby: true``: it imports MODULE (and whatever
the module's ``preload(ARGS)`` imports for the models it would load), then
waits on stdin, starting no thread, no engine and no server, and listening on
nothing. A line ``go`` makes it that service (``MODULE.main(ARGS)``), with the
command line and environment the service would have had; end of input (the
supervisor went away or no longer needs it) ends it.

Until it takes over, its command name (``/proc/PID/comm``) is ``STANDBY_NAME``,
so a look at the process table can tell it from the service it stands in for.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

GO = "go"
"""The line that turns the standby into its service."""
STANDBY_NAME = "meshserve-stby"
"""The command name while waiting (the kernel keeps 15 characters)."""
_COMM = Path("/proc/self/comm")


def _rename(name: str) -> None:
    """Set this process's command name (Linux; elsewhere nothing happens)."""
    with contextlib.suppress(OSError):
        _COMM.write_text(name)


def main(argv: Sequence[str]) -> int:
    """Import ``argv[0]``, wait for ``go``, then run its ``main(argv[1:])``."""
    if not argv:
        print("usage: python -m deploy.local.standby MODULE [ARGS...]", file=sys.stderr)
        return 2
    began = time.monotonic()
    name = ""
    with contextlib.suppress(OSError):
        name = _COMM.read_text().strip()
    _rename(STANDBY_NAME)
    module = importlib.import_module(argv[0])
    preload = getattr(module, "preload", None)
    if callable(preload):
        try:
            preload(list(argv[1:]))
        except Exception as exc:  # the service itself reports a bad config when it runs
            print(f"standby for {argv[0]}: preload failed: {exc!r}", file=sys.stderr)
    print(
        f"standby for {argv[0]}: imported in {time.monotonic() - began:.1f}s, waiting",
        file=sys.stderr,
        flush=True,
    )
    if sys.stdin.readline().strip() != GO:
        return 0
    if name:
        _rename(name)
    sys.argv = [str(getattr(module, "__file__", argv[0])), *argv[1:]]
    module.main(list(argv[1:]))
    return 0


# The guard also keeps processes that the service spawns (vLLM's engine, which
# imports the parent's main module) from waiting here.
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
