"""``meshserve route``: read and change the mesh's routes (meshserve.v1.RouteService).

::

    meshserve route list                          every route, its targets and weights
    meshserve route status NAME                   targets side by side: weight, requests,
                                                  errors, rate, p50/p99; shadow; events
    meshserve route set NAME TARGET=W [...]       change weights (e.g. mobilenet_v2:2=20)
    meshserve route define NAME --json DOC        define or replace a route
    meshserve route promote NAME TARGET           TARGET becomes the primary with 100%
    meshserve route rollback NAME [TARGET]        a candidate (default: all) back to 0
    meshserve route delete NAME

It speaks gRPC to the orchestrator (``--url``, as ``meshserve models`` does).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import grpc

from meshserve.v1 import routes_pb2 as rapi
from meshserve.v1 import routes_pb2_grpc as rapi_grpc

DEFAULT_URL = "127.0.0.1:8001"
TIMEOUT_S = 30.0


def _stub(url: str) -> rapi_grpc.RouteServiceStub:
    return rapi_grpc.RouteServiceStub(grpc.insecure_channel(url))  # type: ignore[no-untyped-call]


def render_status(status: rapi.RouteStatus) -> str:
    """A route's status as the table ``route status`` prints."""
    route = status.route
    lines = [f"route {route.name}  (primary {route.targets[0].id}; window {status.window_s:g} s)"]
    header = ("TARGET", "WEIGHT", "SHARE", "REQUESTS", "ERRORS", "ERR%", "RATE/s", "P50ms", "P99ms")
    total = sum(t.weight for t in status.targets) or 1.0
    rows = [
        (
            t.target,
            f"{t.weight:g}",
            f"{100 * t.weight / total:.1f}%",
            str(t.requests),
            str(t.errors),
            f"{100 * t.error_ratio:.1f}",
            f"{t.rate_per_s:.2f}",
            f"{t.p50_ms:.1f}",
            f"{t.p99_ms:.1f}",
        )
        for t in status.targets
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    if route.HasField("shadow"):
        shadow = status.shadow
        lines.append(
            f"shadow {route.shadow.model}:{route.shadow.version} "
            f"({100 * route.shadow.fraction:g}% mirrored): {shadow.compared} compared, "
            f"{shadow.failures} failed, max |diff| {shadow.max_abs_diff:.3g}"
            + _ratio(", top-1 agreement", shadow.top1_agreement)
            + _ratio(", exact match", shadow.exact_match)
        )
    if route.HasField("rollback"):
        policy = route.rollback
        rule = f"rollback when error ratio > primary + {policy.error_ratio_margin:g}"
        if policy.p99_margin_ms:
            rule += f" or p99 > primary + {policy.p99_margin_ms:g} ms"
        lines.append(f"{rule} (over {policy.window_s:g} s, at least {policy.min_requests} req)")
    for event in status.events[-10:]:
        when = time.strftime("%H:%M:%S", time.localtime(event.time_unix))
        lines.append(f"{when}  {event.kind:<13} {event.target or '-':<20} {event.detail}")
    return "\n".join(lines)


def _ratio(label: str, value: float) -> str:
    return "" if value < 0 else f"{label} {100 * value:.1f}%"


def _weights(pairs: list[str]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for pair in pairs:
        target, sep, value = pair.rpartition("=")
        try:
            weights[target] = float(value)
        except ValueError:
            sep = ""
        if not sep or not target:
            raise SystemExit(
                f"error: expected TARGET=WEIGHT (e.g. mobilenet_v2:2=10), got {pair!r}"
            )
    return weights


def route(args: argparse.Namespace) -> int:
    """Read and change the routes: list, status, set, define, promote, rollback, delete."""
    stub = _stub(args.url)
    action = args.action
    status: Any = None
    if action == "list":
        for each in stub.ListRoutes(rapi.ListRoutesRequest(), timeout=TIMEOUT_S).routes:
            weights = ", ".join(f"{t.id}={t.weight:g}" for t in each.route.targets)
            print(f"{each.route.name}: {weights}")
        return 0
    if action == "status":
        status = stub.GetRoute(rapi.GetRouteRequest(name=args.name), timeout=TIMEOUT_S).status
    elif action == "set":
        request = rapi.SetRouteWeightsRequest(name=args.name, weights=_weights(args.weights))
        status = stub.SetRouteWeights(request, timeout=TIMEOUT_S).status
    elif action == "define":
        message = rapi.Route(name=args.name)
        _merge_json(message, args.json)
        status = stub.PutRoute(rapi.PutRouteRequest(route=message), timeout=TIMEOUT_S).status
    elif action == "promote":
        promote = rapi.PromoteRouteRequest(name=args.name, target=args.target)
        status = stub.PromoteRoute(promote, timeout=TIMEOUT_S).status
    elif action == "rollback":
        rollback = rapi.RollbackRouteRequest(name=args.name, target=args.target or "")
        status = stub.RollbackRoute(rollback, timeout=TIMEOUT_S).status
    else:
        stub.DeleteRoute(rapi.DeleteRouteRequest(name=args.name), timeout=TIMEOUT_S)
        print(f"deleted route '{args.name}'")
        return 0
    print(render_status(status))
    return 0


def _merge_json(message: rapi.Route, text: str) -> None:
    from google.protobuf import json_format

    try:
        json_format.Parse(text, message)
    except (json_format.ParseError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: --json: {exc}") from exc


def _action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str
) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", default=DEFAULT_URL, help="the orchestrator's gRPC address (default: %(default)s)"
    )
    return actions.add_parser(name, help=summary, parents=[common])


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``meshserve route`` and its actions."""
    summary = (route.__doc__ or "").strip()
    parser = commands.add_parser("route", help=summary, description=__doc__.split("::")[0])
    parser.set_defaults(handler=route)
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    _action(actions, "list", "every route, its targets and weights")
    _action(actions, "status", "a route's targets side by side").add_argument("name")
    setter = _action(actions, "set", "change weights: TARGET=WEIGHT ...")
    setter.add_argument("name")
    setter.add_argument("weights", nargs="+", metavar="TARGET=WEIGHT")
    define = _action(actions, "define", "define or replace a route from JSON")
    define.add_argument("name")
    define.add_argument(
        "--json",
        required=True,
        help='e.g. \'{"targets": [{"model": "m", "version": "1", "weight": 90}, ...]}\'',
    )
    promote = _action(actions, "promote", "a target becomes the primary with 100%%")
    promote.add_argument("name")
    promote.add_argument("target")
    rollback = _action(actions, "rollback", "a candidate (default: all) back to 0")
    rollback.add_argument("name")
    rollback.add_argument("target", nargs="?")
    _action(actions, "delete", "remove a route").add_argument("name")
