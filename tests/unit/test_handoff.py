"""The orchestrator's handoff buffers (services/orchestrator/handoff.py) and a stage's
side of them (shared/shared_memory.py), on real POSIX shared memory."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import Step, TensorSpec, WireTensor
from services.orchestrator.handoff import (
    MIN_BYTES,
    HandoffPool,
    HandoffScope,
    output_bytes,
    placements,
)
from shared.errors import InvalidArgument
from shared.shared_memory import BYTE_SIZE, HANDOFF, SHM_ROOT, SharedMemoryRegions


@pytest.fixture
def pool() -> Iterator[HandoffPool]:
    made = HandoffPool(limit_bytes=4 * MIN_BYTES)
    yield made
    made.close()


def test_buffers_are_reused_by_size_and_capped(pool: HandoffPool) -> None:
    first = pool.take(1000)
    assert first is not None and first.size == MIN_BYTES
    assert (SHM_ROOT / first.key).stat().st_mode & 0o777 == 0o600
    pool.give(first)
    assert pool.take(MIN_BYTES) is first
    big = pool.take(MIN_BYTES + 1)
    assert big is not None and big.size == 2 * MIN_BYTES
    assert pool.take(2 * MIN_BYTES) is None  # over the limit: messages instead
    pool.discard(big)
    assert not (SHM_ROOT / big.key).exists()
    pool.give(first)


def test_a_failed_run_unlinks_its_buffers_a_good_one_keeps_them(pool: HandoffPool) -> None:
    tensor = WireTensor(
        "FP32", (MIN_BYTES // 4,), np.arange(MIN_BYTES // 4, dtype=np.float32).view(np.uint8).data
    )
    scope = HandoffScope(pool)
    placed = scope.placed(tensor)
    assert placed.handoff and bytes(placed.raw) == bytes(tensor.raw)
    assert scope.placed(placed) is placed  # already in a buffer
    small = WireTensor("FP32", (4,), b"\0" * 16)
    assert scope.placed(small) is small
    scope.release(succeeded=True)
    assert pool.held_bytes == MIN_BYTES
    again = HandoffScope(pool)
    assert again.placed(tensor).handoff == placed.handoff  # the same buffer, reused
    again.release(succeeded=False)
    assert pool.held_bytes == 0 and not (SHM_ROOT / placed.handoff).exists()


def test_buffers_of_a_dead_orchestrator_are_swept() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = SHM_ROOT / f"meshserve-handoff-{int(gone.stdout)}-0"
    stale.write_bytes(b"x")
    try:
        HandoffPool()
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("datatype", "shape", "rows", "expected"),
    [
        ("FP32", (-1, 3, 224, 224), 2, 2 * 3 * 224 * 224 * 4),
        ("FP32", (1000,), 5, 4000),  # a model without a batch dim
        ("FP32", (-1, -1), 2, None),  # a dim left open
        ("BYTES", (-1, 1), 2, None),
    ],
)
def test_output_sizes_come_from_the_spec_and_the_rows(
    datatype: str, shape: tuple[int, ...], rows: int, expected: int | None
) -> None:
    inputs = {"X": WireTensor("FP32", (rows, 7), b"")}
    assert output_bytes(TensorSpec("Y", datatype, shape), inputs) == expected


def test_only_later_steps_tensors_get_a_placement(pool: HandoffPool) -> None:
    step = Step(0, "pre", "", {"RAW": "raw"}, {"OUT": "tensor", "AUX": "aux"})
    inputs = {"RAW": WireTensor("UINT8", (1, 10), b"\0" * 10)}
    intermediate = {"tensor": TensorSpec("tensor", "FP32", (-1, 32768))}  # aux: an output
    scope = HandoffScope(pool)
    found = placements(scope, step, ["OUT", "AUX"], inputs, intermediate)
    assert list(found) == ["OUT"] and found["OUT"].size == 2 * MIN_BYTES
    scope.release(succeeded=False)


def test_a_stage_reads_and_writes_a_handoff_buffer(pool: HandoffPool) -> None:
    buffer = pool.take(MIN_BYTES)
    assert buffer is not None
    buffer.memory[:16] = np.arange(4, dtype=np.float32).tobytes()
    stage = SharedMemoryRegions(allowed=False, handoff=True)
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[1, 4])
    tensor.parameters[HANDOFF].string_param = buffer.key
    tensor.parameters[BYTE_SIZE].int64_param = 16
    wanted = request.outputs.add(name="Y")
    wanted.parameters[HANDOFF].string_param = buffer.key
    wanted.parameters[BYTE_SIZE].int64_param = 8
    placed = stage.resolve(request)
    assert np.frombuffer(request.raw_input_contents[0], np.float32).tolist() == [0, 1, 2, 3]
    # An output larger than its buffer stays in the message, without the key.
    response = pb.ModelInferResponse(model_name="m")
    response.outputs.add(name="Y")
    response.raw_output_contents.append(b"\1" * 16)
    stage.place(response, placed)
    assert response.raw_output_contents[0] == b"\1" * 16
    assert HANDOFF not in response.outputs[0].parameters
    # One that fits is written there, and the answer names the buffer and the size.
    response.raw_output_contents[0] = b"\2" * 8
    stage.place(response, placed)
    assert response.raw_output_contents[0] == b""
    assert response.outputs[0].parameters[HANDOFF].string_param == buffer.key
    assert response.outputs[0].parameters[BYTE_SIZE].int64_param == 8
    assert bytes(buffer.memory[:8]) == b"\2" * 8
    pool.discard(buffer)


def handoff_request(key: str, size: int, output: str = "") -> pb.ModelInferRequest:
    """A request whose FP32 input X (``size`` bytes) is in handoff buffer ``key``, and
    whose ``output``, if named, is to go there too."""
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[1, size // 4])
    tensor.parameters[HANDOFF].string_param = key
    tensor.parameters[BYTE_SIZE].int64_param = size
    if output:
        wanted = request.outputs.add(name=output)
        wanted.parameters[HANDOFF].string_param = key
        wanted.parameters[BYTE_SIZE].int64_param = size
    return request


def test_a_stage_takes_tensors_in_place_from_its_own_users_buffers(pool: HandoffPool) -> None:
    buffer = pool.take(MIN_BYTES)
    assert buffer is not None
    buffer.memory[:16] = np.arange(4, dtype=np.float32).tobytes()
    stage = SharedMemoryRegions(allowed=False, handoff=True)
    raws, placed = stage.resolve_apart(handoff_request(buffer.key, 16, output="Y"))
    assert raws is not None
    (x,) = raws
    # A view of the buffer, not a copy; read-only, as tensors from a message are.
    assert isinstance(x, memoryview) and x.readonly
    buffer.memory[:4] = np.float32(7).tobytes()
    assert np.frombuffer(x, np.float32).tolist() == [7, 1, 2, 3]
    # Outputs go straight from the array into the buffer; the answer only names it.
    y = np.array([[5, 6, 7, 8]], dtype=np.float32)
    written = stage.write_arrays({"Y": y, "Z": y}, placed)
    assert written == {"Y": 16}
    assert np.frombuffer(buffer.memory, np.float32, 4).tolist() == [5, 6, 7, 8]
    response = pb.ModelInferResponse(model_name="m")
    response.outputs.add(name="Y")
    response.raw_output_contents.append(b"")
    stage.place(response, placed, written)
    assert response.outputs[0].parameters[HANDOFF].string_param == buffer.key
    assert response.outputs[0].parameters[BYTE_SIZE].int64_param == 16
    # Too large for its buffer, or not a plain number type: left to the message.
    big = np.zeros((1, 8), dtype=np.float32)
    text = np.array([[b"a"]], dtype=object)
    assert stage.write_arrays({"Y": big}, placed) == {}
    assert stage.write_arrays({"Y": text}, placed) == {}
    del x, raws
    pool.discard(buffer)


def test_a_buffer_others_could_resize_is_read_not_mapped() -> None:
    # An object of the right name that the stage's user did not make private may be
    # shrunk by someone else: a mapping of it could fault, so its bytes are copied.
    key = f"meshserve-handoff-{os.getpid()}-{10**9 + 7}"
    path = SHM_ROOT / key
    path.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    try:
        path.chmod(0o644)
        raws, _ = SharedMemoryRegions(allowed=False, handoff=True).resolve_apart(
            handoff_request(key, 16)
        )
        assert raws is not None and isinstance(raws[0], bytes)
        assert np.frombuffer(raws[0], np.float32).tolist() == [0, 1, 2, 3]
    finally:
        path.unlink()


def test_a_name_used_again_after_an_unlink_is_opened_afresh() -> None:
    # The stage keeps buffers open by name; once the orchestrator removed one, a new
    # buffer of the same name (an orchestrator restarted with the same pid) is another.
    key = f"meshserve-handoff-{os.getpid()}-{10**9 + 8}"
    path = SHM_ROOT / key
    stage = SharedMemoryRegions(allowed=False, handoff=True)
    for value in (1.0, 2.0):
        path.write_bytes(np.full(4, value, dtype=np.float32).tobytes())
        path.chmod(0o600)
        request = handoff_request(key, 16)
        stage.resolve(request)
        assert np.frombuffer(request.raw_input_contents[0], np.float32).tolist() == [value] * 4
        path.unlink()


@pytest.mark.parametrize(
    ("handoff", "key", "message"),
    [
        (False, "meshserve-handoff-1-1", "this service has shm_handoff off"),
        (True, "psm_other_object", "is not a handoff buffer's name"),
        (True, "meshserve-handoff-1-999999", "cannot open handoff buffer"),
    ],
)
def test_a_stage_refuses_what_is_not_a_handoff_buffer(
    handoff: bool, key: str, message: str
) -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[1, 4])
    tensor.parameters[HANDOFF].string_param = key
    tensor.parameters[BYTE_SIZE].int64_param = 16
    with pytest.raises(InvalidArgument, match=message):
        SharedMemoryRegions(allowed=False, handoff=handoff).resolve(request)


def test_a_stage_closes_the_buffers_the_orchestrator_removed(pool: HandoffPool) -> None:
    stage = SharedMemoryRegions(allowed=False, handoff=True)

    def read(key: str) -> None:
        request = pb.ModelInferRequest(model_name="m")
        tensor = request.inputs.add(name="X", datatype="UINT8", shape=[1, 8])
        tensor.parameters[HANDOFF].string_param = key
        tensor.parameters[BYTE_SIZE].int64_param = 8
        stage.resolve(request)

    def removed_buffer() -> str:
        """A buffer the stage read, then unlinked (a failed run's) and unmapped here."""
        buffer = pool.take(8)
        assert buffer is not None
        read(buffer.key)
        pool.discard(buffer)
        return buffer.key

    removed = removed_buffer()
    gc.collect()
    # (Another test's stage may hold a buffer of that name too: pools in one process
    # number theirs alike. Count.)
    held = open_files().count(removed)
    assert held >= 1  # the stage still holds it open
    second = pool.take(8)
    assert second is not None
    read(second.key)  # opening the next one closes it
    assert open_files().count(removed) < held and second.key in open_files()
    pool.discard(second)


def open_files() -> str:
    """Where this process's descriptors point, one per line."""
    folder = "/proc/self/fd"
    links = []
    for name in os.listdir(folder):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"{folder}/{name}"))
    return "\n".join(links)


def test_a_buffer_that_cannot_be_made_means_messages_not_an_error() -> None:
    taken = SHM_ROOT / f"meshserve-handoff-{os.getpid()}-0"  # a new pool's first name
    taken.write_bytes(b"someone else's")
    try:
        assert HandoffPool().take(MIN_BYTES) is None
        assert taken.read_bytes() == b"someone else's"
    finally:
        taken.unlink()
