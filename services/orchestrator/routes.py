"""Routes: a model name clients call that sends each request to one of weighted targets.

A route names targets (a model or ensemble, at a version or the latest), each
with a weight; the first target is the *primary* (metadata and config of the
route are its). A request is assigned one target:

- an explicit override (``route_target`` parameter / header) picks that target;
- a sticky key (``route_key``) picks by weighted rendezvous hashing: every
  target scores the key, the highest score wins, and raising one target's
  weight only moves keys *into* it (lowering it only moves keys out of it);
- otherwise weighted random.

A route may also mirror a fraction of its requests to a *shadow* target whose
answer is compared, never returned, and carry an automatic rollback policy.
Routes come from ``routes.yaml`` at the repository root and change at run time
(route_table.py). Nothing here knows gRPC or HTTP; the objects are frozen, so a
change swaps a route whole and a request in flight keeps the target it got.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.errors import ConfigError, InvalidArgument

ROUTES_FILE = "routes.yaml"
"""The file at the repository root that defines the routes."""
KEY_PARAMETER = "route_key"
"""Request parameter (header ``x-meshserve-route-key``): the sticky assignment key."""
TARGET_PARAMETER = "route_target"
"""Request parameter (header ``x-meshserve-route-target``): a target to use directly;
also the response parameter (and header) naming the target that served."""
LATEST = "latest"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetSpec(_Spec):
    """One target as written in routes.yaml or sent to the API."""

    model: str = Field(min_length=1, max_length=256)
    """The model or ensemble that answers."""
    version: str = Field(LATEST, max_length=32)
    """A version number, or ``latest`` (the model's default policy)."""
    weight: float = Field(0.0, ge=0.0, le=1e6)
    """Relative share of the route's traffic (any scale; 90 and 10 mean 90%/10%)."""


class ShadowSpec(_Spec):
    """A target that receives a copy of a fraction of the route's requests."""

    model: str = Field(min_length=1, max_length=256)
    version: str = Field(LATEST, max_length=32)
    fraction: float = Field(1.0, ge=0.0, le=1.0)
    """Share of the route's requests mirrored (0 turns mirroring off)."""


class RollbackSpec(_Spec):
    """When a candidate is taken out of traffic automatically."""

    window_s: float = Field(60.0, gt=0.0, le=86400.0)
    """The sliding window the candidate and the primary are compared over."""
    min_requests: int = Field(20, ge=1, le=1_000_000)
    """Requests a candidate must have served in the window before it is judged."""
    error_ratio_margin: float = Field(0.05, ge=0.0, le=1.0)
    """Candidate error ratio above the primary's by more than this: rollback."""
    p99_margin_ms: float | None = Field(None, ge=0.0, le=3_600_000.0)
    """Candidate p99 latency above the primary's by more than this: rollback (unset: off)."""


class RouteSpec(_Spec):
    """A route as written in routes.yaml or sent to the API."""

    targets: list[TargetSpec] = Field(min_length=1, max_length=64)
    """The first target is the primary."""
    shadow: ShadowSpec | None = None
    rollback: RollbackSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> RouteSpec:
        ids = [_target_id(t.model, t.version) for t in self.targets]
        duplicate = next((i for i in ids if ids.count(i) > 1), None)
        if duplicate is not None:
            raise ValueError(f"target '{duplicate}' is listed twice")
        if sum(t.weight for t in self.targets) <= 0:
            raise ValueError("at least one target needs a weight above 0")
        checked: list[TargetSpec | ShadowSpec] = [*self.targets]
        if self.shadow is not None:
            checked.append(self.shadow)
        for target in checked:
            if target.version != LATEST and not target.version.isdigit():
                raise ValueError(
                    f"target '{target.model}': version must be a number or 'latest', "
                    f"got {target.version!r}"
                )
        return self


class RoutesFile(_Spec):
    """The whole routes.yaml."""

    routes: dict[str, RouteSpec] = Field(default_factory=dict)


def _target_id(model: str, version: str) -> str:
    return model if version in ("", LATEST) else f"{model}:{version}"


@dataclass(frozen=True)
class Target:
    """A model (at a version; "" is the latest) and its share of a route's traffic."""

    model: str
    version: str = ""
    weight: float = 0.0

    @property
    def id(self) -> str:
        """``model`` or ``model:version``: how responses, headers and the API name it."""
        return _target_id(self.model, self.version)


@dataclass(frozen=True)
class Shadow:
    """The mirrored target and the fraction of requests it gets a copy of."""

    target: Target
    fraction: float


@dataclass(frozen=True)
class Route:
    """A named route; ``targets[0]`` is the primary."""

    name: str
    targets: tuple[Target, ...]
    shadow: Shadow | None = None
    rollback: RollbackSpec | None = None

    @property
    def primary(self) -> Target:
        """The target whose metadata and config the route answers with."""
        return self.targets[0]

    def target(self, target_id: str) -> Target:
        """The target named ``target_id`` (InvalidArgument naming the choices if none)."""
        for target in self.targets:
            if target.id == target_id:
                return target
        choices = ", ".join(t.id for t in self.targets)
        raise InvalidArgument(
            f"route '{self.name}' has no target '{target_id}' (targets: {choices})"
        )

    def pick(self, key: str = "", override: str = "", rng: random.Random | None = None) -> Target:
        """The target for one request: the override, else by sticky key, else weighted random."""
        if override:
            return self.target(override)
        live = [t for t in self.targets if t.weight > 0]
        if key:
            return max(live, key=lambda t: _score(key, t))
        draw = (rng or random).random() * sum(t.weight for t in live)
        for target in live:
            draw -= target.weight
            if draw < 0:
                return target
        return live[-1]

    def with_weights(self, weights: Mapping[str, float]) -> Route:
        """The route with the named targets' weights changed (the others kept)."""
        for target_id in weights:
            self.target(target_id)
        targets = tuple(replace(t, weight=weights.get(t.id, t.weight)) for t in self.targets)
        if sum(t.weight for t in targets) <= 0:
            raise InvalidArgument(f"route '{self.name}': at least one weight must be above 0")
        if any(w < 0 or not math.isfinite(w) for w in weights.values()):
            raise InvalidArgument(f"route '{self.name}': weights must be finite and >= 0")
        return replace(self, targets=targets)

    def promoted(self, target_id: str) -> Route:
        """``target_id`` becomes the primary with all the traffic; the others stay at 0
        (a shadow of that same target is dropped: it would only mirror itself)."""
        chosen = self.target(target_id)
        rest = tuple(replace(t, weight=0.0) for t in self.targets if t.id != target_id)
        shadow = self.shadow if self.shadow and self.shadow.target.id != target_id else None
        return replace(self, targets=(replace(chosen, weight=100.0), *rest), shadow=shadow)

    def rolled_back(self, target_id: str = "") -> Route:
        """``target_id`` (default: every candidate) at weight 0, its share to the primary."""
        if target_id == self.primary.id:
            raise InvalidArgument(
                f"route '{self.name}': '{target_id}' is the primary; promote another "
                "target instead of rolling the primary back"
            )
        out = [self.target(target_id)] if target_id else list(self.targets[1:])
        freed = sum(t.weight for t in out)
        ids = {t.id for t in out}
        targets = tuple(
            replace(t, weight=0.0)
            if t.id in ids
            else replace(t, weight=t.weight + freed)
            if t is self.primary
            else t
            for t in self.targets
        )
        return replace(self, targets=targets)

    def spec(self) -> RouteSpec:
        """The route as the API and routes.yaml write it."""
        shadow = (
            ShadowSpec(
                model=self.shadow.target.model,
                version=self.shadow.target.version or LATEST,
                fraction=self.shadow.fraction,
            )
            if self.shadow
            else None
        )
        targets = [
            TargetSpec(model=t.model, version=t.version or LATEST, weight=t.weight)
            for t in self.targets
        ]
        return RouteSpec(targets=targets, shadow=shadow, rollback=self.rollback)


def _score(key: str, target: Target) -> float:
    """Weighted rendezvous score: P(target wins) is its share of the weights."""
    digest = hashlib.blake2b(f"{target.id}\0{key}".encode(), digest_size=8).digest()
    unit = (int.from_bytes(digest, "big") + 0.5) / 2.0**64  # in (0, 1)
    return -target.weight / math.log(unit)


def _version(text: str) -> str:
    return "" if text == LATEST else text


def build_route(name: str, spec: RouteSpec) -> Route:
    """A Route from its validated spec."""
    check_name(name)
    targets = tuple(Target(t.model, _version(t.version), t.weight) for t in spec.targets)
    shadow = None
    if spec.shadow is not None:
        mirrored = Target(spec.shadow.model, _version(spec.shadow.version))
        shadow = Shadow(mirrored, spec.shadow.fraction)
    for target in [*targets, *([shadow.target] if shadow else [])]:
        if target.model == name:
            raise InvalidArgument(f"route '{name}': a target cannot be the route itself")
    return Route(name, targets, shadow, spec.rollback)


def check_name(name: str) -> None:
    """InvalidArgument unless ``name`` can be a model name clients call."""
    if not name or len(name) > 256 or "/" in name or name.strip() != name:
        raise InvalidArgument(
            f"route name {name!r}: 1-256 characters, no '/', no surrounding spaces"
        )


def parse_spec(name: str, document: Any) -> RouteSpec:
    """A route's spec from a JSON/YAML document; InvalidArgument naming the bad field."""
    try:
        return RouteSpec.model_validate(document)
    except ValidationError as exc:
        raise InvalidArgument(f"route '{name}': {_first_error(exc)}") from None


def parse_route(name: str, document: Any) -> Route:
    """A route from a JSON/YAML document; InvalidArgument naming the bad field."""
    return build_route(name, parse_spec(name, document))


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else str(error["msg"])


def load_routes(repository: Path | None) -> dict[str, Route]:
    """The routes of ``<repository>/routes.yaml`` (none when there is no such file)."""
    if repository is None or not (repository / ROUTES_FILE).is_file():
        return {}
    path = repository / ROUTES_FILE
    try:
        document = yaml.safe_load(path.read_text()) or {}
        spec = RoutesFile.model_validate(document)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{ROUTES_FILE}: not valid YAML: {exc}") from None
    except ValidationError as exc:
        raise ConfigError(f"{ROUTES_FILE}: {_first_error(exc)}") from None
    return {name: build_route(name, route) for name, route in spec.routes.items()}
