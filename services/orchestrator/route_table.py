"""The mesh's routes at run time: assignment, outcomes, shadows, changes, rollback.

The core asks ``get(name)`` for every model name it is called with; a route
then serves the request through ``serve`` (unary) or ``assign`` + ``record``
(streams). Changes (``put``, ``set_weights``, ``promote``, ``rollback``,
``delete``) swap a frozen Route in one assignment on the event loop: a request
that already has its target keeps it, the next one sees the new weights, so a
change never fails a request. A target's outcome feeds its window; when the
route has a rollback policy, a candidate whose window is worse than the
primary's by the policy's margin is set to weight 0 at once (an event, a log
line and a metric). Mirrored requests run as owned tasks, cancelled on close.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from inference import grpc_service_pb2 as pb
from services.orchestrator.route_shadow import compare
from services.orchestrator.route_stats import (
    DEFAULT_WINDOW_S,
    RouteMetrics,
    ShadowTally,
    Window,
    WindowStats,
)
from services.orchestrator.routes import KEY_PARAMETER, TARGET_PARAMETER, Route, Target
from shared.errors import NotFound

log = logging.getLogger(__name__)

Call = Callable[[pb.ModelInferRequest], Awaitable[pb.ModelInferResponse]]
"""How the core answers a request for a model (a route's target)."""
Collect = Callable[[pb.ModelInferRequest], Awaitable[list[pb.ModelInferResponse]]]
"""Every answer a shadow gives one request (one, or a stream's)."""
SHADOW_TIMEOUT_S = 60.0
"""The longest a mirrored request may run (it answers nobody)."""
MAX_SHADOWS_IN_FLIGHT = 64
"""Mirrored requests beyond this many running are skipped, not queued."""
MAX_EVENTS = 50
P99_CHECK_INTERVAL_S = 1.0
"""The latency rule sorts the window's latencies: at most this often per target."""


@dataclass(frozen=True)
class RouteEvent:
    """A change of a route: by the API or by its rollback policy."""

    time_unix: float
    kind: str
    target: str
    detail: str


@dataclass(frozen=True)
class TargetStatus:
    """A target of a route as ``route status`` shows it."""

    target: Target
    window: WindowStats


@dataclass(frozen=True)
class RouteStatus:
    """A route, its targets' windows side by side, its recent events and shadow tally."""

    route: Route
    window_s: float
    targets: list[TargetStatus]
    events: list[RouteEvent]
    shadow: ShadowTally


def _window_s(route: Route) -> float:
    return route.rollback.window_s if route.rollback else DEFAULT_WINDOW_S


class RouteTable:
    """Every route of the mesh, changed at run time."""

    def __init__(
        self,
        routes: Mapping[str, Route],
        registry: CollectorRegistry,
        rng: random.Random | None = None,
    ) -> None:
        self._routes: dict[str, Route] = {}
        self._windows: dict[tuple[str, str], Window] = defaultdict(Window)
        self._events: dict[str, deque[RouteEvent]] = defaultdict(lambda: deque(maxlen=MAX_EVENTS))
        self._shadows: dict[str, ShadowTally] = defaultdict(ShadowTally)
        self._tasks: set[asyncio.Task[None]] = set()
        self._p99_checked: dict[tuple[str, str], float] = {}
        self.metrics = RouteMetrics(registry)
        self.rng = rng or random.Random()
        for route in routes.values():
            self.put(route, "loaded")

    # Reading.

    def get(self, name: str) -> Route | None:
        """The route called ``name`` (None: not a route)."""
        return self._routes.get(name)

    def names(self) -> list[str]:
        """Every route's name, sorted."""
        return sorted(self._routes)

    def require(self, name: str) -> Route:
        """The route called ``name``; NotFound naming the routes there are."""
        route = self._routes.get(name)
        if route is None:
            raise NotFound(f"no route '{name}' (routes: {', '.join(self.names()) or 'none'})")
        return route

    def status(self, name: str) -> RouteStatus:
        """The route with its targets' windows, events and shadow tally."""
        route = self.require(name)
        window_s = _window_s(route)
        targets = [
            TargetStatus(t, self._windows[name, t.id].stats(window_s)) for t in route.targets
        ]
        return RouteStatus(route, window_s, targets, list(self._events[name]), self._shadows[name])

    # Changes.

    def put(self, route: Route, kind: str = "set") -> Route:
        """Add or replace ``route``."""
        self._swap(route, kind, "", "targets " + _weights(route))
        return route

    def delete(self, name: str) -> None:
        """Remove a route (NotFound if there is none)."""
        route = self.require(name)
        del self._routes[name]
        for target in route.targets:
            self.metrics.weight.labels(name, target.id).set(0)
        log.info("route %s deleted", name)

    def set_weights(self, name: str, weights: Mapping[str, float]) -> Route:
        """Change some targets' weights."""
        route = self.require(name).with_weights(weights)
        return self._swap(route, "weights", "", _weights(route))

    def promote(self, name: str, target_id: str) -> Route:
        """``target_id`` becomes the primary with all the traffic."""
        route = self.require(name).promoted(target_id)
        return self._swap(route, "promote", target_id, _weights(route))

    def rollback(self, name: str, target_id: str = "", detail: str = "by request") -> Route:
        """A candidate (default: all) to weight 0, its share back to the primary."""
        route = self.require(name).rolled_back(target_id)
        for target in route.targets[1:]:
            if not target_id or target.id == target_id:
                self._windows.pop((name, target.id), None)
        return self._swap(route, "rollback", target_id, f"{detail}; {_weights(route)}")

    def _swap(self, route: Route, kind: str, target: str, detail: str) -> Route:
        self._routes[route.name] = route
        for each in route.targets:
            self.metrics.weight.labels(route.name, each.id).set(each.weight)
        self._events[route.name].append(RouteEvent(time.time(), kind, target, detail))
        log.info("route %s %s %s: %s", route.name, kind, target, detail)
        return route

    # Serving.

    def assign(self, route: Route, request: pb.ModelInferRequest) -> Target:
        """Pick the request's target and point the request at it (routing parameters removed)."""
        key = _pop_text(request, KEY_PARAMETER)
        target = route.pick(key, _pop_text(request, TARGET_PARAMETER), self.rng)
        request.model_name = target.model
        request.model_version = target.version
        return target

    async def serve(
        self, route: Route, request: pb.ModelInferRequest, call: Call, mirror_call: Call
    ) -> pb.ModelInferResponse:
        """One request of ``route``: its target's answer (``call``), naming the target;
        maybe mirrored to the shadow (``mirror_call``: its own deadline, not the caller's)."""
        mirror = self.mirror_copy(route, request)
        target = self.assign(route, request)
        started = time.perf_counter()
        try:
            response = await call(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.record(route.name, target, False, time.perf_counter() - started)
            raise
        self.record(route.name, target, True, time.perf_counter() - started)
        if mirror is not None:

            async def collect(shadow_request: pb.ModelInferRequest) -> list[pb.ModelInferResponse]:
                return [await mirror_call(shadow_request)]

            self.mirror(route, target, mirror, [response], collect)
        response.parameters[TARGET_PARAMETER].string_param = target.id
        return response

    def record(self, name: str, target: Target, ok: bool, seconds: float) -> None:
        """One request's outcome; may roll the target back under the route's policy."""
        self.metrics.requests.labels(name, target.id, "success" if ok else "failure").inc()
        self.metrics.latency.labels(name, target.id).observe(seconds)
        route = self._routes.get(name)
        if route is None:
            return
        self._windows[name, target.id].add(ok, seconds, _window_s(route))
        latency_rule = route.rollback is not None and route.rollback.p99_margin_ms is not None
        if not ok or latency_rule:  # a success only matters to the latency rule
            self._check_policy(route, target.id)

    def _check_policy(self, route: Route, target_id: str) -> None:
        policy = route.rollback
        live = next((t for t in route.targets[1:] if t.id == target_id and t.weight > 0), None)
        if policy is None or live is None:
            return
        window = self._windows[route.name, target_id]
        requests, errors = window.counts(policy.window_s)
        if requests < policy.min_requests:
            return
        primary = self._windows[route.name, route.primary.id]
        primary_requests, primary_errors = primary.counts(policy.window_s)
        ratio, primary_ratio = errors / requests, primary_errors / max(1, primary_requests)
        reason = ""
        if ratio > primary_ratio + policy.error_ratio_margin:
            reason = "error_ratio"
            detail = f"error ratio {ratio:.3f} vs {primary_ratio:.3f}"
        elif policy.p99_margin_ms is not None and primary_requests > 0:
            detail = self._slower(route.name, target_id, policy.window_s, policy.p99_margin_ms)
            reason = "p99" if detail else ""
        if not reason:
            return
        detail += f" over {requests} requests in {policy.window_s:g} s"
        log.warning("route %s: rolling back %s automatically (%s)", route.name, target_id, detail)
        self.metrics.rollbacks.labels(route.name, target_id, reason).inc()
        self.rollback(route.name, target_id, f"automatic, {detail}")
        self._events[route.name][-1] = RouteEvent(time.time(), "auto-rollback", target_id, detail)

    def _slower(self, name: str, target_id: str, window_s: float, margin_ms: float) -> str:
        """The p99 comparison when the candidate's is above the primary's by more than
        ``margin_ms`` ("" if not); percentiles sort the window, so at most once a second."""
        now = time.monotonic()
        if now - self._p99_checked.get((name, target_id), 0.0) < P99_CHECK_INTERVAL_S:
            return ""
        self._p99_checked[name, target_id] = now
        candidate = self._windows[name, target_id].stats(window_s)
        primary = self._windows[name, self.require(name).primary.id].stats(window_s)
        if (candidate.p99_s - primary.p99_s) * 1000 <= margin_ms:
            return ""
        return f"p99 {candidate.p99_s * 1000:.1f} ms vs {primary.p99_s * 1000:.1f} ms"

    # Shadows.

    def mirror_copy(
        self, route: Route, request: pb.ModelInferRequest
    ) -> pb.ModelInferRequest | None:
        """A copy of the request for the route's shadow, if this one is drawn to be mirrored."""
        shadow = route.shadow
        if shadow is None or shadow.fraction <= 0 or self.rng.random() >= shadow.fraction:
            return None
        mirror = pb.ModelInferRequest()
        mirror.CopyFrom(request)
        mirror.model_name = shadow.target.model
        mirror.model_version = shadow.target.version
        for key in (KEY_PARAMETER, TARGET_PARAMETER):
            if key in mirror.parameters:
                del mirror.parameters[key]
        return mirror

    def mirror(
        self,
        route: Route,
        served_by: Target,
        request: pb.ModelInferRequest,
        served: list[pb.ModelInferResponse],
        collect: Collect,
    ) -> None:
        """Send the copy to the shadow in the background and compare its answers with
        the served ones (nothing when the shadow is the target that served)."""
        shadow = route.shadow
        if shadow is None or shadow.target.id == served_by.id:
            return
        if len(self._tasks) >= MAX_SHADOWS_IN_FLIGHT:
            return  # the shadow must never hold back the caller's traffic
        task = asyncio.create_task(
            self._shadow(route.name, shadow.target, request, served, collect)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _shadow(
        self,
        name: str,
        target: Target,
        request: pb.ModelInferRequest,
        served: list[pb.ModelInferResponse],
        collect: Collect,
    ) -> None:
        try:
            answers = await asyncio.wait_for(collect(request), SHADOW_TIMEOUT_S)
            result = await asyncio.to_thread(compare, served, answers)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a shadow's failure is only counted, never raised
            self.metrics.shadow.labels(name, target.id, "failure").inc()
            self._shadows[name].failures += 1
            log.debug("route %s: shadow %s failed: %s", name, target.id, exc)
            return
        self.metrics.comparison(name, target.id, result)
        self._shadows[name].add(result)

    async def drain_shadows(self) -> None:
        """Wait for the mirrored requests in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel the mirrored requests in flight."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _pop_text(request: pb.ModelInferRequest, key: str) -> str:
    if key not in request.parameters:
        return ""
    value = request.parameters[key]
    which = value.WhichOneof("parameter_choice")
    text = "" if which is None else str(getattr(value, which))
    del request.parameters[key]
    return text


def _weights(route: Route) -> str:
    return ", ".join(f"{t.id}={t.weight:g}" for t in route.targets)
