"""The fault runs of the reliability harness: requests that cross every stage, a
signal to one stage replica under load, and the table row each run prints.

Imported by ``loadtests/reliability.py`` (parts ``faults`` and ``single``).
"""

from __future__ import annotations

import io
import signal
import time
from collections import Counter
from typing import Any

import faults
import grpc
import numpy as np
from common import format_table
from restart_watch import RestartWatch, ready_models

from deploy.local.procfs import process_cpu_seconds
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import encode_inputs

STAGES = ["inference", "tokenizer", "preprocess", "postprocess"]
RECOVERY_LIMIT_S = 10.0


def embedding_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="text_embedding")
    texts = np.empty((1, 1), dtype=object)
    texts[0, 0] = b"A reliable mesh answers every request."
    encode_inputs(request, {"TEXT": texts})
    return request


def image_request() -> pb.ModelInferRequest:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (96, 96), (200, 120, 40)).save(buffer, "PNG")
    request = pb.ModelInferRequest(model_name="image_classifier")
    images = np.empty((1, 1), dtype=object)
    images[0, 0] = buffer.getvalue()
    encode_inputs(request, {"IMAGE": images})
    return request


def stage_calls(
    stub: pb_grpc.GRPCInferenceServiceStub, timeout_s: float = 30
) -> dict[str, faults.Call]:
    """text_embedding and image_classifier (between them, every stage), by model."""

    def calling(request: pb.ModelInferRequest) -> faults.Call:
        def call() -> None:
            stub.ModelInfer(request, timeout=timeout_s)

        return call

    return {r.model_name: calling(r) for r in [embedding_request(), image_request()]}


def mixed_call(stub: pb_grpc.GRPCInferenceServiceStub, timeout_s: float = 30) -> faults.Call:
    """Alternately text_embedding and image_classifier."""
    calls = list(stage_calls(stub, timeout_s).values())
    turn = iter(range(10**12))

    def call() -> None:
        calls[next(turn) % len(calls)]()

    return call


def fault_rows(info: dict[str, Any], in_flight: int, single: bool) -> tuple[list[list[Any]], bool]:
    """SIGKILL each stage's last replica in turn (and, with 2 replicas, drain and stall)."""
    channel = grpc.insecure_channel(info["orchestrator"])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    rows, fine = [], True
    replica = 0 if single else 1
    runs = [(f"{s}-{replica}", signal.SIGKILL) for s in STAGES]
    if not single:
        runs.append(("inference-1", signal.SIGTERM))
    watches = []
    for label, signum in runs:
        # A standby still importing (after the last run's restart) would take CPU
        # from this run's restart.
        settle_standbys(info["supervisor_pid"], info.get("standbys", 0))
        pid = current_pid(info, label)
        watch = restart_watch(info, label, pid) if single else None
        plan = faults.FaultPlan(
            f"{signum.name} {label}",
            stage_calls(stub),
            pid,
            signum,
            in_flight=in_flight,
            duration_s=45.0 if single else 6.0,
            watch=watch.run if watch is not None else None,
        )
        result = faults.load_with_fault(plan)
        if watch is not None:
            watches.append((plan.name, watch))
        failures = result.failures()
        ok = set(failures) <= {"UNAVAILABLE"} if single else not failures
        ok = ok and max(result.recovery_s(), result.last_failure_s) < RECOVERY_LIMIT_S
        fine &= ok
        rows.append(_fault_row(plan.name, result, ok))
        _wait_serving(stub)
    if not single:
        rows.append(stall_row(info, stub))
        fine &= rows[-1][-1] == "yes"
    channel.close()
    for name, watch in watches:
        print(format_table([f"{name}: step", "s after the kill"], watch.rows()))
    return rows, fine


def settle_standbys(supervisor_pid: int, count: int, timeout_s: float = 120) -> None:
    """Wait until the supervisor keeps ``count`` standbys, each done importing (its
    CPU time still for half a second)."""
    deadline = time.monotonic() + timeout_s
    last: dict[int, float] = {}
    while time.monotonic() < deadline:
        waiting = faults.standby_pids(supervisor_pid)
        now = {pid: process_cpu_seconds(pid) for pid in waiting}
        if len(waiting) >= count and all(last.get(pid) == cpu for pid, cpu in now.items()):
            return
        last = now
        time.sleep(0.5)
    print(f"(standbys not settled within {timeout_s:.0f} s)")


def restart_watch(info: dict[str, Any], label: str, pid: int) -> RestartWatch:
    """A watch on ``label``'s restart after its kill (restart_watch.py)."""
    stage = info["processes"][label]["grpc"]
    return RestartWatch(
        supervisor_pid=info["supervisor_pid"],
        module=f"services.{label.rsplit('-', 1)[0]}.main",
        old_pid=pid,
        stage=stage,
        orchestrator=info["orchestrator"],
        models=ready_models(stage),
    )


def _fault_row(name: str, result: faults.FaultResult, ok: bool) -> list[Any]:
    failures = " ".join(f"{code}={n}" for code, n in sorted(result.failures().items()))
    recovery = [f"{kind} {s:.1f}" for kind, s in sorted(result.recovered_s.items())]
    recovery += [f"{kind} never" for kind in result.unrecovered()]
    return [
        name,
        result.requests,
        failures or "0",
        ", ".join(recovery) or "-",
        result.last_failure_s,
        "yes" if ok else "NO",
    ]


def _wait_serving(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    call = mixed_call(stub, timeout_s=5)

    def serves() -> bool:
        try:
            call()
            call()
        except grpc.RpcError:
            return False
        return True

    faults.wait_until(serves, timeout_s=60)


def stall_row(info: dict[str, Any], stub: pb_grpc.GRPCInferenceServiceStub) -> list[Any]:
    """SIGSTOP every tokenizer: text_embedding times out, image_classifier serves."""
    stalled = faults.stage_pids(info["supervisor_pid"], "services.tokenizer.main")
    codes: Counter[str] = Counter()
    with faults.stopped(stalled):
        for request in [embedding_request(), image_request()] * 4:
            try:
                stub.ModelInfer(request, timeout=3)
                codes[f"{request.model_name}:OK"] += 1
            except grpc.RpcError as exc:
                codes[f"{request.model_name}:{exc.code().name}"] += 1
    start = time.monotonic()
    _wait_serving(stub)
    timed_out = codes["text_embedding:DEADLINE_EXCEEDED"] + codes["text_embedding:UNAVAILABLE"]
    ok = timed_out == 4 and codes["image_classifier:OK"] == 4
    summary = " ".join(f"{k}={v}" for k, v in sorted(codes.items()))
    serving_s = time.monotonic() - start
    return ["SIGSTOP tokenizer", 8, summary, f"serving {serving_s:.1f}", "-", "yes" if ok else "NO"]


def current_pid(info: dict[str, Any], label: str) -> int:
    """The PID of ``label`` now: the one it started with, or the supervisor's restart."""
    table: faults.ProcessTable = info["table"]
    if label not in table.restarted():
        return table.pid(label)
    stage = label.rsplit("-", 1)[0]
    others = {table.pid(n) for n in table.started if n.startswith(stage + "-") and n != label}
    module = f"services.{stage}.main"
    (pid,) = set(faults.stage_pids(info["supervisor_pid"], module)) - others
    return pid


HEADERS = [
    "fault run",
    "requests",
    "failures by code",
    "recovery s (fault to first OK, per model that failed)",
    "last failure s",
    "as expected",
]
