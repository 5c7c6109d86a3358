"""One request, one trace: the orchestrator's span, a span per ensemble step, and
each stage's server span (with queue and compute time), correctly parented; a
request its caller did not sample records nothing anywhere."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import encode_inputs
from tests.conftest import DATA
from tests.harness import ServiceProcess, orchestrator_with_stage
from tests.integration.test_orchestrator import DIAMOND, ensemble, scale_model
from tests.otlp import OtlpReceiver, Span

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def mesh(
    tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[ServiceProcess]:
    repo = diamond_repository(tmp_path_factory.mktemp("trace-repo"))
    with orchestrator_with_stage(repo, "--otlp-endpoint", receiver.endpoint) as orchestrator:
        yield orchestrator


def diamond_repository(repo: Path) -> Path:
    """``diamond`` and its three steps (two of them 20 ms slow) in ``repo``."""
    shutil.copytree(DATA / "models" / "add_sub", repo / "add_sub")
    scale_model(repo, "double_slow", 2, sleep_ms=20)
    scale_model(repo, "triple_slow", 3, sleep_ms=20)
    ensemble(repo, "diamond", DIAMOND)
    return repo


def by_id(spans: list[Span]) -> dict[str, Span]:
    return {span.span_id: span for span in spans}


@pytest.mark.parametrize(
    ("trace_id", "timeout"),
    # With a deadline each step is a ModelInfer of its own; without one, a
    # message on the orchestrator's open stream to the stage: the same trace.
    [(TRACE_ID, 30.0), ("1af7651916cd43dd8448eb211c80319c", None)],
)
def test_one_trace_spans_every_hop(
    mesh: ServiceProcess, receiver: OtlpReceiver, trace_id: str, timeout: float | None
) -> None:
    request = pb.ModelInferRequest(model_name="diamond")
    encode_inputs(request, {"A": np.ones((1, 4), np.float32), "B": np.ones((1, 4), np.float32)})
    with grpc.insecure_channel(mesh.address) as channel:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=timeout, metadata=[("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")]
        )

    def complete(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        # The orchestrator's server span ends after its children, so once it has
        # arrived the step and client spans have too.
        orchestrator_done = any(s.service == "orchestrator" and s.kind == 2 for s in mine)
        return orchestrator_done and sum(1 for s in mine if s.service == "inference") >= 3

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]
    index = by_id(spans)

    (root,) = [s for s in spans if s.service == "orchestrator" and s.kind == 2]  # SERVER
    assert root.parent_id == CLIENT_SPAN
    assert root.name == "inference.GRPCInferenceService/ModelInfer"
    assert root.attributes["meshserve.model"] == "diamond"  # how a trace is found by model

    steps = [s for s in spans if s.name.startswith("ensemble step")]
    assert sorted(s.attributes["meshserve.model"] for s in steps) == [
        "add_sub",
        "double_slow",
        "triple_slow",
    ]
    assert all(s.parent_id == root.span_id for s in steps)

    stage_spans = [s for s in spans if s.service == "inference" and s.kind == 2]
    assert sorted(s.attributes["meshserve.model"] for s in stage_spans) == [
        "add_sub",
        "double_slow",
        "triple_slow",
    ]
    for span in stage_spans:
        # stage server span <- the step's span, which is the orchestrator's client span
        step = index[span.parent_id]
        assert step.service == "orchestrator" and step.kind == 3  # CLIENT
        assert step.attributes["meshserve.model"] == span.attributes["meshserve.model"]
        assert span.attributes["meshserve.queue_us"] >= 0
        assert span.attributes["meshserve.compute_us"] > 0


def test_a_stage_model_forwarded_on_a_stream_keeps_its_client_span(
    mesh: ServiceProcess, receiver: OtlpReceiver
) -> None:
    """A stage model's request without a deadline travels as a message on the
    orchestrator's stream to the stage, its trace with it: the orchestrator's
    server span, its client span for the call, the stage's server span."""
    trace_id = "2af7651916cd43dd8448eb211c80319c"
    request = pb.ModelInferRequest(model_name="add_sub")
    encode_inputs(
        request, {"INPUT0": np.ones((1, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)}
    )
    with grpc.insecure_channel(mesh.address) as channel:
        _, call = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer.with_call(
            request, metadata=[("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")]
        )
    (header,) = [v for k, v in call.trailing_metadata() if k == "traceparent"]

    def complete(spans: list[Span]) -> bool:
        return {"orchestrator", "inference"} <= {
            s.service for s in spans if s.trace_id == trace_id and s.kind == 2
        }

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]
    index = by_id(spans)
    (stage,) = [s for s in spans if s.service == "inference"]
    assert stage.kind == 2 and stage.attributes["meshserve.model"] == "add_sub"
    assert stage.attributes["meshserve.compute_us"] > 0
    client = index[stage.parent_id]
    assert (client.service, client.kind) == ("orchestrator", 3)  # CLIENT
    server = index[client.parent_id]
    assert (server.kind, server.parent_id) == (2, CLIENT_SPAN)
    assert header == f"00-{trace_id}-{server.span_id}-01"


def test_a_request_its_caller_did_not_sample_records_no_span(
    mesh: ServiceProcess, receiver: OtlpReceiver
) -> None:
    unsampled, sampled = "1" * 32, "2" * 32
    request = pb.ModelInferRequest(model_name="diamond")
    encode_inputs(request, {"A": np.ones((1, 4), np.float32), "B": np.ones((1, 4), np.float32)})
    with grpc.insecure_channel(mesh.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for trace_id, flags in ((unsampled, "00"), (sampled, "01")):
            _, call = stub.ModelInfer.with_call(
                request,
                timeout=30,
                metadata=[("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-{flags}")],
            )
            # The caller still learns its trace id, with the flag it sent.
            (header,) = [v for k, v in call.trailing_metadata() if k == "traceparent"]
            assert header.startswith(f"00-{trace_id}-") and header.endswith(f"-{flags}")

    def sampled_done(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == sampled and s.kind == 2]  # SERVER
        return sorted(s.service for s in mine) == ["inference"] * 3 + ["orchestrator"]

    # Every service exports in batches, the sampled request's after the other's.
    spans = receiver.wait_for(sampled_done)
    assert not [s for s in spans if s.trace_id == unsampled]


@pytest.fixture(scope="module")
def colocated_mesh(
    tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[ServiceProcess]:
    """The same repository on a colocated stage, which runs ``diamond`` whole."""
    repo = diamond_repository(tmp_path_factory.mktemp("trace-colocated"))
    arguments = ("--otlp-endpoint", receiver.endpoint)
    with orchestrator_with_stage(repo, *arguments, stage="colocated") as orchestrator:
        yield orchestrator


def test_an_ensemble_run_whole_on_a_stage_traces_each_step_there(
    colocated_mesh: ServiceProcess, receiver: OtlpReceiver
) -> None:
    trace_id = "3af7651916cd43dd8448eb211c80319c"
    request = pb.ModelInferRequest(model_name="diamond")
    encode_inputs(request, {"A": np.ones((1, 4), np.float32), "B": np.ones((1, 4), np.float32)})
    with grpc.insecure_channel(colocated_mesh.address) as channel:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, metadata=[("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")]
        )

    def complete(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        stage_done = any(s.service == "colocated" and s.kind == 2 for s in mine)
        return stage_done and any(s.service == "orchestrator" and s.kind == 2 for s in mine)

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]
    index = by_id(spans)
    (stage,) = [s for s in spans if s.service == "colocated" and s.kind == 2]  # SERVER
    assert stage.attributes["meshserve.model"] == "diamond"
    client = index[stage.parent_id]  # the orchestrator forwarded it: one hop
    assert (client.service, client.kind) == ("orchestrator", 3)
    assert not [s for s in spans if s.service == "orchestrator" and s.name.startswith("ensemble")]
    steps = [s for s in spans if s.name.startswith("ensemble step")]
    assert sorted(s.attributes["meshserve.model"] for s in steps) == [
        "add_sub",
        "double_slow",
        "triple_slow",
    ]
    for step in steps:
        assert step.service == "colocated" and step.parent_id == stage.span_id
        assert step.attributes["meshserve.compute_us"] > 0
