"""A mesh with the whole chat and image paths but no vLLM, for tests that need
every service (Envoy, the orchestrator with its HTTP front door, each stage,
the supervisor) and not the LLM engine's start-up: the engine is a python stand-in with vLLM's
contract (tests/data/models/echo_engine) under the engine's name.

One such mesh serves the session (the ``small_mesh`` fixture in conftest.py:
the Prometheus and Phoenix tests share it). Its services export their spans
to an ``OtlpRelay``, which passes every batch on, byte for byte, to the
session's receiver and to any collector a test adds (Phoenix).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from tests.conftest import DATA
from tests.harness import ROOT

REAL_MODELS = (
    "llm",
    "smollm2_tokenizer",
    "smollm2_detokenizer",
    "image_classifier",
    "image_preprocess",
    "mobilenet_v2_onnx",
    "imagenet_top5",
)
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class OtlpRelay:
    """An OTLP/gRPC endpoint on 127.0.0.1 that forwards each export to its targets."""

    def __init__(self, *targets: str) -> None:
        self._lock = threading.Lock()
        self._targets: dict[str, tuple[grpc.Channel, Any]] = {}
        for target in targets:
            self.add(target)
        handler = grpc.unary_unary_rpc_method_handler(self._export)
        service = grpc.method_handlers_generic_handler(
            EXPORT.split("/")[1], {EXPORT.split("/")[2]: handler}
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((service,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        """``host:port`` for the mesh's ``otlp_endpoint``."""
        return f"127.0.0.1:{self.port}"

    def add(self, target: str) -> None:
        """Forward every export from now on to ``target`` too."""
        channel = grpc.insecure_channel(target)
        with self._lock:
            self._targets[target] = (channel, channel.unary_unary(EXPORT))

    def remove(self, target: str) -> None:
        """Stop forwarding to ``target``."""
        with self._lock:
            channel, _ = self._targets.pop(target)
        channel.close()

    def _export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            sends = [send for _, send in self._targets.values()]
        for send in sends:
            # A collector still starting misses these spans: they are not its test's.
            with contextlib.suppress(grpc.RpcError):
                send(request, timeout=10, wait_for_ready=True)
        return b""  # an empty ExportTraceServiceResponse

    def stop(self) -> None:
        """Stop the relay and close its channels."""
        self._server.stop(0)
        with self._lock:
            for channel, _ in self._targets.values():
                channel.close()


def start_small_mesh(
    prepared: Path, folder: Path, otlp_endpoint: str
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start it (free ports; spans to ``otlp_endpoint``); the supervisor and its ready info."""
    from tests.e2e.conftest import start_mesh

    repository = folder / "repository"
    repository.mkdir()
    for name in REAL_MODELS:
        (repository / name).symlink_to(prepared / name, target_is_directory=True)
    engine = repository / "smollm2"
    shutil.copytree(DATA / "models" / "echo_engine", engine)
    config_file = engine / "config.pbtxt"
    config_file.write_text(config_file.read_text().replace('"echo_engine"', '"smollm2"'))
    default = (ROOT / "deploy" / "local" / "mesh.yaml").read_text()
    config = folder / "mesh.yaml"
    endpoint = f"defaults:\n  otlp_endpoint: {otlp_endpoint}\n"
    config.write_text(default.replace("defaults:\n", endpoint, 1))
    return start_mesh(repository, config, ["--grace-s", "2"])
