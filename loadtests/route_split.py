"""How a route splits traffic, measured through the orchestrator's core.

    python -m loadtests.route_split [--requests 10000] [--keys 1000]

Starts a python-backend stage and the orchestrator in this process
(tests/in_process.py) on a model ``m`` at versions 1 and 2, then prints:

- the share of ``--requests`` requests a 90/10 route sends to the candidate
  (expected 10% +- 1%);
- for ``--keys`` sticky keys: whether each key kept its target over two
  rounds, and how many keys moved, and where, when the split goes 10 -> 20%
  (consistent hashing: only keys into the candidate, about 10% of them).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from inference import grpc_service_pb2 as pb
from loadtests.common import format_table, load_average
from services.orchestrator.routes import Route, Target
from shared.tensors import encode_inputs
from tests.in_process import Mesh, running
from tests.integration.test_routes import write_repository

IN_FLIGHT = 32


async def _targets(mesh: Mesh, keys: list[str]) -> list[str]:
    """The target that served each request ("" key: weighted random)."""
    gate = asyncio.Semaphore(IN_FLIGHT)
    x = np.ones((1, 4), dtype=np.float32)

    async def one(key: str) -> str:
        request = pb.ModelInferRequest(model_name="split")
        encode_inputs(request, {"X": x})
        if key:
            request.parameters["route_key"].string_param = key
        async with gate:
            answer = await mesh.core.infer(request, 60)
        return answer.parameters["route_target"].string_param

    return await asyncio.gather(*(one(key) for key in keys))


async def measure(requests: int, keys: int) -> None:
    """Run both measurements and print them."""
    with tempfile.TemporaryDirectory() as folder:
        async with running(write_repository(Path(folder))) as mesh:
            table = mesh.core.routes
            table.put(Route("split", (Target("m", "1", 90), Target("m", "2", 10))))
            started = time.monotonic()
            served = Counter(await _targets(mesh, [""] * requests))
            seconds = time.monotonic() - started
            share = served["m:2"] / requests
            print(
                format_table(
                    ["requests", "on m:1", "on m:2", "candidate share", "within 10% +- 1%", "s"],
                    [
                        [
                            requests,
                            served["m:1"],
                            served["m:2"],
                            f"{share:.2%}",
                            abs(share - 0.10) <= 0.01,
                            f"{seconds:.1f}",
                        ]
                    ],
                )
            )
            names = [f"user-{i}" for i in range(keys)]
            first = await _targets(mesh, names)
            again = await _targets(mesh, names)
            table.set_weights("split", {"m:1": 80, "m:2": 20})
            wider = await _targets(mesh, names)
    kept = sum(a == b for a, b in zip(first, again, strict=True))
    moved = [(a, b) for a, b in zip(first, wider, strict=True) if a != b]
    print(
        format_table(
            [
                "keys",
                "kept target",
                "m:2 at 10%",
                "m:2 at 20%",
                "moved",
                "moved into m:2",
                "moved out of m:2",
            ],
            [
                [
                    keys,
                    kept,
                    first.count("m:2"),
                    wider.count("m:2"),
                    len(moved),
                    sum(b == "m:2" for _, b in moved),
                    sum(a == "m:2" for a, _ in moved),
                ]
            ],
        )
    )
    print(f"load average: {load_average()}")


def main() -> None:
    """Parse the flags and measure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests through 90/10")
    parser.add_argument("--keys", type=int, default=1000, help="sticky keys")
    args = parser.parse_args()
    asyncio.run(measure(args.requests, args.keys))


if __name__ == "__main__":
    main()
