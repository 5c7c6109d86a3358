"""Where a restart's time goes: what a killed stage does after the kill, step by step.

While a fault run loads the mesh, ``RestartWatch`` looks every ``POLL_S`` from
the outside, the way a client would see each step, and notes the seconds
from the kill to each first sighting::

    exited              the killed PID is gone (a zombie counts as gone)
    new process         the supervisor runs the stage again under another PID:
                        spawned (a new interpreter) or a standby taking over
    port bound          the stage's port accepts a TCP connection
    index answers       the stage answers RepositoryIndex (its models loading)
    <model> READY       the stage's index says the model serves, model by model
    health SERVING      the stage's start-up loads are all in
    orchestrator <m>    the orchestrator's ModelReady says the model serves

Imported by ``loadtests/reliability.py``; the first success of each kind of
call comes from the fault run itself (``faults.FaultResult.recovered_s``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import faults
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.local.procfs import TICKS, start_ticks
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc

POLL_S = 0.05
"""How often each step is looked for."""
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 100),
]
"""A watching channel must see the port come back at once, not after gRPC's backoff."""


@dataclass
class RestartWatch:
    """One stage replica's restart after a fault, seen from outside."""

    supervisor_pid: int
    module: str
    """The stage's module (``services.inference.main``)."""
    old_pid: int
    stage: str
    """The stage's ``host:port`` (a restart keeps its ports)."""
    orchestrator: str
    models: Sequence[str]
    """The stage's models to follow (those READY before the fault)."""
    marks: dict[str, float] = field(default_factory=dict)
    """Step -> seconds from the fault to its first sighting."""
    how: str = ""
    """How the new process came: ``spawned`` or ``standby``."""

    def run(self, fault_at: float, stop: threading.Event) -> None:
        """Look until every step was seen or ``stop`` is set (a FaultPlan watcher)."""
        boot_offset = time.clock_gettime(time.CLOCK_BOOTTIME) - time.monotonic()
        channels: list[grpc.Channel] = []
        try:
            while not stop.is_set() and not self._done():
                self._look(fault_at, boot_offset, channels)
                time.sleep(POLL_S)
        finally:
            for channel in channels:
                channel.close()

    def _done(self) -> bool:
        wanted = 5 + 2 * len(self.models)
        return len(self.marks) >= wanted

    def _mark(self, step: str, fault_at: float) -> None:
        self.marks.setdefault(step, time.monotonic() - fault_at)

    def _look(self, fault_at: float, boot_offset: float, channels: list[grpc.Channel]) -> None:
        if start_ticks(self.old_pid) is None or _zombie(self.old_pid):
            self._mark("exited", fault_at)
        if "new process" not in self.marks:
            self._find_process(fault_at, boot_offset)
        if "new process" not in self.marks:
            return  # the port may still be the dying process's
        if "port bound" not in self.marks and _accepts(self.stage):
            self._mark("port bound", fault_at)
        if "port bound" not in self.marks:
            return
        if not channels:
            channels += [
                grpc.insecure_channel(self.stage, options=FAST_RECONNECT),
                grpc.insecure_channel(self.orchestrator),
            ]
        self._look_at_stage(channels[0], fault_at)
        self._look_at_orchestrator(channels[1], fault_at)

    def _find_process(self, fault_at: float, boot_offset: float) -> None:
        for pid in faults.stage_pids(self.supervisor_pid, self.module):
            ticks = start_ticks(pid)
            if pid == self.old_pid or ticks is None:
                continue
            started = ticks / TICKS - boot_offset  # on the monotonic clock
            if started >= fault_at - 0.05:
                self.how = "spawned"
                self.marks["new process"] = max(0.0, started - fault_at)
            else:  # started before the fault: a standby, seen once it takes over
                self.how = "standby"
                self._mark("new process", fault_at)
            return

    def _look_at_stage(self, channel: grpc.Channel, fault_at: float) -> None:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=1)
        except grpc.RpcError:
            return
        self._mark("index answers", fault_at)
        for model in index.models:
            if model.name in self.models and model.state == "READY":
                self._mark(f"{model.name} READY", fault_at)
        health = health_pb2_grpc.HealthStub(channel)
        with contextlib.suppress(grpc.RpcError):
            answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            if answer.status == health_pb2.HealthCheckResponse.SERVING:
                self._mark("health SERVING", fault_at)

    def _look_at_orchestrator(self, channel: grpc.Channel, fault_at: float) -> None:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for model in self.models:
            step = f"orchestrator {model}"
            if step in self.marks or f"{model} READY" not in self.marks:
                continue
            with contextlib.suppress(grpc.RpcError):
                if stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=1).ready:
                    self._mark(step, fault_at)

    def rows(self) -> list[list[object]]:
        """The steps seen, in the order they came."""
        ordered = sorted(self.marks.items(), key=lambda item: item[1])
        return [
            [step + (f" ({self.how})" if step == "new process" else ""), seconds]
            for step, seconds in ordered
        ]


def ready_models(stage: str) -> list[str]:
    """The models the stage at ``stage`` serves now (READY in its index)."""
    with grpc.insecure_channel(stage) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
    return sorted({m.name for m in index.models if m.state == "READY"})


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return False


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.2):
            return True
    except OSError:
        return False
