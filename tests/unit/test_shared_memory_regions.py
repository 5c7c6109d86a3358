"""Shared-memory regions (shared/shared_memory.py) over real POSIX shared-memory objects."""

from __future__ import annotations

import os
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from shared.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from shared.shared_memory import SHM_ROOT, SharedMemoryRegions
from shared.tensors import encode_inputs

SIZE = 64


@pytest.fixture
def block() -> Iterator[shared_memory.SharedMemory]:
    created = shared_memory.SharedMemory(f"meshserve_unit_{os.getpid()}", create=True, size=SIZE)
    yield created
    created.close()
    created.unlink()


@pytest.fixture
def regions(block: shared_memory.SharedMemory) -> SharedMemoryRegions:
    registered = SharedMemoryRegions(allowed=True)
    registered.register("r", f"/{block.name}", 16, 32)
    return registered


def shm_input(request: pb.ModelInferRequest, name: str, offset: int, size: int) -> None:
    tensor = request.inputs.add(name=name, datatype="FP32", shape=[1, size // 4])
    tensor.parameters["shared_memory_region"].string_param = "r"
    tensor.parameters["shared_memory_offset"].int64_param = offset
    tensor.parameters["shared_memory_byte_size"].int64_param = size


def test_status_register_and_unregister(
    regions: SharedMemoryRegions, block: shared_memory.SharedMemory
) -> None:
    (status,) = regions.status()
    assert (status.name, status.key, status.offset, status.byte_size) == (
        "r",
        f"/{block.name}",
        16,
        32,
    )
    with pytest.raises(AlreadyExists, match="'r' is already registered"):
        regions.register("r", block.name, 0, 8)
    regions.register("s", block.name, 0, 8)  # the leading '/' is optional, as in shm_open
    assert [s.name for s in regions.status()] == ["r", "s"]
    regions.unregister("ghost")  # no error, as Triton
    regions.unregister("r")
    with pytest.raises(NotFound, match="no shared-memory region 'r'"):
        regions.status("r")
    regions.unregister()
    assert regions.status() == [] and len(regions) == 0


def test_registration_is_refused_unless_allowed(block: shared_memory.SharedMemory) -> None:
    with pytest.raises(FailedPrecondition, match="--allow-client-shm=true"):
        SharedMemoryRegions(allowed=False).register("r", block.name, 0, 8)


@pytest.mark.parametrize(
    ("key", "offset", "size", "message"),
    [
        ("/../../etc/passwd", 0, 8, "is not a shared-memory object name"),
        ("/..", 0, 8, "is not a shared-memory object name"),
        ("/meshserve_unit_absent", 0, 8, "cannot open shared-memory object"),
        (None, 60, 8, "run past the end of shared-memory object"),
        (None, 0, 0, "byte_size must be positive"),
    ],
)
def test_a_bad_registration_names_what_is_wrong(
    block: shared_memory.SharedMemory, key: str | None, offset: int, size: int, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        SharedMemoryRegions(allowed=True).register("r", key or block.name, offset, size)


def test_a_link_in_the_shared_memory_folder_is_not_followed(
    block: shared_memory.SharedMemory,
) -> None:
    link = SHM_ROOT / f"meshserve_unit_link_{os.getpid()}"
    link.symlink_to(SHM_ROOT / block.name)
    try:
        with pytest.raises(InvalidArgument, match="cannot open shared-memory object"):
            SharedMemoryRegions(allowed=True).register("r", link.name, 0, 8)
    finally:
        link.unlink()


def test_inputs_are_read_in_place_and_outputs_written_back(
    regions: SharedMemoryRegions, block: shared_memory.SharedMemory
) -> None:
    values = np.arange(8, dtype=np.float32)
    block.buf[16:48] = values.tobytes()
    request = pb.ModelInferRequest(model_name="m")
    shm_input(request, "A", 0, 16)
    plain = pb.ModelInferRequest()
    encode_inputs(plain, {"B": np.ones((1, 4), dtype=np.float32)})
    request.inputs.add().CopyFrom(plain.inputs[0])
    request.raw_input_contents.append(plain.raw_input_contents[0])
    shm_input(request, "C", 16, 16)
    wanted = request.outputs.add(name="OUT")
    wanted.parameters["shared_memory_region"].string_param = "r"
    wanted.parameters["shared_memory_byte_size"].int64_param = 16
    wanted.parameters["binary_data"].bool_param = True  # other parameters stay

    placements = regions.resolve(request)

    raws = [np.frombuffer(raw, dtype=np.float32).tolist() for raw in request.raw_input_contents]
    assert raws == [[0, 1, 2, 3], [1, 1, 1, 1], [4, 5, 6, 7]]
    assert all(not t.parameters for t in (request.inputs[0], request.inputs[2]))
    assert list(request.outputs[0].parameters) == ["binary_data"]
    response = pb.ModelInferResponse(model_name="m")
    response.outputs.add(name="OTHER")
    response.outputs.add(name="OUT")
    response.raw_output_contents.extend([b"kept", np.full(4, 9, np.float32).tobytes()])
    regions.place(response, placements)
    assert list(response.raw_output_contents) == [b"kept", b""]
    assert np.frombuffer(bytes(block.buf[16:32]), dtype=np.float32).tolist() == [9, 9, 9, 9]


def test_a_request_without_regions_is_left_alone(regions: SharedMemoryRegions) -> None:
    request = pb.ModelInferRequest(model_name="m")
    encode_inputs(request, {"A": np.ones(4, dtype=np.float32)})
    before = request.SerializeToString()
    assert regions.resolve(request) == []
    assert request.SerializeToString() == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("no_size", "'shared_memory_region' is given without 'shared_memory_byte_size'"),
        ("negative", "'shared_memory_offset' must be a non-negative integer"),
        ("past_end", "16 bytes at offset 24 run past the end of region 'r' \\(32 bytes\\)"),
        ("extra_raw", "raw_input_contents has 1 entries for the 0 inputs not in shared memory"),
        ("contents", "input 'A': has both contents and a shared-memory region"),
    ],
)
def test_a_bad_shared_memory_input_names_it(
    regions: SharedMemoryRegions, change: str, message: str
) -> None:
    request = pb.ModelInferRequest(model_name="m")
    shm_input(request, "A", 0, 16)
    params = request.inputs[0].parameters
    if change == "no_size":
        del params["shared_memory_byte_size"]
    elif change == "negative":
        params["shared_memory_offset"].int64_param = -4
    elif change == "past_end":
        params["shared_memory_offset"].int64_param = 24
    elif change == "extra_raw":
        request.raw_input_contents.append(b"\0" * 16)
    else:
        request.inputs[0].contents.fp32_contents.extend([1, 2, 3, 4])
    with pytest.raises(InvalidArgument, match=message):
        regions.resolve(request)


def test_an_object_shrunk_after_registering_is_an_error_not_a_crash(
    regions: SharedMemoryRegions, block: shared_memory.SharedMemory
) -> None:
    # Through a mapping, reading past the object's end would be SIGBUS: the server dead.
    os.truncate(SHM_ROOT / block.name, 8)
    request = pb.ModelInferRequest(model_name="m")
    shm_input(request, "A", 0, 16)
    with pytest.raises(InvalidArgument, match="holds fewer bytes than region 'r'"):
        regions.resolve(request)


def test_an_output_larger_than_its_placement_is_refused(regions: SharedMemoryRegions) -> None:
    request = pb.ModelInferRequest(model_name="m")
    wanted = request.outputs.add(name="OUT")
    wanted.parameters["shared_memory_region"].string_param = "r"
    wanted.parameters["shared_memory_byte_size"].int64_param = 8
    placements = regions.resolve(request)
    response = pb.ModelInferResponse(model_name="m")
    response.outputs.add(name="OUT")
    response.raw_output_contents.append(b"\0" * 16)
    with pytest.raises(InvalidArgument, match="its 16 bytes do not fit the 8 bytes"):
        regions.place(response, placements)
