"""Routes through the orchestrator's core and its gRPC front doors, in one process.

One mesh (tests/in_process.py: a python-backend stage and the orchestrator,
real grpc.aio servers on port 0) serves a model ``m`` at versions 1 and 2
(Y = X * version) and ``flaky`` (fails every fifth request), with routes
from the repository's routes.yaml. Routes are changed through
meshserve.v1.RouteService over gRPC while requests run.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from meshserve.v1 import routes_pb2 as rapi
from meshserve.v1 import routes_pb2_grpc as rapi_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import DATA
from tests.in_process import MeshThread

VERSIONED = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.factor = float(args["model_version"])

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", (pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * self.factor
                  ).astype(np.float32))]) for r in requests]
"""

FLAKY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.count = 0

    def execute(self, requests):
        responses = []
        for r in requests:
            self.count += 1
            if self.count % 5 == 0:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("flaky: every fifth request fails")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]))
        return responses
"""

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: {batch}
version_policy: {{ all {{}} }}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""

ROUTES = """
routes:
  canary:
    targets:
      - {model: m, version: "1", weight: 90}
      - {model: m, version: "2", weight: 10}
  mirrored:
    targets: [{model: m, version: "1", weight: 1}]
    shadow: {model: m, version: "2", fraction: 1.0}
  risky:
    targets: [{model: m, version: "1", weight: 50}, {model: flaky, weight: 50}]
    rollback: {window_s: 30, min_requests: 20, error_ratio_margin: 0.1}
  streamed:
    targets: [{model: repeat_int32, weight: 1}]
    shadow: {model: repeat_copy, fraction: 1.0}
"""


def write_repository(root: Path) -> Path:
    """``m`` (versions 1 and 2), ``flaky`` and routes.yaml."""
    for version in ("1", "2"):
        (root / "m" / version).mkdir(parents=True)
        (root / "m" / version / "model.py").write_text(VERSIONED)
    (root / "m" / "config.pbtxt").write_text(CONFIG.format(name="m", batch=8))
    (root / "flaky" / "1").mkdir(parents=True)
    (root / "flaky" / "1" / "model.py").write_text(FLAKY)
    (root / "flaky" / "config.pbtxt").write_text(CONFIG.format(name="flaky", batch=8))
    for name in ("repeat_int32", "repeat_copy"):
        shutil.copytree(DATA / "python_examples" / "repeat_int32", root / name)
    copy = root / "repeat_copy" / "config.pbtxt"
    copy.write_text(copy.read_text().replace('"repeat_int32"', '"repeat_copy"'))
    (root / "routes.yaml").write_text(ROUTES)
    return root


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshThread]:
    served = MeshThread(write_repository(tmp_path_factory.mktemp("routes")))
    # Seeded: the split's share is the same on every run (the draws are in request order).
    served.mesh.core.routes.rng = random.Random(20)
    yield served
    served.close()


@pytest.fixture(scope="module")
def routes(mesh: MeshThread) -> Iterator[rapi_grpc.RouteServiceStub]:
    with grpc.insecure_channel(mesh.address) as channel:
        yield rapi_grpc.RouteServiceStub(channel)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def v2(mesh: MeshThread) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(mesh.address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def request(model: str, x: np.ndarray, **parameters: str) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    encode_inputs(message, {"X": x.reshape(1, 4).astype(np.float32)})
    for key, value in parameters.items():
        message.parameters[key].string_param = value
    return message


def served_by(response: pb.ModelInferResponse) -> str:
    return response.parameters["route_target"].string_param


async def through_core(
    mesh: MeshThread, messages: list[pb.ModelInferRequest], in_flight: int = 32
) -> list[pb.ModelInferResponse]:
    """Each request's answer from the core, ``in_flight`` at a time."""
    gate = asyncio.Semaphore(in_flight)

    async def one(message: pb.ModelInferRequest) -> pb.ModelInferResponse:
        async with gate:
            return await mesh.mesh.core.infer(message, 30)

    return await asyncio.gather(*(one(m) for m in messages))


def test_a_90_10_route_sends_ten_percent_to_the_candidate(mesh: MeshThread) -> None:
    x = np.arange(4, dtype=np.float32)
    answers = mesh.run(through_core(mesh, [request("canary", x) for _ in range(1000)]))
    counts = Counter(served_by(a) for a in answers)
    print(f"canary 90/10 through the core: {dict(counts)}")
    # 1,000 draws at p = 0.1: a standard deviation of 0.95%; +-3% is over three
    # (and the seeded draws make it the same share on every run).
    assert set(counts) == {"m:1", "m:2"} and 70 <= counts["m:2"] <= 130
    for answer in answers:
        factor = {"m:1": 1, "m:2": 2}[served_by(answer)]
        assert decode_outputs(answer)["Y"].tolist() == [(x * factor).tolist()]


def test_sticky_keys_stay_and_a_wider_split_moves_keys_only_into_the_candidate(
    mesh: MeshThread, routes: rapi_grpc.RouteServiceStub
) -> None:
    routes.PutRoute(
        rapi.PutRouteRequest(
            route=rapi.Route(
                name="sticky",
                targets=[
                    rapi.RouteTarget(model="m", version="1", weight=90),
                    rapi.RouteTarget(model="m", version="2", weight=10),
                ],
            )
        ),
        timeout=10,
    )
    keys = [f"user-{i}" for i in range(200)]
    x = np.ones(4, dtype=np.float32)

    def assign() -> dict[str, str]:
        messages = [request("sticky", x, route_key=key) for key in keys * 2]
        answers = [served_by(a) for a in mesh.run(through_core(mesh, messages))]
        first, second = answers[: len(keys)], answers[len(keys) :]
        assert first == second, "a sticky key changed target between two requests"
        return dict(zip(keys, first, strict=True))

    before = assign()
    routes.SetRouteWeights(
        rapi.SetRouteWeightsRequest(name="sticky", weights={"m:1": 80, "m:2": 20}), timeout=10
    )
    after = assign()
    moved = [key for key in keys if before[key] != after[key]]
    print(
        f"sticky: {list(before.values()).count('m:2')} of {len(keys)} keys on m:2 at 10%, "
        f"{list(after.values()).count('m:2')} at 20%; {len(moved)} moved, all into m:2"
    )
    assert moved and all(after[key] == "m:2" for key in moved)


def test_weight_changes_promotion_and_rollback_under_load_fail_nothing(
    mesh: MeshThread, routes: rapi_grpc.RouteServiceStub
) -> None:
    route = rapi.Route(
        name="live",
        targets=[
            rapi.RouteTarget(model="m", version="1", weight=90),
            rapi.RouteTarget(model="m", version="2", weight=10),
        ],
    )
    routes.PutRoute(rapi.PutRouteRequest(route=route), timeout=10)
    done = threading.Event()
    x = np.arange(4, dtype=np.float32)

    async def load() -> tuple[Counter[str], list[str]]:
        served: Counter[str] = Counter()
        failures: list[str] = []

        async def worker() -> None:
            while not done.is_set():
                try:
                    answer = await mesh.mesh.v2.ModelInfer(request("live", x), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    failures.append(f"{exc.code()}: {exc.details()}")
                    continue
                factor = float(answer.model_version)
                if decode_outputs(answer)["Y"].tolist() != [(x * factor).tolist()]:
                    failures.append(f"wrong answer from {served_by(answer)}")
                served[served_by(answer)] += 1

        await asyncio.gather(*(worker() for _ in range(16)))
        return served, failures

    future = asyncio.run_coroutine_threadsafe(load(), mesh._loop)
    changes = [
        lambda: routes.SetRouteWeights(
            rapi.SetRouteWeightsRequest(name="live", weights={"m:1": 50, "m:2": 50}), timeout=10
        ),
        lambda: routes.PromoteRoute(
            rapi.PromoteRouteRequest(name="live", target="m:2"), timeout=10
        ),
        lambda: routes.SetRouteWeights(
            rapi.SetRouteWeightsRequest(name="live", weights={"m:1": 30}), timeout=10
        ),
        lambda: routes.RollbackRoute(rapi.RollbackRouteRequest(name="live"), timeout=10),
    ]
    try:
        for change in changes:
            time.sleep(0.4)
            change()
        time.sleep(0.4)
    finally:
        done.set()
    served, failures = future.result(60)
    status = routes.GetRoute(rapi.GetRouteRequest(name="live"), timeout=10).status
    print(f"16 in flight through 4 changes: {dict(served)}, {len(failures)} failed")
    assert failures == []
    assert served["m:1"] > 0 and served["m:2"] > 0
    assert [e.kind for e in status.events][-4:] == ["weights", "promote", "weights", "rollback"]
    # Promoted to 100, m:1 raised to 30, then rolled back: m:1's share went to the primary.
    assert [(t.id, t.weight) for t in status.route.targets] == [("m:2", 130), ("m:1", 0)]


def test_a_candidate_failing_a_fifth_of_its_requests_is_rolled_back(
    mesh: MeshThread, routes: rapi_grpc.RouteServiceStub
) -> None:
    x = np.ones(4, dtype=np.float32)

    async def send(count: int) -> list[str]:
        """Who served each request, in order ("failed" for an error)."""
        served: list[str] = []
        for _ in range(count):
            try:
                served.append(served_by(await mesh.mesh.core.infer(request("risky", x), 30)))
            except Exception:
                served.append("failed")
        return served

    started = time.monotonic()
    first = mesh.run(send(100))
    status = routes.GetRoute(rapi.GetRouteRequest(name="risky"), timeout=10).status
    events = [e for e in status.events if e.kind == "auto-rollback"]
    assert len(events) == 1 and events[0].target == "flaky", status
    assert events[0].time_unix - (time.time() - (time.monotonic() - started)) < 30
    assert "error ratio" in events[0].detail
    assert [(t.id, t.weight) for t in status.route.targets] == [("m:1", 100), ("flaky", 0)]
    registry = mesh.mesh.orchestrator.parts.registry
    labels = {"route": "risky", "target": "flaky", "reason": "error_ratio"}
    assert registry.get_sample_value("meshserve_route_rollbacks_total", labels) == 1
    after = mesh.run(send(50))
    print(
        f"auto-rollback ({events[0].detail}): {first.count('failed')} of the first 100 "
        f"requests failed, {first.count('flaky')} flaky answers; then {dict(Counter(after))}"
    )
    assert 0 < first.count("failed") <= 10
    assert after == ["m:1"] * 50


def test_shadow_changes_no_answer_and_its_comparison_is_exported(mesh: MeshThread) -> None:
    rng = np.random.default_rng(7)
    inputs = [rng.normal(size=4).astype(np.float32) for _ in range(20)]
    routed = mesh.run(through_core(mesh, [request("mirrored", x) for x in inputs]))
    alone = [request("m", x) for x in inputs]
    for message in alone:
        message.model_version = "1"
    direct = mesh.run(through_core(mesh, alone))
    for via_route, primary in zip(routed, direct, strict=True):
        assert served_by(via_route) == "m:1"
        del via_route.parameters["route_target"]
        assert via_route.SerializeToString(deterministic=True) == primary.SerializeToString(
            deterministic=True
        )
    mesh.run(mesh.mesh.core.routes.drain_shadows())
    registry = mesh.mesh.orchestrator.parts.registry
    labels = {"route": "mirrored", "target": "m:2"}

    def sample(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **extra})

    assert sample("meshserve_route_shadow_requests_total", outcome="compared") == 20
    assert sample("meshserve_route_shadow_max_abs_diff_count") == 20
    # Y = 2X against Y = X: the largest difference is the largest |x|.
    largest = max(float(np.abs(x).max()) for x in inputs)
    assert sample("meshserve_route_shadow_max_abs_diff_bucket", le="10.0") == 20
    assert sample("meshserve_route_shadow_max_abs_diff_bucket", le="0.1") == sum(
        float(np.abs(x).max()) <= 0.1 for x in inputs
    )
    assert sample("meshserve_route_shadow_top1_total", agree="true") is not None
    status = mesh.mesh.core.routes.status("mirrored")
    assert status.shadow.compared == 20
    assert status.shadow.max_abs_diff == pytest.approx(largest, rel=1e-6)


def test_a_stream_is_mirrored_whole_and_compared(mesh: MeshThread) -> None:
    message = pb.ModelInferRequest(model_name="streamed")
    values = np.array([4, -2, 9], dtype=np.int32)
    encode_inputs(
        message,
        {"IN": values, "DELAY": np.zeros(3, np.uint32), "WAIT": np.zeros(1, np.uint32)},
    )

    async def stream() -> list[pb.ModelInferResponse]:
        return [r async for r in mesh.mesh.core.stream(message, 30)]

    answers = mesh.run(stream())
    assert [decode_outputs(a)["OUT"].tolist() for a in answers if a.outputs] == [[4], [-2], [9]]
    assert {served_by(a) for a in answers} == {"repeat_int32"}
    mesh.run(mesh.mesh.core.routes.drain_shadows())
    tally = mesh.mesh.core.routes.status("streamed").shadow
    assert (tally.compared, tally.failures, tally.max_abs_diff) == (1, 0, 0.0)


def test_routes_answer_metadata_config_index_and_bad_input(
    mesh: MeshThread, v2: pb_grpc.GRPCInferenceServiceStub, routes: rapi_grpc.RouteServiceStub
) -> None:
    metadata = v2.ModelMetadata(pb.ModelMetadataRequest(name="canary"), timeout=10)
    assert metadata.name == "canary" and metadata.platform == "python"
    assert [i.name for i in metadata.inputs] == ["X"]
    config = v2.ModelConfig(pb.ModelConfigRequest(name="canary"), timeout=10).config
    assert config.name == "canary" and config.backend == "python"
    index = v2.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
    assert {"canary", "mirrored", "risky"} <= {m.name for m in index.models}

    x = np.ones(4, dtype=np.float32)
    answer, call = v2.ModelInfer.with_call(
        request("canary", x), metadata=(("x-meshserve-route-target", "m:2"),), timeout=10
    )
    assert served_by(answer) == "m:2" and answer.model_version == "2"
    assert ("x-meshserve-route-target", "m:2") in call.initial_metadata()
    with pytest.raises(grpc.RpcError) as caught:
        v2.ModelInfer(request("canary", x, route_target="m:7"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no target 'm:7' (targets: m:1, m:2)" in caught.value.details()
    bad = rapi.Route(name="typo", targets=[rapi.RouteTarget(model="nope", weight=1)])
    with pytest.raises(grpc.RpcError) as caught:
        routes.PutRoute(rapi.PutRouteRequest(route=bad), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "target 'nope' is not a model of the mesh" in caught.value.details()
    negative = rapi.Route(name="neg", targets=[rapi.RouteTarget(model="m", weight=-1)])
    with pytest.raises(grpc.RpcError) as caught:
        routes.PutRoute(rapi.PutRouteRequest(route=negative), timeout=10)
    assert "targets.0.weight" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        routes.GetRoute(rapi.GetRouteRequest(name="absent"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_repository_extension_defines_and_removes_a_route(
    v2: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    load = pb.RepositoryModelLoadRequest(model_name="ab")
    load.parameters["route"].string_param = json.dumps(
        {"targets": [{"model": "m", "version": "2", "weight": 1}]}
    )
    v2.RepositoryModelLoad(load, timeout=10)
    answer = v2.ModelInfer(request("ab", np.ones(4)), timeout=10)
    assert served_by(answer) == "m:2"
    v2.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="ab"), timeout=10)
    with pytest.raises(grpc.RpcError) as caught:
        v2.ModelInfer(request("ab", np.ones(4)), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
