"""Triton's perf_analyzer, run as a Triton user runs it, against the mesh.

One small mesh (an inference stage with Triton's Python-backend ``add_sub``
and the decoupled ``square_int32``, the orchestrator serving REST too, and
Envoy). perf_analyzer reads each model's metadata and config, sends load over
gRPC or HTTP at each concurrency level, and reads the server's own request
counts from the statistics extension: its client-side count and the mesh's
count of the same windows must agree.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests import perf_analyzer
from tests.conftest import cache_dir
from tests.e2e.conftest import EDGE_MESH, start_mesh, stop_mesh
from tests.harness import ROOT

EXAMPLES = ROOT / "tests" / "data" / "python_examples"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    why = perf_analyzer.missing(cache_dir())
    if why is not None:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("perf-analyzer")
    for model in ("add_sub", "square_int32"):
        shutil.copytree(EXAMPLES / model, folder / "models" / model)
    config = folder / "mesh.yaml"
    # Regions for perf_analyzer's --shared-memory system (off by default, as in Triton).
    config.write_text(
        EDGE_MESH.replace("grace_period_s: 1", "grace_period_s: 1, allow_client_shm: true")
    )
    proc, info = start_mesh(folder / "models", config, ["--grace-s", "1"])
    yield {**info, "folder": folder}
    stop_mesh(proc)


def _address(mesh: dict[str, Any], where: str) -> str:
    return str(
        mesh["orchestrator"] if where == "orchestrator" else mesh["processes"]["envoy"]["grpc"]
    )


def _agrees(measurement: perf_analyzer.Measurement) -> None:
    """Every level has a throughput, and the server counted what the client sent."""
    assert measurement.levels, measurement.output
    assert all(level.throughput > 0 for level in measurement.levels), measurement.output
    pairs = list(zip(measurement.client_requests, measurement.server_requests, strict=True))
    assert len(pairs) == len(measurement.levels), measurement.output
    for client, server in pairs:
        # The server's window edges are read a moment apart from the client's: a few
        # requests in flight at an edge may fall on either side.
        assert abs(server - client) <= max(8, client // 10), measurement.output


@pytest.mark.parametrize(
    ("where", "protocol"),
    # gRPC through Envoy: the streaming test below.
    [("orchestrator", "grpc"), ("envoy", "http")],
)
def test_perf_analyzer_measures_the_mesh(mesh: dict[str, Any], where: str, protocol: str) -> None:
    levels = "1:2" if (where, protocol) == ("orchestrator", "grpc") else "2"
    measurement = perf_analyzer.run(
        cache_dir(),
        "add_sub",
        _address(mesh, where),
        protocol,
        levels,
        perf_analyzer.QUICK,
        folder=mesh["folder"],
    )
    assert [level.concurrency for level in measurement.levels] == (
        [1, 2] if levels == "1:2" else [2]
    )
    _agrees(measurement)


@pytest.mark.parametrize(("where", "protocol"), [("orchestrator", "grpc"), ("envoy", "http")])
def test_perf_analyzer_passes_tensors_in_system_shared_memory(
    mesh: dict[str, Any], where: str, protocol: str
) -> None:
    # perf_analyzer registers its regions, names them on every input and output,
    # and reads the outputs back from them; any error there fails the run.
    measurement = perf_analyzer.run(
        cache_dir(),
        "add_sub",
        _address(mesh, where),
        protocol,
        "2",
        [*perf_analyzer.QUICK, "--shared-memory", "system", "--output-shared-memory-size", "64"],
        folder=mesh["folder"],
    )
    _agrees(measurement)


def test_perf_analyzer_streams_a_decoupled_model(mesh: dict[str, Any]) -> None:
    data = mesh["folder"] / "square-input.json"
    data.write_text(json.dumps({"data": [{"IN": [3]}]}))
    measurement = perf_analyzer.run(
        cache_dir(),
        "square_int32",
        _address(mesh, "envoy"),
        "grpc",
        "2",
        [*perf_analyzer.QUICK, "--streaming", "--input-data", str(data)],
        folder=mesh["folder"],
    )
    _agrees(measurement)
    # IN = 3: three responses per request, each counted by perf_analyzer as it streams in.
    (response_rate,) = measurement.response_throughput
    (requests,) = measurement.client_requests
    seconds = requests / measurement.levels[0].throughput
    responses = response_rate * seconds
    # A window's edge may fall between a request's responses: on each of the 2
    # streams up to 2 of its 3 land on the far side, at each end of up to 3 windows.
    edges = 2 * 2 * 2 * 3
    assert abs(responses - 3 * requests) <= max(edges, 0.1 * 3 * requests), measurement.output


def test_perf_analyzer_reports_a_model_the_mesh_does_not_have(mesh: dict[str, Any]) -> None:
    with pytest.raises(RuntimeError, match="no_such_model"):
        perf_analyzer.run(
            cache_dir(),
            "no_such_model",
            _address(mesh, "orchestrator"),
            "grpc",
            "1",
            perf_analyzer.QUICK,
            folder=mesh["folder"],
        )
