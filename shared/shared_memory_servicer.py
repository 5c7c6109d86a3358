"""The system shared-memory RPCs of GRPCInferenceService: translation only.

The regions themselves, and how a request's tensors are read from and written
to them, are in shared/shared_memory.py. CUDA shared memory is not served:
tensors on a GPU travel in the message.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
from google.protobuf.message import Message

from inference import grpc_service_pb2 as pb
from shared.errors import Unimplemented
from shared.shared_memory import SharedMemoryRegions


class SharedMemoryMethods:
    """System shared-memory status, register and unregister over ``self.regions``."""

    regions: SharedMemoryRegions

    async def SystemSharedMemoryStatus(
        self,
        request: pb.SystemSharedMemoryStatusRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.regions.status(request.name):
            response.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region.name,
                    key=region.key,
                    offset=region.offset,
                    byte_size=region.byte_size,
                )
            )
        return response

    async def SystemSharedMemoryRegister(
        self,
        request: pb.SystemSharedMemoryRegisterRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self.regions.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self,
        request: pb.SystemSharedMemoryUnregisterRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self.regions.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def _no_cuda_shared_memory(
        self, request: Message, context: grpc.aio.ServicerContext[Any, Any]
    ) -> NoReturn:
        raise Unimplemented(
            "CUDA shared memory is not supported by meshserve; send the tensors in the "
            "message or in system shared memory"
        )

    CudaSharedMemoryStatus = _no_cuda_shared_memory
    CudaSharedMemoryRegister = _no_cuda_shared_memory
    CudaSharedMemoryUnregister = _no_cuda_shared_memory
