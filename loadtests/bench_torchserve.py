"""One .mar two ways: real TorchServe and the mesh, 16 requests in flight.

    python loadtests/bench_torchserve.py [--seconds 10] [--rounds 2] [--in-flight 16]
                                         [--batch-size 8] [--max-batch-delay 5]

The archive is built with the real ``torch-model-archiver``: a small scripted
image model with a custom handler (tests/data/torchserve), batchSize 8, one
worker. Both servers get the same photo (``curl -T kitten.jpg``-style raw
POSTs to ``/predictions/<model>``, one keep-alive connection per worker):

- ``torchserve``  TorchServe 0.12 itself (its Java front end and Python
                  worker; needs a JRE: Debian ``openjdk-17-jre-headless``;
                  skipped with a message where ``java`` is missing);
- ``mesh``        the default local mesh (supervisor, ``--ports auto``) with
                  the archive imported into an otherwise empty repository,
                  through Envoy -> orchestrator (its HTTP front door) -> inference.

Server CPU per request counts every process of each server: TorchServe's
launcher, Java and its workers; every mesh process (Envoy, orchestrator,
stages, supervisor, job queue, trace store; the HTTP adapter too with
``http_front_door: process``), and apart ("on path") the mesh's processes a
prediction passes through (Envoy, the adapter if it is a process,
orchestrator, inference). Rounds are interleaved and the fastest run of each
is kept (a neighbour on a shared box only slows a run down).
Ratios are mesh / torchserve.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
from pathlib import Path

import aiohttp
from common import (
    ROOT,
    Call,
    LoadResult,
    LoadSettings,
    best_runs,
    closed_loop,
    format_table,
    install_sigterm_exit,
    running_mesh,
)
from peers.torchserve import java_missing, torchserve
from PIL import Image

from models.sources import sample_image
from services.inference.torchserve_archive import import_archive

MODEL = "kitten_b8"


def _kitten_mar(work: Path, store: Path, config: str) -> Path:
    """The test suite's archive builder (tests/ sits beside the packages, not in them)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.data.torchserve.archives import kitten_mar

    return kitten_mar(work, store, name=MODEL, config=config)


class PhotoTarget:
    """Raw photo POSTs to /predictions/<model> over a keep-alive pool."""

    def __init__(self, url: str, body: bytes, connections: int) -> None:
        connector = aiohttp.TCPConnector(limit=connections)
        self._session = aiohttp.ClientSession(connector=connector)
        self._url, self._body = url, body

    async def post(self) -> None:
        """One prediction; raise unless 200."""
        headers = {"content-type": "image/jpeg"}
        async with self._session.post(self._url, data=self._body, headers=headers) as reply:
            text = await reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {text[:200]!r}")

    async def close(self) -> None:
        """Close the pool."""
        await self._session.close()


async def measure(
    label: str, url: str, photo: bytes, pids: dict[str, int], in_flight: int, load: LoadSettings
) -> LoadResult:
    """A closed-loop window against ``url``."""
    target = PhotoTarget(url, photo, in_flight)
    try:
        await target.post()  # the answer works before anything is timed
        calls: list[Call] = [target.post]
        return await closed_loop(label, calls, in_flight, pids, load)
    finally:
        await target.close()


def _report(results: list[LoadResult]) -> None:
    rows, by_label = [], {r.label: r for r in results}
    for result in results:
        server = 1000.0 * _cpu(result)
        path = 1000.0 * _cpu(result, _PATH) if result.label == "mesh" else server
        rows.append(
            [
                result.label,
                f"{result.rate:.1f}",
                f"{result.percentile(50):.1f}",
                f"{result.percentile(99):.1f}",
                f"{server:.2f}",
                f"{path:.2f}",
                result.errors,
                f"{result.usage.others:.2f}",
            ]
        )
    headers = ["server", "req/s", "p50 ms", "p99 ms", "server CPU ms/req", "on path", "errors"]
    headers.append("others")
    print(format_table(headers, rows))
    mesh, peer = by_label.get("mesh"), by_label.get("torchserve")
    if mesh and peer:
        print(f"throughput mesh/torchserve: {mesh.rate / peer.rate:.2f}x")
        print(f"server CPU per request mesh/torchserve: {_cpu(mesh) / _cpu(peer):.2f}x")
        on_path = _cpu(mesh, _PATH) / _cpu(peer)
        print(f"  counting only the mesh's processes on the request path: {on_path:.2f}x")


# The mesh's processes a prediction passes through (the rest of the default mesh idles).
_PATH = ("envoy", "http_adapter", "orchestrator", "inference-0")


def _cpu(result: LoadResult, labels: tuple[str, ...] = ()) -> float:
    """CPU seconds per request of ``labels`` (all the server's processes when empty)."""
    used = result.usage.processes
    return sum(v for k, v in used.items() if not labels or k in labels) / result.per()


async def run(args: argparse.Namespace) -> None:
    """Build the archive, then measure both servers in interleaved rounds."""
    load = LoadSettings(args.seconds, args.warmup, settle_s=5.0)
    with tempfile.TemporaryDirectory(prefix="meshserve-bench-ts-") as tmp:
        folder, store = Path(tmp), Path(tmp) / "store"
        config = f"batchSize: {args.batch_size}\nmaxBatchDelay: {args.max_batch_delay}\n"
        config += "minWorkers: 1\nmaxWorkers: 1\n"
        _kitten_mar(folder / "build", store, config)
        buffer = io.BytesIO()
        Image.open(sample_image("chelsea.png")).convert("RGB").save(buffer, "JPEG")
        photo = buffer.getvalue()
        repository = folder / "models"
        import_archive(store / f"{MODEL}.mar", repository)
        results: list[LoadResult] = []
        no_java = java_missing()
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}")
            if no_java:
                print(f"  torchserve: skipped ({no_java})")
            else:
                with torchserve(store, folder, MODEL) as (base, pids):
                    url = f"{base}/predictions/{MODEL}"
                    results.append(
                        await measure("torchserve", url, photo, pids, args.in_flight, load)
                    )
            with running_mesh(repository) as mesh:
                pids = {k: v for k, v in mesh.pids.items() if k != "envoy_wrapper"}
                pids["supervisor"] = mesh.supervisor_pid
                url = f"http://{mesh.edge}/predictions/{MODEL}"
                results.append(await measure("mesh", url, photo, pids, args.in_flight, load))
        _report(best_runs(results))


def main() -> None:
    """Parse the flags and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batch-delay", type=int, default=5)
    install_sigterm_exit()
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
