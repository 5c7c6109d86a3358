"""Large tensors between an ensemble's steps through shared memory (``shm_handoff``).

Carried in messages, a step's 600 KB tensor is serialised by the stage that
made it, read and framed again by the orchestrator, and parsed by the stage that
takes it: four passes over the socket and as many copies. With every service on
one host it need not travel at all: the orchestrator names one of its buffers
(a POSIX shared-memory object only its user may open) on the step's requested
output, the stage writes the output there, and the next step's request names
the same buffer instead of carrying the bytes (shared/shared_memory.py reads
and writes them on the stage's side). An ensemble input that large goes into
a buffer once, before its first step.

A buffer's size is known before the call only for an output of fixed shape
(rows aside) and a numeric type; an output that turns out larger than its
buffer comes back in the message, and one of unknown size is never placed.
The buffers one ensemble run took go back to the pool when it succeeded; after
a failure or a cancellation a stage may still be writing into them, so they are
unlinked instead. No gRPC here.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import mmap
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import Step, StepCall, TensorSpec, WireTensor
from services.orchestrator.step_wire import answer_tensors, request_bytes
from shared.errors import MeshError
from shared.shared_memory import HANDOFF_KEY, SHM_ROOT
from shared.tensors import DATATYPES

log = logging.getLogger(__name__)

MIN_BYTES = 64 * 1024
"""Tensors smaller than this travel in the message (a buffer costs more than it saves)."""
POOL_BYTES = 512 << 20
"""Shared memory the orchestrator's buffers may take in all; past it, messages again."""
POOL_BUFFERS = 512
"""Buffers that may exist at once (each mapping holds a file descriptor)."""

Outputs = dict[str, WireTensor]


@dataclass(frozen=True)
class HandoffBuffer:
    """One shared-memory object of ``size`` bytes, mapped here."""

    key: str
    size: int
    memory: mmap.mmap


class HandoffPool:
    """The orchestrator's buffers, by size (powers of two from ``MIN_BYTES``)."""

    def __init__(self, limit_bytes: int = POOL_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._prefix = f"meshserve-handoff-{os.getpid()}-"
        self._numbers = itertools.count()
        self._free: dict[int, list[HandoffBuffer]] = {}
        self.held_bytes = 0
        """Bytes of every buffer that exists (free or taken)."""
        self.held_count = 0
        self._warned = False
        _sweep()

    def take(self, size: int) -> HandoffBuffer | None:
        """A buffer of at least ``size`` bytes; None when the pool is at its limit."""
        capacity = max(MIN_BYTES, 1 << (size - 1).bit_length())
        free = self._free.get(capacity)
        if free:
            return free.pop()
        if self.held_bytes + capacity > self.limit_bytes or self.held_count >= POOL_BUFFERS:
            return None
        key = f"{self._prefix}{next(self._numbers)}"
        try:
            memory = _created(SHM_ROOT / key, capacity)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("no handoff buffer of %d bytes (%s): messages instead", capacity, exc)
            return None
        self.held_bytes += capacity
        self.held_count += 1
        return HandoffBuffer(key, capacity, memory)

    def give(self, buffer: HandoffBuffer) -> None:
        """``buffer`` is free again."""
        self._free.setdefault(buffer.size, []).append(buffer)

    def discard(self, buffer: HandoffBuffer) -> None:
        """Unlink ``buffer``: a stage that still writes there writes to no one."""
        self.held_bytes -= buffer.size
        self.held_count -= 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_ROOT / buffer.key)

    async def aclose(self) -> None:
        """``close``, as a hook for the service's stop."""
        self.close()

    def close(self) -> None:
        """Unlink every free buffer."""
        for buffers in self._free.values():
            for buffer in buffers:
                self.discard(buffer)
        self._free.clear()


def _created(path: Path, size: int) -> mmap.mmap:
    """A new shared-memory object of ``size`` bytes at ``path``, mapped; OSError (and
    nothing left behind) when it cannot be made."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        # Pages reserved now: a full /dev/shm (a container's 64 MB) then fails
        # here, and the step goes in messages, instead of a SIGBUS on a write.
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _sweep() -> None:
    """Unlink the buffers of orchestrators that are gone (killed before their stop)."""
    for path in SHM_ROOT.glob("meshserve-handoff-*"):
        if HANDOFF_KEY.fullmatch(path.name) is None:
            continue
        pid = int(path.name.split("-")[2])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        except PermissionError:
            pass  # another user's process: alive


class HandoffScope:
    """The buffers one ensemble run holds; ``release`` when it is over."""

    def __init__(self, pool: HandoffPool) -> None:
        self.pool = pool
        self.held: dict[str, HandoffBuffer] = {}

    def take(self, size: int) -> HandoffBuffer | None:
        """A buffer for ``size`` bytes, held until ``release``."""
        buffer = self.pool.take(size)
        if buffer is not None:
            self.held[buffer.key] = buffer
        return buffer

    def placed(self, tensor: WireTensor) -> WireTensor:
        """``tensor`` in a buffer: itself when it is in one or too small to be worth
        one (or none is left), else a copy in a new one."""
        size = len(tensor.raw)
        if tensor.handoff or size < MIN_BYTES:
            return tensor
        buffer = self.take(size)
        if buffer is None:
            return tensor
        buffer.memory[:size] = tensor.raw
        return replace(tensor, raw=memoryview(buffer.memory)[:size], handoff=buffer.key)

    def view(self, model: str, key: str, size: int) -> memoryview:
        """The ``size`` bytes a stage wrote into buffer ``key``."""
        buffer = self.held.get(key)
        if buffer is None or size > buffer.size:
            raise MeshError(f"model '{model}': the stage answered with an unknown buffer '{key}'")
        return memoryview(buffer.memory)[:size]

    def release(self, succeeded: bool) -> None:
        """Give the buffers back (``succeeded``), or unlink them."""
        for buffer in self.held.values():
            if succeeded:
                self.pool.give(buffer)
            else:
                self.pool.discard(buffer)
        self.held.clear()


def output_bytes(spec: TensorSpec, inputs: Mapping[str, WireTensor]) -> int | None:
    """The bytes output ``spec`` takes for ``inputs``: its batch dim as their rows;
    None when its type or another dim leaves that open."""
    dtype = DATATYPES.get(spec.datatype)
    if dtype is None or spec.datatype == "BYTES" or not spec.shape:
        return None
    dims = list(spec.shape)
    if dims[0] == -1:
        rows = {t.shape[0] for t in inputs.values() if t.shape}
        if len(rows) != 1:
            return None
        dims[0] = rows.pop()
    if any(d < 0 for d in dims):
        return None
    return math.prod(dims) * dtype.itemsize


def placements(
    scope: HandoffScope,
    step: Step,
    outputs: list[str],
    inputs: Mapping[str, WireTensor],
    specs: Mapping[str, TensorSpec],
) -> dict[str, HandoffBuffer]:
    """A buffer for each of the step's ``outputs`` that a later step takes (``specs``:
    the ensemble tensors worth one) and whose size is known."""
    found: dict[str, HandoffBuffer] = {}
    for name in outputs:
        spec = specs.get(step.output_map.get(name, ""))
        size = output_bytes(spec, inputs) if spec is not None else None
        if size is None or size < MIN_BYTES:
            continue
        buffer = scope.take(size)
        if buffer is not None:
            found[name] = buffer
    return found


def in_messages(inputs: dict[str, WireTensor]) -> dict[str, WireTensor]:
    """``inputs`` to carry in a message: those in a buffer no longer name it (their
    bytes are read from it); ``inputs`` itself when none is in one."""
    if not any(tensor.handoff for tensor in inputs.values()):
        return inputs
    return {name: replace(tensor, handoff="") for name, tensor in inputs.items()}


class Forwarder(Protocol):
    """What a step call needs of the router (router.StageRouter)."""

    def local(self, model: str) -> bool:
        """Whether every replica of ``model`` is on this host."""
        ...

    async def forward(
        self, model: str, request: bytes, timeout_s: float | None, on_stream: str | None = None
    ) -> bytes:
        """A serialised request answered by a replica of ``model``."""
        ...


def handoff_call(
    router: Forwarder,
    scope: HandoffScope,
    intermediate: Mapping[str, TensorSpec],
    request_id: str,
    parameters: Mapping[str, pb.InferParameter],
    remaining: Callable[[], float | None] = lambda: None,
) -> StepCall:
    """A step as a forwarded request whose large tensors stay in ``scope``'s buffers
    when the step's stage is on this host, and travel in the message when it is not;
    ``remaining``: the caller's time left (None: no deadline, and the request may
    go as a message on an open stream)."""

    async def call(step: Step, inputs: dict[str, WireTensor], outputs: list[str]) -> Outputs:
        placed: dict[str, tuple[str, int]] = {}
        if router.local(step.model):
            inputs = {name: scope.placed(tensor) for name, tensor in inputs.items()}
            buffers = placements(scope, step, outputs, inputs, intermediate)
            placed = {name: (buffer.key, buffer.size) for name, buffer in buffers.items()}
        else:
            inputs = in_messages(inputs)
        data = request_bytes(step, inputs, outputs, request_id, parameters, placed)
        timeout = remaining()
        on_stream = request_id if timeout is None else None
        answer = await router.forward(step.model, data, timeout, on_stream)
        return answer_tensors(step.model, answer, scope)

    return call
