"""A long-running service's heap and Python's cyclic garbage collector.

Most of what a service holds once it is ready stays for its life: imported
modules, loaded models, an LLM engine's objects. Left to the collector, every
full collection walks all of it while every request in flight waits (26 ms in
the orchestrator under load, 65 ms in a stage with torch loaded). vLLM's own
server freezes its heap once it has started for the same reason; each mesh
service does too when it is ready (``freeze``), so a full collection walks
only what came after.

A frozen object is never collected as part of a reference cycle. Startup
objects become such garbage when a model is unloaded or replaced (vLLM's
engine holds cycles), so the model manager runs loads and unloads ``thawed``:
the heap is unfrozen for them, and collected and frozen again when the last
one ends (one full collection's pause, on a model change only). Anything else
of startup that falls into a cycle later (a connection replaced when a stage
restarts) waits for the next load or unload; in the orchestrator, which loads
no models, for good. That is at most what the process held when it became
ready, once. A heap nobody froze (a test's process) stays as it was.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


class _Thaws:
    """The loads and unloads under way (``thawed`` blocks entered and not yet
    left), and whether the heap was frozen when the first of them began."""

    count = 0
    refreeze = False


_THAWS = _Thaws()


def freeze() -> None:
    """Collect, then keep every object there is out of later collections."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def thawed() -> Iterator[None]:
    """The heap unfrozen for the block (a model loading or unloading), so that
    what the block drops is collected; frozen again after the last such block
    ends, where it was frozen when the first began."""
    if _THAWS.count == 0:
        _THAWS.refreeze = gc.get_freeze_count() > 0
        gc.unfreeze()
    _THAWS.count += 1
    try:
        yield
    finally:
        _THAWS.count -= 1
        if _THAWS.count == 0 and _THAWS.refreeze:
            freeze()
