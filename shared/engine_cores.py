"""The CPU contract between the local mesh's placement and the engines its stages start.

Two sides set CPU affinity on a CPU-only host, and each must leave the other's
choice alone:

- an engine (vLLM's CPU worker) binds its compute threads to some cores;
- the local supervisor's placement (deploy/local/placement.py) keeps every
  other thread of the mesh off those cores while the engine is busy, and
  lets them use every core again once it is idle.

They agree on three things, all named here:

``MESHSERVE_ENGINE_CORES`` (``ENGINE_CORES_ENV``)
    The cores an engine may take: a Linux CPU list ("0-3,6"). The supervisor
    sets it in every process it starts, to the cores the mesh was given. A
    stage starts each engine on exactly these cores (``enter_engine_cores``),
    even after placement has narrowed the stage's own threads: the engine
    then chooses its worker's cores among them. Unset (a stage started by
    hand, or in Kubernetes), the stage's cores at start.
An engine says which cores it bound
    by its affinity plus an OpenMP binding variable in its environment
    (``OPENMP_BINDING``; vLLM sets one). Placement treats such a process whose
    cores are fewer than ``MESHSERVE_ENGINE_CORES`` as an engine: it never
    narrows it.
The mesh keeps
    the cores of ``MESHSERVE_ENGINE_CORES`` that no busy engine has bound;
    while every engine is idle, all of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping

ENGINE_CORES_ENV = "MESHSERVE_ENGINE_CORES"
"""The variable naming the cores an engine may take (a Linux CPU list)."""

OPENMP_BINDING = (b"OMP_PLACES=", b"GOMP_CPU_AFFINITY=", b"KMP_AFFINITY=")
"""Environment entries by which a process shows it bound its OpenMP threads (vLLM
sets the first, or one of the others when it finds GNU or Intel OpenMP preloaded)."""


def format_cores(cores: Iterable[int]) -> str:
    """A CPU list as Linux writes one: ``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    ranges: list[list[int]] = []
    for core in sorted(set(cores)):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def parse_cores(text: str) -> frozenset[int]:
    """The cores of a Linux CPU list (``"0-2,5"``); ValueError naming it if malformed."""
    cores: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"{ENGINE_CORES_ENV}={text!r} is not a CPU list such as 0-3,6") from None
    return frozenset(cores)


def engine_cores(environ: Mapping[str, str] = os.environ) -> frozenset[int]:
    """The cores an engine started by this process may take (see the module docstring)."""
    configured = environ.get(ENGINE_CORES_ENV, "").strip()
    return parse_cores(configured) if configured else frozenset(os.sched_getaffinity(0))


def enter_engine_cores(cores: frozenset[int]) -> None:
    """Give the calling thread ``cores`` before it spawns an engine: the engine's
    processes inherit them. Cores this process may not use are the kernel's to
    refuse; the thread then keeps what it has."""
    if cores:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)


def binds_openmp(environment: Iterable[bytes]) -> bool:
    """Whether a process environment (``/proc/PID/environ`` entries) binds OpenMP threads."""
    return any(item.startswith(OPENMP_BINDING) for item in environment)
