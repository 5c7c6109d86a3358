"""Stage discovery: names to every replica, and the router's replica set following them.

The resolver reads a real hosts file (and the system resolver for
``localhost``); the router's channels are opened but never connected: each
call's ``invoke`` answers or hangs by itself, so retiring a replica with a call
in flight is seen without sockets (the network-namespace test does it for
real: tests/integration/test_multihost.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from opentelemetry import trace

from services.orchestrator.discovery import Resolver, join_target, parse_hosts, split_target
from services.orchestrator.endpoint import Endpoint, StageAddress
from services.orchestrator.router import Discovery, StageRouter

HOSTS = """\
# replicas of two stages
198.18.0.10 preprocess pre   # an alias too
198.18.0.11 preprocess
198.18.0.11 preprocess
198.18.0.20 postprocess
not-an-address preprocess
2001:db8::5 postprocess
"""


def test_hosts_file_gives_every_address_of_a_name_in_order() -> None:
    table = parse_hosts(HOSTS)
    assert table["preprocess"] == ["198.18.0.10", "198.18.0.11"]
    assert table["pre"] == ["198.18.0.10"]
    assert table["postprocess"] == ["198.18.0.20", "2001:db8::5"]


def test_resolver_reads_the_file_each_time_then_falls_back_to_the_system(
    tmp_path: Path,
) -> None:
    asyncio.run(resolve_from_file(tmp_path))


async def resolve_from_file(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    resolver = Resolver(hosts)
    assert await resolver.expand("preprocess:9000") == ["198.18.0.10:9000", "198.18.0.11:9000"]
    assert await resolver.expand("PostProcess:7") == ["198.18.0.20:7", "[2001:db8::5]:7"]
    hosts.write_text("198.18.0.12 preprocess\n")
    assert await resolver.expand("preprocess:9000") == ["198.18.0.12:9000"]
    # Not in the file: the system resolver; one family, so localhost is one replica.
    assert await resolver.expand("localhost:8003") == ["127.0.0.1:8003"]
    assert await resolver.expand("127.0.0.9:1") == ["127.0.0.9:1"]
    assert await resolver.expand("[::1]:5") == ["[::1]:5"]


def test_an_unreadable_hosts_file_is_unknown_not_empty(tmp_path: Path) -> None:
    resolver = Resolver(tmp_path / "missing")
    assert asyncio.run(resolver.resolve("preprocess")) is None
    # An address needs no file.
    assert asyncio.run(resolver.resolve("198.18.0.1")) == ["198.18.0.1"]


def test_targets_split_and_join_ipv6() -> None:
    assert split_target("[2001:db8::5]:80") == ("2001:db8::5", "80")
    assert join_target("2001:db8::5", "80") == "[2001:db8::5]:80"
    assert split_target("pre.ns.svc:8005") == ("pre.ns.svc", "8005")


class Fleet:
    """A router on a hosts file the test rewrites; every replica serves 'm'."""

    def __init__(self, tmp_path: Path) -> None:
        self.hosts = tmp_path / "hosts"
        self.hosts.write_text("198.18.0.10 pre\n198.18.0.11 pre\n")
        self.router = StageRouter(
            [StageAddress.parse("pre=pre:9000")],
            channels_per_endpoint=1,
            max_message_bytes=1 << 22,
            tracer=trace.NoOpTracer(),
            refresh_interval_s=60,
            discovery=Discovery(Resolver(self.hosts), resolve_interval_s=60, retire_grace_s=0.2),
        )

    def targets(self) -> list[str]:
        return sorted(e.address.target for e in self.router.endpoints)

    def by_target(self, target: str) -> Endpoint:
        return next(e for e in self.router.endpoints if e.address.target == target)


@contextlib.asynccontextmanager
async def started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    fleet = Fleet(tmp_path)

    async def index(endpoint: Endpoint) -> None:
        # What RepositoryIndex would say of a live replica (no socket here).
        endpoint.models, endpoint.ready = {"m"}, True

    monkeypatch.setattr(fleet.router, "_refresh_one", index)
    await fleet.router.resolve(initial=True)
    for endpoint in fleet.router.endpoints:
        await index(endpoint)
    try:
        yield fleet
    finally:
        await fleet.router.stop()


Scenario = Callable[[Fleet], Awaitable[None]]


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scenario: Scenario) -> None:
    async def main() -> None:
        async with started(tmp_path, monkeypatch) as fleet:
            await scenario(fleet)

    asyncio.run(main())


def test_replicas_follow_the_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run(tmp_path, monkeypatch, replicas_follow_the_name)


async def replicas_follow_the_name(fleet: Fleet) -> None:
    assert fleet.targets() == ["198.18.0.10:9000", "198.18.0.11:9000"]
    changes: list[int] = []

    async def changed() -> None:
        changes.append(len(fleet.router.endpoints))

    fleet.router.on_change = changed
    fleet.hosts.write_text("198.18.0.11 pre\n198.18.0.12 pre\n")
    await fleet.router.resolve()
    assert fleet.targets() == ["198.18.0.11:9000", "198.18.0.12:9000"]
    assert fleet.by_target("198.18.0.12:9000").ready, "a new replica is asked what it hosts"
    assert changes == [2]
    # A lookup that cannot tell (no file to read) keeps the replicas.
    fleet.hosts.unlink()
    await fleet.router.resolve()
    assert fleet.targets() == ["198.18.0.11:9000", "198.18.0.12:9000"]


def test_a_call_on_a_retired_replica_is_retried_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tmp_path, monkeypatch, retired_call_is_retried)


async def retired_call_is_retried(fleet: Fleet) -> None:
    first = fleet.by_target("198.18.0.10:9000")
    answered_by: list[str] = []

    async def invoke(stub: object) -> str:
        if stub in first.stubs:
            await asyncio.Event().wait()  # a replica that died: no answer, ever
        answered_by.append("other")
        return "ok"

    # Idle replicas take turns; the second call goes to the other one.
    calls = [asyncio.create_task(fleet.router.call("m", invoke)) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert first.in_flight == 1 and answered_by == ["other"]
    fleet.hosts.write_text("198.18.0.11 pre\n")
    await fleet.router.resolve()
    assert await asyncio.wait_for(asyncio.gather(*calls), 5) == ["ok", "ok"]
    assert answered_by == ["other", "other"]
    assert first.abandoned and first.in_flight == 0


def test_the_callers_own_cancel_still_cancels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tmp_path, monkeypatch, callers_cancel_still_cancels)


async def callers_cancel_still_cancels(fleet: Fleet) -> None:
    async def hang(stub: object) -> str:
        await asyncio.Event().wait()
        return "never"

    call = asyncio.create_task(fleet.router.call("m", hang))
    await asyncio.sleep(0.05)
    fleet.hosts.write_text("198.18.0.11 pre\n")
    await fleet.router.resolve()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
