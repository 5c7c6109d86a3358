"""The descriptor set Envoy's gRPC-JSON transcoder reads, built from our generated code.

Taking the descriptors from the imported ``_pb2`` modules (not a second protoc
run) guarantees Envoy transcodes exactly the messages the services speak.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

from meshserve.v1 import jobs_pb2, meshserve_pb2, routes_pb2


def descriptor_set(*roots: FileDescriptor) -> descriptor_pb2.FileDescriptorSet:
    """``roots`` and every file they import, dependencies first."""
    result = descriptor_pb2.FileDescriptorSet()
    seen: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in seen:
            return
        seen.add(file.name)
        for dependency in file.dependencies:
            add(dependency)
        result.file.add().MergeFromString(file.serialized_pb)

    for root in roots:
        add(root)
    return result


def write_mesh_descriptor_set(path: Path) -> Path:
    """Write meshserve.v1's descriptor set (its services' files and their imports) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        descriptor_set(
            meshserve_pb2.DESCRIPTOR, routes_pb2.DESCRIPTOR, jobs_pb2.DESCRIPTOR
        ).SerializeToString()
    )
    return path
