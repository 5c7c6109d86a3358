"""Routes without sockets: assignment, stickiness, changes, the file, the comparisons."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from inference import grpc_service_pb2 as pb
from services.orchestrator import route_table
from services.orchestrator.route_shadow import compare
from services.orchestrator.route_table import RouteTable
from services.orchestrator.routes import Route, Target, load_routes, parse_route
from shared.errors import ConfigError, InvalidArgument
from shared.tensors import encode_outputs

CANARY = Route("classifier", (Target("m", "1", 90), Target("m", "2", 10)))


def test_weighted_random_lands_ten_percent_on_the_candidate() -> None:
    rng = random.Random(20)
    picks = [CANARY.pick(rng=rng).id for _ in range(10_000)]
    share = picks.count("m:2") / len(picks)
    print(f"90/10 route: {share:.2%} of 10,000 requests on the candidate")
    assert 0.09 <= share <= 0.11


def test_sticky_keys_keep_their_target_and_only_move_into_the_candidate() -> None:
    keys = [f"user-{i}" for i in range(1000)]
    before = {key: CANARY.pick(key=key).id for key in keys}
    assert all(CANARY.pick(key=key).id == before[key] for key in keys)
    wider = CANARY.with_weights({"m:1": 80, "m:2": 20})
    after = {key: wider.pick(key=key).id for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    print(
        f"sticky: {sum(t == 'm:2' for t in before.values())} of 1,000 keys on the candidate "
        f"at 10%, {sum(t == 'm:2' for t in after.values())} at 20%; {len(moved)} moved, "
        f"{sum(after[k] == 'm:1' for k in moved)} of them out of the candidate"
    )
    assert all(after[key] == "m:2" for key in moved)
    assert 0.07 <= len(moved) / len(keys) <= 0.13


def test_rendezvous_with_three_targets_moves_keys_only_into_the_raised_one() -> None:
    route = Route("r", (Target("a", "", 50), Target("b", "", 30), Target("c", "", 20)))
    raised = route.with_weights({"c": 40})
    for i in range(2000):
        old, new = route.pick(key=str(i)).id, raised.pick(key=str(i)).id
        assert new in (old, "c")


def test_override_promote_and_rollback() -> None:
    assert CANARY.pick(override="m:2").id == "m:2"
    with pytest.raises(InvalidArgument, match=r"no target 'm:3' \(targets: m:1, m:2\)"):
        CANARY.pick(override="m:3")
    promoted = CANARY.promoted("m:2")
    assert [(t.id, t.weight) for t in promoted.targets] == [("m:2", 100), ("m:1", 0)]
    assert all(promoted.pick(key=str(i)).id == "m:2" for i in range(100))
    shadowed = parse_route(
        "s", {"targets": [{"model": "a", "weight": 1}, {"model": "b"}], "shadow": {"model": "b"}}
    )
    assert shadowed.promoted("b").shadow is None and shadowed.promoted("a").shadow is not None
    back = CANARY.rolled_back()
    assert [(t.id, t.weight) for t in back.targets] == [("m:1", 100), ("m:2", 0)]
    with pytest.raises(InvalidArgument, match="is the primary"):
        CANARY.rolled_back("m:1")
    with pytest.raises(InvalidArgument, match="at least one weight"):
        CANARY.with_weights({"m:1": 0, "m:2": 0})


def test_bad_routes_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"targets\.1\.weight"):
        parse_route("r", {"targets": [{"model": "a", "weight": 1}, {"model": "b", "weight": -1}]})
    with pytest.raises(InvalidArgument, match="listed twice"):
        parse_route("r", {"targets": [{"model": "a", "weight": 1}, {"model": "a", "weight": 1}]})
    with pytest.raises(InvalidArgument, match="version must be a number"):
        parse_route("r", {"targets": [{"model": "a", "version": "v2", "weight": 1}]})
    with pytest.raises(InvalidArgument, match="the route itself"):
        parse_route("r", {"targets": [{"model": "r", "weight": 1}]})
    (tmp_path / "routes.yaml").write_text("routes:\n  r:\n    targets: []\n")
    with pytest.raises(ConfigError, match=r"routes\.yaml: routes\.r\.targets"):
        load_routes(tmp_path)
    (tmp_path / "routes.yaml").write_text(
        "routes:\n  r:\n    targets: [{model: a, weight: 9}, {model: b, version: '2', weight: 1}]\n"
        "    shadow: {model: c, fraction: 0.5}\n"
    )
    route = load_routes(tmp_path)["r"]
    assert [t.id for t in route.targets] == ["a", "b:2"]
    assert route.shadow is not None and route.shadow.fraction == 0.5


def _response(**outputs: np.ndarray) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse()
    encode_outputs(response, outputs)
    return response


def test_shadow_comparisons() -> None:
    scores = np.array([[0.7, 0.2, 0.1]], dtype=np.float32)
    close = _response(P=scores + np.float32(0.01))
    result = compare([_response(P=scores)], [close])
    assert result.top1_agree is True and result.exact_match is None
    assert result.max_abs_diff == pytest.approx(0.01, abs=1e-6)
    flipped = compare([_response(P=scores)], [_response(P=scores[:, ::-1].copy())])
    assert flipped.top1_agree is False
    text = np.array([b"Paris"], dtype=object)
    assert compare([_response(T=text)], [_response(T=text)]).exact_match is True
    other = np.array([b"Lyon"], dtype=object)
    assert compare([_response(T=text)], [_response(T=other)]).exact_match is False
    # A stream is compared whole: the same text in other pieces matches.
    pieces = [
        _response(T=np.array([b"Pa"], dtype=object)),
        _response(T=np.array([b"ris"], dtype=object)),
    ]
    assert compare(pieces, [_response(T=text)]).exact_match is True
    assert compare(pieces, pieces[:1]).exact_match is False


def _policy_table(**policy: float) -> RouteTable:
    spec = {
        "targets": [{"model": "a", "weight": 50}, {"model": "b", "weight": 50}],
        "rollback": {"window_s": 30, "min_requests": 20, **policy},
    }
    return RouteTable({"r": parse_route("r", spec)}, CollectorRegistry())


def test_policy_rolls_back_a_slower_candidate_and_keeps_a_healthy_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The latency rule runs at most once a second; here every request is judged.
    monkeypatch.setattr(route_table, "P99_CHECK_INTERVAL_S", 0.0)
    table = _policy_table(error_ratio_margin=0.1, p99_margin_ms=100)
    route = table.require("r")
    primary, candidate = route.targets
    for _ in range(30):
        table.record("r", primary, True, 0.010)
        table.record("r", candidate, True, 0.050)  # slower, within the margin
    assert table.require("r").targets[1].weight == 50
    for _ in range(20):
        table.record("r", candidate, True, 0.400)
    after = table.status("r")
    assert [(t.target.id, t.target.weight) for t in after.targets] == [("a", 100), ("b", 0)]
    assert after.events[-1].kind == "auto-rollback" and after.events[-1].detail.startswith("p99")
    labels = {"route": "r", "target": "b", "reason": "p99"}
    assert table.metrics.rollbacks.labels(**labels)._value.get() == 1


def test_policy_judges_errors_only_past_the_minimum_sample() -> None:
    table = _policy_table(error_ratio_margin=0.1)
    primary, candidate = table.require("r").targets
    for index in range(19):
        table.record("r", primary, True, 0.01)
        table.record("r", candidate, index % 2 == 0, 0.01)  # half fail, but only 19
    assert table.require("r").targets[1].weight == 50
    table.record("r", candidate, False, 0.01)
    assert table.require("r").targets[1].weight == 0
    assert "error ratio 0.500 vs 0.000 over 20 requests" in table.status("r").events[-1].detail
