"""The scheduling policy of a service's threads (Linux).

A request through the mesh wakes one process after the next: Envoy, the
orchestrator, a stage, and back. Under the kernel's default policy
(SCHED_OTHER) a thread that wakes may preempt the one running on its core, so
where the processes share cores a write often hands the core to its reader
before the writer has finished its pass, and the hops run in short stretches
with cores left idle between them. ``batch`` (the default of the services in
front of the models: Envoy, the orchestrator, the HTTP adapter) puts every
thread of the process under SCHED_BATCH: a thread that wakes waits for the
running one to sleep or to use up its slice, and the kernel's fair share
between processes is otherwise the same. At one request in flight nothing
changes (a woken thread finds an idle core). A stage keeps ``normal``, the
kernel's default: work that reaches the model's service should take a core at
once (under ``batch`` a stage batching its requests served a few percent
fewer). docs/performance.md has the measurements.

Threads started later take the policy of the thread that starts them, and
child processes take it too (Envoy under its launcher, vLLM's engine under
the inference stage). ``normal`` sets the kernel's default, also for a process
started under another policy. Where the kernel has no such policy (not
Linux), or refuses it (a sandbox), the process runs as it was started.
"""

from __future__ import annotations

import contextlib
import os
from typing import Literal, TypeAlias

__all__ = ["CpuPolicy", "apply", "current"]

CpuPolicy: TypeAlias = Literal["batch", "normal"]

_TASKS = "/proc/self/task"


def _threads() -> list[int]:
    """This process's thread ids (0, the calling thread, where /proc is absent)."""
    try:
        return [int(name) for name in os.listdir(_TASKS)]
    except OSError:
        return [0]


def apply(policy: CpuPolicy) -> int:
    """Put every thread of this process under ``policy``; how many threads took it."""
    if not hasattr(os, "SCHED_BATCH"):
        return 0
    kind = os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER
    taken = 0
    for thread in _threads():
        # A thread may end between the listing and the call; a sandbox may refuse.
        with contextlib.suppress(OSError):
            os.sched_setscheduler(thread, kind, os.sched_param(0))
            taken += 1
    return taken


def current(thread: int = 0) -> CpuPolicy | None:
    """The policy of ``thread`` (0: the caller) by this module's names; None for another."""
    if not hasattr(os, "SCHED_BATCH"):
        return None
    kind = os.sched_getscheduler(thread)
    if kind == os.SCHED_BATCH:
        return "batch"
    return "normal" if kind == os.SCHED_OTHER else None
