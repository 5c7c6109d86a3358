from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteTarget(_message.Message):
    __slots__ = ("model", "version", "weight", "id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    weight: float
    id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., weight: _Optional[float] = ..., id: _Optional[str] = ...) -> None: ...

class RouteShadow(_message.Message):
    __slots__ = ("model", "version", "fraction")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    fraction: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., fraction: _Optional[float] = ...) -> None: ...

class RollbackPolicy(_message.Message):
    __slots__ = ("window_s", "min_requests", "error_ratio_margin", "p99_margin_ms")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MIN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_RATIO_MARGIN_FIELD_NUMBER: _ClassVar[int]
    P99_MARGIN_MS_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    min_requests: int
    error_ratio_margin: float
    p99_margin_ms: float
    def __init__(self, window_s: _Optional[float] = ..., min_requests: _Optional[int] = ..., error_ratio_margin: _Optional[float] = ..., p99_margin_ms: _Optional[float] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("name", "targets", "shadow", "rollback")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    name: str
    targets: _containers.RepeatedCompositeFieldContainer[RouteTarget]
    shadow: RouteShadow
    rollback: RollbackPolicy
    def __init__(self, name: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[RouteTarget, _Mapping]]] = ..., shadow: _Optional[_Union[RouteShadow, _Mapping]] = ..., rollback: _Optional[_Union[RollbackPolicy, _Mapping]] = ...) -> None: ...

class RouteTargetStats(_message.Message):
    __slots__ = ("target", "weight", "requests", "errors", "error_ratio", "rate_per_s", "p50_ms", "p99_ms")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_RATIO_FIELD_NUMBER: _ClassVar[int]
    RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    target: str
    weight: float
    requests: int
    errors: int
    error_ratio: float
    rate_per_s: float
    p50_ms: float
    p99_ms: float
    def __init__(self, target: _Optional[str] = ..., weight: _Optional[float] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., error_ratio: _Optional[float] = ..., rate_per_s: _Optional[float] = ..., p50_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ...) -> None: ...

class RouteEvent(_message.Message):
    __slots__ = ("time_unix", "kind", "target", "detail")
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    time_unix: float
    kind: str
    target: str
    detail: str
    def __init__(self, time_unix: _Optional[float] = ..., kind: _Optional[str] = ..., target: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class RouteShadowStats(_message.Message):
    __slots__ = ("compared", "failures", "max_abs_diff", "top1_agreement", "exact_match")
    COMPARED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    EXACT_MATCH_FIELD_NUMBER: _ClassVar[int]
    compared: int
    failures: int
    max_abs_diff: float
    top1_agreement: float
    exact_match: float
    def __init__(self, compared: _Optional[int] = ..., failures: _Optional[int] = ..., max_abs_diff: _Optional[float] = ..., top1_agreement: _Optional[float] = ..., exact_match: _Optional[float] = ...) -> None: ...

class RouteStatus(_message.Message):
    __slots__ = ("route", "window_s", "targets", "events", "shadow")
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    route: Route
    window_s: float
    targets: _containers.RepeatedCompositeFieldContainer[RouteTargetStats]
    events: _containers.RepeatedCompositeFieldContainer[RouteEvent]
    shadow: RouteShadowStats
    def __init__(self, route: _Optional[_Union[Route, _Mapping]] = ..., window_s: _Optional[float] = ..., targets: _Optional[_Iterable[_Union[RouteTargetStats, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[RouteEvent, _Mapping]]] = ..., shadow: _Optional[_Union[RouteShadowStats, _Mapping]] = ...) -> None: ...

class ListRoutesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRoutesResponse(_message.Message):
    __slots__ = ("routes",)
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    routes: _containers.RepeatedCompositeFieldContainer[RouteStatus]
    def __init__(self, routes: _Optional[_Iterable[_Union[RouteStatus, _Mapping]]] = ...) -> None: ...

class GetRouteRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetRouteResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RouteStatus
    def __init__(self, status: _Optional[_Union[RouteStatus, _Mapping]] = ...) -> None: ...

class PutRouteRequest(_message.Message):
    __slots__ = ("route",)
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    route: Route
    def __init__(self, route: _Optional[_Union[Route, _Mapping]] = ...) -> None: ...

class PutRouteResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RouteStatus
    def __init__(self, status: _Optional[_Union[RouteStatus, _Mapping]] = ...) -> None: ...

class DeleteRouteRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteRouteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetRouteWeightsRequest(_message.Message):
    __slots__ = ("name", "weights")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    weights: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SetRouteWeightsResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RouteStatus
    def __init__(self, status: _Optional[_Union[RouteStatus, _Mapping]] = ...) -> None: ...

class PromoteRouteRequest(_message.Message):
    __slots__ = ("name", "target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    target: str
    def __init__(self, name: _Optional[str] = ..., target: _Optional[str] = ...) -> None: ...

class PromoteRouteResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RouteStatus
    def __init__(self, status: _Optional[_Union[RouteStatus, _Mapping]] = ...) -> None: ...

class RollbackRouteRequest(_message.Message):
    __slots__ = ("name", "target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    target: str
    def __init__(self, name: _Optional[str] = ..., target: _Optional[str] = ...) -> None: ...

class RollbackRouteResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RouteStatus
    def __init__(self, status: _Optional[_Union[RouteStatus, _Mapping]] = ...) -> None: ...
