"""meshserve.v1.RouteService over the core's route table.

The servicer translates only: proto -> the table's calls (route_table.py) -> proto.
"""

from __future__ import annotations

from typing import Any

import grpc

from meshserve.v1 import routes_pb2 as rapi
from meshserve.v1 import routes_pb2_grpc as rapi_grpc
from services.orchestrator.core import Orchestrator
from services.orchestrator.route_table import RouteStatus
from services.orchestrator.routes import (
    LATEST,
    RouteSpec,
    build_route,
    parse_spec,
)
from services.orchestrator.servicer import Context
from shared.errors import InvalidArgument


class RouteApiServicer(rapi_grpc.RouteServiceServicer):
    """RouteService over the core's route table."""

    def __init__(self, core: Orchestrator) -> None:
        self.core = core

    async def ListRoutes(
        self,
        request: rapi.ListRoutesRequest,
        context: Context[rapi.ListRoutesRequest, rapi.ListRoutesResponse],
    ) -> rapi.ListRoutesResponse:
        table = self.core.routes
        return rapi.ListRoutesResponse(
            routes=[status_to_proto(table.status(name)) for name in table.names()]
        )

    async def GetRoute(
        self,
        request: rapi.GetRouteRequest,
        context: Context[rapi.GetRouteRequest, rapi.GetRouteResponse],
    ) -> rapi.GetRouteResponse:
        return rapi.GetRouteResponse(status=self._status(request.name))

    async def PutRoute(
        self,
        request: rapi.PutRouteRequest,
        context: Context[rapi.PutRouteRequest, rapi.PutRouteResponse],
    ) -> rapi.PutRouteResponse:
        route = self.core.define_route(
            build_route(request.route.name, spec_from_proto(request.route))
        )
        return rapi.PutRouteResponse(status=self._status(route.name))

    async def DeleteRoute(
        self,
        request: rapi.DeleteRouteRequest,
        context: Context[rapi.DeleteRouteRequest, rapi.DeleteRouteResponse],
    ) -> rapi.DeleteRouteResponse:
        self.core.routes.delete(request.name)
        return rapi.DeleteRouteResponse()

    async def SetRouteWeights(
        self,
        request: rapi.SetRouteWeightsRequest,
        context: Context[rapi.SetRouteWeightsRequest, rapi.SetRouteWeightsResponse],
    ) -> rapi.SetRouteWeightsResponse:
        if not request.weights:
            raise InvalidArgument("weights: at least one target's weight is required")
        self.core.routes.set_weights(request.name, dict(request.weights))
        return rapi.SetRouteWeightsResponse(status=self._status(request.name))

    async def PromoteRoute(
        self,
        request: rapi.PromoteRouteRequest,
        context: Context[rapi.PromoteRouteRequest, rapi.PromoteRouteResponse],
    ) -> rapi.PromoteRouteResponse:
        if not request.target:
            raise InvalidArgument("target: the target to promote is required")
        self.core.routes.promote(request.name, request.target)
        return rapi.PromoteRouteResponse(status=self._status(request.name))

    async def RollbackRoute(
        self,
        request: rapi.RollbackRouteRequest,
        context: Context[rapi.RollbackRouteRequest, rapi.RollbackRouteResponse],
    ) -> rapi.RollbackRouteResponse:
        self.core.routes.rollback(request.name, request.target)
        return rapi.RollbackRouteResponse(status=self._status(request.name))

    def _status(self, name: str) -> rapi.RouteStatus:
        return status_to_proto(self.core.routes.status(name))


def spec_from_proto(route: rapi.Route) -> RouteSpec:
    """A Route message as a validated spec (InvalidArgument naming the field)."""
    document: dict[str, Any] = {
        "targets": [
            {"model": t.model, "version": t.version or LATEST, "weight": t.weight}
            for t in route.targets
        ]
    }
    if route.HasField("shadow"):
        shadow = route.shadow
        document["shadow"] = {
            "model": shadow.model,
            "version": shadow.version or LATEST,
            "fraction": shadow.fraction,
        }
    if route.HasField("rollback"):
        policy = route.rollback
        document["rollback"] = {
            "window_s": policy.window_s or 60.0,
            "min_requests": policy.min_requests or 20,
            "error_ratio_margin": policy.error_ratio_margin,
            "p99_margin_ms": policy.p99_margin_ms or None,
        }
    return parse_spec(route.name, document)


def status_to_proto(status: RouteStatus) -> rapi.RouteStatus:
    """A route's status as its message."""
    route = status.route
    message = rapi.RouteStatus(window_s=status.window_s)
    message.route.name = route.name
    for target in route.targets:
        message.route.targets.add(
            model=target.model,
            version=target.version or LATEST,
            weight=target.weight,
            id=target.id,
        )
    if route.shadow is not None:
        message.route.shadow.model = route.shadow.target.model
        message.route.shadow.version = route.shadow.target.version or LATEST
        message.route.shadow.fraction = route.shadow.fraction
    if route.rollback is not None:
        policy = route.rollback
        message.route.rollback.window_s = policy.window_s
        message.route.rollback.min_requests = policy.min_requests
        message.route.rollback.error_ratio_margin = policy.error_ratio_margin
        message.route.rollback.p99_margin_ms = policy.p99_margin_ms or 0.0
    for each in status.targets:
        window = each.window
        message.targets.add(
            target=each.target.id,
            weight=each.target.weight,
            requests=window.requests,
            errors=window.errors,
            error_ratio=window.error_ratio,
            rate_per_s=window.rate_per_s,
            p50_ms=window.p50_s * 1000,
            p99_ms=window.p99_s * 1000,
        )
    for event in status.events:
        message.events.add(
            time_unix=event.time_unix, kind=event.kind, target=event.target, detail=event.detail
        )
    tally = status.shadow
    message.shadow.compared = tally.compared
    message.shadow.failures = tally.failures
    message.shadow.max_abs_diff = tally.max_abs_diff
    message.shadow.top1_agreement = (
        tally.top1_agreed / tally.top1_total if tally.top1_total else -1.0
    )
    message.shadow.exact_match = (
        tally.exact_matched / tally.exact_total if tally.exact_total else -1.0
    )
    return message


def add_route_api(servicer: RouteApiServicer, server: grpc.aio.Server) -> None:
    """Register RouteService on a server."""
    rapi_grpc.add_RouteServiceServicer_to_server(servicer, server)


ROUTE_SERVICE_NAME = rapi.DESCRIPTOR.services_by_name["RouteService"].full_name
