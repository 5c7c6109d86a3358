"""Triton's system shared-memory extension: tensors passed through POSIX shared
memory instead of inside the message.

A client creates a shared-memory object (``shm_open``: a file under /dev/shm),
registers a span of it as a named *region* (name, key, offset, byte_size), and
then names the region in an input's or a requested output's parameters
(``shared_memory_region``, ``shared_memory_byte_size`` and the optional
``shared_memory_offset``). ``SharedMemoryRegions.resolve`` turns such a request
into an ordinary one: each such input's bytes are read into
``raw_input_contents`` and each such output's parameters are taken off and kept
as a ``Placement``. ``place`` then writes the answer's outputs into their
regions and leaves their ``raw_output_contents`` entries empty, as Triton does.

Regions are read and written with pread/pwrite on a descriptor held while the
region is registered, never through a mapping: a client that shrinks its object
after registering gets a clear error instead of a SIGBUS that would take the
server, and every other caller's requests, down.

Only a service started with ``allow_client_shm`` (Triton's ``--allow-client-shm``)
registers regions: a caller who may register a key may read any shared-memory
object the server's user can open.

The mesh's own services on one host pass large tensors the same way
(``shm_handoff``): the orchestrator names one of its handoff buffers
(``meshserve_shm_key``, an object only its user may open) instead of a
registered region, and the stage opens it on first use and keeps it open. An
output that does not fit its buffer travels in the message instead, marked by
the absence of the key on the answer's output. A buffer only the stage's own
user could have made and can resize is mapped: its inputs are decoded in
place (``resolve_apart``) and its outputs written straight from their arrays
(``write_arrays``), where a 600 KB tensor would otherwise be copied three times
on each side. No gRPC here.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference import grpc_service_pb2 as pb
from shared.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Overloaded
from shared.tensors import parameter_value
from shared.wireformat import infer_request

SHM_ROOT = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory objects (``shm_open`` names)."""
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
HANDOFF = "meshserve_shm_key"
"""Parameter of a tensor in one of the orchestrator's handoff buffers (its key)."""
PARAMETERS = (REGION, HANDOFF, OFFSET, BYTE_SIZE)
MARK = REGION.encode()
"""What a serialised request holds when one of its tensors names a region."""
HANDOFF_KEY = re.compile(r"meshserve-handoff-\d{1,10}-\d{1,12}")
"""The names of the orchestrator's handoff buffers (``<pid>-<n>``)."""
HANDOFF_EXTENSION = "meshserve_shm_handoff"
"""What a server that takes handoff buffers lists among its protocol extensions."""
OPEN_HANDOFFS = 256
"""Handoff buffers a stage keeps open (the least recently used one closes)."""
MAX_REGIONS = 1024
"""Regions one service holds at once (each keeps a file descriptor open)."""
_KEY = re.compile(r"/*([A-Za-z0-9_.-]{1,250})")
OFF_MESSAGE = (
    "client shared memory is off on this service: start it with --allow-client-shm=true "
    "(MESHSERVE_ALLOW_CLIENT_SHM=true, or allow_client_shm: true in the mesh YAML)"
)


@dataclass(frozen=True)
class RegionStatus:
    """A registered region: ``byte_size`` bytes at ``offset`` of the object ``key``."""

    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class Placement:
    """Where a requested output goes: at most ``byte_size`` bytes at ``offset`` of ``region``
    (a handoff buffer's key where ``handoff``)."""

    output: str
    region: str
    offset: int
    byte_size: int
    handoff: bool = False


@dataclass(frozen=True)
class _Region:
    status: RegionStatus
    fd: int
    memory: mmap.mmap | None = None
    """A handoff buffer's mapping: its tensors are read and written in place."""


def _integer(params: Mapping[str, pb.InferParameter], key: str, what: str) -> int:
    value = parameter_value(params[key]) if key in params else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{what}: parameter '{key}' must be a non-negative integer")
    return value


def _placed(params: Mapping[str, pb.InferParameter]) -> bool:
    return REGION in params or HANDOFF in params


def _region_name(params: Mapping[str, pb.InferParameter], what: str) -> str:
    key = REGION if REGION in params else HANDOFF
    name = parameter_value(params[key])
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{what}: parameter '{key}' must be a region's name")
    if BYTE_SIZE not in params:
        raise InvalidArgument(f"{what}: '{key}' is given without '{BYTE_SIZE}'")
    return name


def _strip(params: Any) -> None:
    for key in PARAMETERS:
        if key in params:
            del params[key]


def _path_of(key: str) -> Path:
    """The file of shared-memory object ``key`` (``shm_open``'s name: leading '/' optional)."""
    match = _KEY.fullmatch(key)
    if match is None or match.group(1) in (".", ".."):
        raise InvalidArgument(
            f"key {key!r:.80} is not a shared-memory object name ('/name': letters, digits, "
            "'_', '-', '.')"
        )
    return SHM_ROOT / match.group(1)


class SharedMemoryRegions:
    """The system shared-memory regions registered with one service."""

    def __init__(self, allowed: bool, handoff: bool = False) -> None:
        self.allowed = allowed
        """Whether callers may register regions (``allow_client_shm``)."""
        self.handoff = handoff
        """Whether tensors may come and go in the orchestrator's handoff buffers."""
        self._regions: dict[str, _Region] = {}
        self._handoffs: OrderedDict[str, _Region] = OrderedDict()

    def __len__(self) -> int:
        return len(self._regions)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes at ``offset`` of object ``key`` as region ``name``."""
        if not self.allowed:
            raise FailedPrecondition(OFF_MESSAGE)
        if not name:
            raise InvalidArgument("a shared-memory region needs a name")
        if name in self._regions:
            raise AlreadyExists(f"shared-memory region '{name:.200}' is already registered")
        if len(self._regions) >= MAX_REGIONS:
            raise Overloaded(f"this service holds {MAX_REGIONS} shared-memory regions already")
        if byte_size <= 0:
            raise InvalidArgument(f"region '{name:.200}': byte_size must be positive")
        path = _path_of(key)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidArgument(
                f"region '{name:.200}': cannot open shared-memory object {key!r:.80}: "
                f"{exc.strerror}"
            ) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < offset + byte_size:
            os.close(fd)
            raise InvalidArgument(
                f"region '{name:.200}': {byte_size} bytes at offset {offset} run past the end "
                f"of shared-memory object {key!r:.80} ({info.st_size} bytes)"
            )
        self._regions[name] = _Region(RegionStatus(name, key, offset, byte_size), fd)

    def unregister(self, name: str = "") -> None:
        """Forget region ``name`` (every region when empty); an unknown name is no error."""
        names = list(self._regions) if not name else [name]
        for each in names:
            region = self._regions.pop(each, None)
            if region is not None:
                os.close(region.fd)

    def status(self, name: str = "") -> list[RegionStatus]:
        """Region ``name`` (every region when empty); NotFound for an unknown name."""
        if not name:
            return [region.status for region in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"no shared-memory region '{name:.200}' is registered")
        return [region.status]

    async def close(self) -> None:
        """Unregister every region and close the handoff buffers (a hook for the stop)."""
        self.unregister()
        while self._handoffs:
            os.close(self._handoffs.popitem()[1].fd)

    def resolve(self, request: pb.ModelInferRequest) -> list[Placement]:
        """Read ``request``'s shared-memory inputs into its raw contents and take its
        outputs' shared-memory parameters off; where those outputs go."""
        raws, placements = self.resolve_apart(request)
        if raws is not None:
            del request.raw_input_contents[:]
            request.raw_input_contents.extend(bytes(raw) for raw in raws)
        return placements

    def resolve_apart(
        self, request: pb.ModelInferRequest
    ) -> tuple[list[bytes | memoryview] | None, list[Placement]]:
        """As ``resolve``, but every input's raw contents come back beside ``request``
        (None when none is in shared memory) and stay out of it: a handoff buffer's
        tensors as views of its mapping, never copied."""
        raws = None
        if any(_placed(tensor.parameters) for tensor in request.inputs):
            raws = self._read_inputs(request)
        placements: list[Placement] = []
        for output in request.outputs:
            params = output.parameters
            if _placed(params):
                what = f"output '{output.name}'"
                name = _region_name(params, what)
                offset, size = _integer(params, OFFSET, what), _integer(params, BYTE_SIZE, what)
                self._span(self._target(params, name, what), offset, size, what)
                placements.append(Placement(output.name, name, offset, size, HANDOFF in params))
                _strip(params)
        return raws, placements

    async def forwarded(self, request: bytes, send: Callable[[bytes], Awaitable[bytes]]) -> bytes:
        """The answer ``send`` gets for serialised ``request``, its regions read
        before and written after (the request and answer decoded for it)."""
        decoded = infer_request(request)
        placements = self.resolve(decoded)
        answer = await send(decoded.SerializeToString())
        if not placements:
            return answer
        response = pb.ModelInferResponse.FromString(answer)
        self.place(response, placements)
        return response.SerializeToString()

    def write_arrays(
        self, outputs: Mapping[str, np.ndarray], placements: Iterable[Placement]
    ) -> dict[str, int]:
        """Copy each output placed in a handoff buffer straight into its mapping, where
        it fits; the bytes written, by output (``place`` then only names the buffer)."""
        written: dict[str, int] = {}
        for placement in placements:
            array = outputs.get(placement.output)
            if not placement.handoff or array is None or array.dtype.kind not in "biuf":
                continue
            if array.dtype.byteorder == ">" or array.nbytes > placement.byte_size:
                continue  # big-endian: encoded; too large: in the message
            what = f"output '{placement.output}'"
            memory = self._lookup(placement.region, True, what).memory
            if memory is None:
                continue
            target = np.frombuffer(memory, array.dtype, array.size, placement.offset)
            target[...] = array.reshape(-1)
            written[placement.output] = array.nbytes
        return written

    def place(
        self,
        response: pb.ModelInferResponse,
        placements: Iterable[Placement],
        in_place: Mapping[str, int] | None = None,
    ) -> None:
        """Write each placed output of ``response`` into its region; its raw entry
        empties. ``in_place``: outputs already in their buffers (``write_arrays``)."""
        wanted = {placement.output: placement for placement in placements}
        if not wanted:
            return
        for index, output in enumerate(response.outputs):
            placement = wanted.get(output.name)
            if placement is None or index >= len(response.raw_output_contents):
                continue
            if in_place and output.name in in_place:
                output.parameters[HANDOFF].string_param = placement.region
                output.parameters[BYTE_SIZE].int64_param = in_place[output.name]
                continue
            what = f"output '{output.name}'"
            data = response.raw_output_contents[index]
            if len(data) > placement.byte_size:
                if placement.handoff:
                    continue  # the orchestrator takes it from the message instead
                raise InvalidArgument(
                    f"{what}: its {len(data)} bytes do not fit the {placement.byte_size} "
                    f"bytes given in region '{placement.region}'"
                )
            region = self._lookup(placement.region, placement.handoff, what)
            self._span(region, placement.offset, len(data), what)
            try:
                written = os.pwrite(region.fd, data, region.status.offset + placement.offset)
            except OSError as exc:  # a full /dev/shm where the object was sparse
                raise InvalidArgument(
                    f"{what}: cannot write region '{placement.region}': {exc.strerror}"
                ) from None
            if written != len(data):
                raise InvalidArgument(
                    f"{what}: region '{placement.region}' took only {written} bytes"
                )
            response.raw_output_contents[index] = b""
            if placement.handoff:
                output.parameters[HANDOFF].string_param = placement.region
                output.parameters[BYTE_SIZE].int64_param = len(data)

    def _read_inputs(self, request: pb.ModelInferRequest) -> list[bytes | memoryview]:
        given = request.raw_input_contents
        raws: list[bytes | memoryview] = []
        taken = 0
        for tensor in request.inputs:
            what = f"input '{tensor.name}'"
            params = tensor.parameters
            if _placed(params):
                if tensor.HasField("contents"):
                    raise InvalidArgument(f"{what}: has both contents and a shared-memory region")
                name = _region_name(params, what)
                offset, size = _integer(params, OFFSET, what), _integer(params, BYTE_SIZE, what)
                region = self._span(self._target(params, name, what), offset, size, what)
                raws.append(self._read(region, offset, size, what))
                _strip(params)
            elif taken < len(given):
                raws.append(given[taken])
                taken += 1
            else:
                raise InvalidArgument(
                    f"{what}: with inputs in shared memory, the others go in raw_input_contents"
                )
        if taken != len(given):
            raise InvalidArgument(
                f"raw_input_contents has {len(given)} entries for the {taken} inputs "
                "not in shared memory"
            )
        return raws

    def _target(self, params: Mapping[str, pb.InferParameter], name: str, what: str) -> _Region:
        """The region a tensor's parameters name: registered, or a handoff buffer."""
        return self._lookup(name, HANDOFF in params, what)

    def _lookup(self, name: str, handoff: bool, what: str) -> _Region:
        if handoff:
            return self._handoff(name, what)
        region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(f"{what}: shared-memory region '{name:.200}' is not registered")
        return region

    def _handoff(self, key: str, what: str) -> _Region:
        """The orchestrator's buffer ``key``, opened on first use and kept open."""
        region = self._handoffs.get(key)
        if region is not None and os.fstat(region.fd).st_nlink:
            self._handoffs.move_to_end(key)
            return region
        if region is not None:  # unlinked since: a new buffer may have the name now
            os.close(self._handoffs.pop(key).fd)
        if not self.handoff:
            raise InvalidArgument(
                f"{what}: a tensor in a handoff buffer, but this service has shm_handoff off "
                "(set it on every service of the mesh, or on none)"
            )
        if HANDOFF_KEY.fullmatch(key) is None:
            raise InvalidArgument(f"{what}: {key!r:.80} is not a handoff buffer's name")
        try:
            fd = os.open(SHM_ROOT / key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidArgument(
                f"{what}: cannot open handoff buffer '{key}': {exc.strerror}"
            ) from None
        info = os.fstat(fd)
        region = _Region(RegionStatus(key, key, 0, info.st_size), fd, _mapped(fd, info))
        self._close_unlinked()
        self._handoffs[key] = region
        if len(self._handoffs) > OPEN_HANDOFFS:
            os.close(self._handoffs.popitem(last=False)[1].fd)
        return region

    def _close_unlinked(self) -> None:
        """Close the buffers the orchestrator removed (after a failed request): an
        open descriptor would keep their memory taken. A new buffer is when to look."""
        for key, region in list(self._handoffs.items()):
            if os.fstat(region.fd).st_nlink == 0:
                os.close(region.fd)
                del self._handoffs[key]

    @staticmethod
    def _span(region: _Region, offset: int, size: int, what: str) -> _Region:
        """``region``, checked to hold ``size`` bytes at ``offset``."""
        if offset + size > region.status.byte_size:
            raise InvalidArgument(
                f"{what}: {size} bytes at offset {offset} run past the end of region "
                f"'{region.status.name:.200}' ({region.status.byte_size} bytes)"
            )
        return region

    @staticmethod
    def _read(region: _Region, offset: int, size: int, what: str) -> bytes | memoryview:
        if region.memory is not None:
            # Read-only, as arrays decoded from a message are.
            return memoryview(region.memory).toreadonly()[offset : offset + size]
        try:
            data = os.pread(region.fd, size, region.status.offset + offset)
        except OSError as exc:
            raise InvalidArgument(
                f"{what}: cannot read region '{region.status.name}': {exc.strerror}"
            ) from None
        if len(data) != size:
            raise InvalidArgument(
                f"{what}: shared-memory object {region.status.key!r:.80} holds fewer bytes than "
                f"region '{region.status.name}' was registered with"
            )
        return data


def _mapped(fd: int, info: os.stat_result) -> mmap.mmap | None:
    """A handoff buffer's mapping (``info``: its fstat), where only this user could
    have made it and can change its size (a mapping past a shrunk object's end
    would fault: SIGBUS); None, and pread/pwrite, for any other."""
    if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
        return None
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        return None
    try:
        return mmap.mmap(fd, info.st_size)
    except OSError:  # out of address space or mappings: read it instead
        return None
