"""A storm of abandoned calls, and whether the mesh is whole afterwards.

    python loadtests/cancel_storm.py [--repository ~/.cache/meshserve/repository]
        [--layout separate|colocated|both] [--callers 64] [--storm-s 20]
        [--seed 46] [--seconds 4] [--llm]

Callers who give up are the common case under load: a deadline that passes
while the request waits in a queue or runs in a step, a client that cancels,
an HTTP client that closes its connection. Each leaves work behind in the
mesh: a queued request to drop, a batch to finish for the others, a forwarded
step whose answer nobody waits for. This run checks that none of it sticks.

On a mesh of the two ensembles and their steps (and the LLM's, with
``--llm``), stages each in a process or all in one (``--layout``):

1. **before**: each ensemble at 16 in flight (req/s) and at 1 in flight (p50),
   and with ``--llm`` a short chat completion's p50;
2. **the storm**: ``--callers`` callers for ``--storm-s``; each call picks at
   random (seeded) a model (both ensembles, and ``minilm`` and
   ``mobilenet_v2_onnx`` alone), a door (the orchestrator's gRPC port or
   Envoy's; ``text_embedding`` also as KServe v2 REST JSON through Envoy) and
   an end: a deadline of 1-50 ms, a cancel 0-30 ms after the start, or none (a
   30-s deadline: such calls must succeed). With ``--llm`` the mesh serves the
   LLM too, and a tenth of the calls are streamed LLM calls (an OpenAI chat
   completion or KServe ``generate_stream`` through Envoy, Triton's
   ``ModelStreamInfer`` through Envoy or to the orchestrator), read to their
   end, closed after 0-4 chunks, or given 0.05-1 s (those ask for 1,500
   tokens: one the engine failed to abort would still be running at the check
   after; ``llm_calls.py``);
3. **after**: Envoy closed no connection for "premature resets" (its Rapid
   Reset guard, docs/envoy.md); every process's
   ``nv_inference_pending_request_count`` is back to 0 within 10 s; no process
   was replaced; the LLM engine holds no request (``--llm``); and the same load
   as in 1 runs at >= 0.7x the rate and <= 2x the p50 (a lane or an instance
   held by an abandoned call would show here; the LLM: a short chat's p50);
   RSS of every process before and after.

Answers expected in the storm: calls with no early end only OK; the others OK,
DEADLINE_EXCEEDED or CANCELLED (REST: 200 or the client's own timeout). Any
other code, or any check in 3 failing, makes the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import numpy as np
from bench_pipeline import SENTENCE, pipeline_mesh
from common import (
    DEFAULT_REPOSITORY,
    LoadSettings,
    MeshInfo,
    format_table,
    install_sigterm_exit,
    missing_models,
    rss_mib,
)
from common import closed_loop as run_closed_loop
from fault_runs import embedding_request, image_request
from llm_calls import ENGINE_GAUGES, LLM_MODELS, LLM_SHARE, LlmCaller, chat_p50

from deploy.local.procfs import start_ticks
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import encode_inputs
from tests.harness import scrape_metrics

MODELS = (
    "text_embedding",
    "minilm_tokenizer",
    "minilm",
    "mean_pool",
    "image_classifier",
    "image_preprocess",
    "mobilenet_v2_onnx",
    "imagenet_top5",
)
ENSEMBLES = ("text_embedding", "image_classifier")
WHOLE_TIMEOUT_S = 30.0
"""The deadline of calls that should run to their end."""
PENDING_WITHIN_S = 10.0
"""How soon after the storm every queue must be empty."""
RATE_AT_LEAST = 0.7
P50_AT_MOST = 2.0
EARLY_ENDS = {"OK", "DEADLINE_EXCEEDED", "CANCELLED"}


@dataclass(frozen=True)
class MeshModels:
    """The models the mesh serves, and whether their stages share one process."""

    models: tuple[str, ...]
    colocated: bool


@dataclass
class Tally:
    """Answers by (end, door) and code; the first message of each unexpected code."""

    codes: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    unexpected: dict[str, str] = field(default_factory=dict)

    def add(self, end: str, door: str, code: str, message: str = "") -> None:
        self.codes[(end, door, code)] += 1
        allowed = {"OK"} if end == "whole" else EARLY_ENDS
        if code not in allowed:
            self.unexpected.setdefault(f"{end}/{door}/{code}", message[:300])

    def report(self, took: float) -> bool:
        """Print the answers by end, door and code; True when none was unexpected."""
        print(f"the storm: {sum(self.codes.values())} calls in {took:.1f} s")
        rows = [[end, door, code, n] for (end, door, code), n in sorted(self.codes.items())]
        print(format_table(["end", "door", "code", "calls"], rows))
        for key, message in self.unexpected.items():
            print(f"  UNEXPECTED {key}: {message}")
        return not self.unexpected


def plain_requests() -> dict[str, pb.ModelInferRequest]:
    """One small request per model the storm calls."""
    rng = np.random.default_rng(0)
    minilm = pb.ModelInferRequest(model_name="minilm")
    ids = rng.integers(1000, 2000, size=(1, 12), dtype=np.int64)
    encode_inputs(
        minilm,
        {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids),
        },
    )
    mobilenet = pb.ModelInferRequest(model_name="mobilenet_v2_onnx")
    encode_inputs(mobilenet, {"input": rng.random((1, 3, 224, 224), dtype=np.float32)})
    return {
        "text_embedding": embedding_request(),
        "image_classifier": image_request(),
        "minilm": minilm,
        "mobilenet_v2_onnx": mobilenet,
    }


REST_BODY = json.dumps(
    {
        "inputs": [
            {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [SENTENCE.decode()]}
        ]
    }
).encode()


class Storm:
    """Callers that each, call after call, pick a model, a door and an end."""

    def __init__(self, info: MeshInfo, seed: int, llm: bool = False) -> None:
        self._rng = random.Random(seed)
        self._requests = plain_requests()
        self._channels = {
            door: [grpc.aio.insecure_channel(address) for _ in range(4)]
            for door, address in (("orchestrator", info.orchestrator), ("envoy", info.edge))
        }
        self._rest_url = f"http://{info.edge}/v2/models/text_embedding/infer"
        self.tally = Tally()
        self._llm = LlmCaller(info.edge, self._channels, self._rng, self.tally.add) if llm else None

    async def run(self, callers: int, seconds: float) -> None:
        """``callers`` callers back to back until ``seconds`` have passed."""
        end = time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._caller(session, end) for _ in range(callers)))

    async def close(self) -> None:
        for channels in self._channels.values():
            for channel in channels:
                await channel.close()

    async def _caller(self, session: aiohttp.ClientSession, end: float) -> None:
        while time.monotonic() < end:
            model = self._rng.choice(list(self._requests))
            ending = self._rng.choice(("whole", "deadline", "cancel"))
            if self._llm is not None and self._rng.random() < LLM_SHARE:
                await self._llm.call(session, ending)
                continue
            if model == "text_embedding" and self._rng.random() < 0.25:
                await self._rest(session, ending)
                continue
            door = self._rng.choice(list(self._channels))
            channel = self._rng.choice(self._channels[door])
            await self._grpc(channel, door, self._requests[model], ending)

    async def _grpc(
        self, channel: grpc.aio.Channel, door: str, request: pb.ModelInferRequest, ending: str
    ) -> None:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        timeout = self._rng.uniform(0.001, 0.050) if ending == "deadline" else WHOLE_TIMEOUT_S
        call = stub.ModelInfer(request, timeout=timeout)
        if ending == "cancel":
            asyncio.get_running_loop().call_later(self._rng.uniform(0, 0.030), call.cancel)
        try:
            await call
            self.tally.add(ending, door, "OK")
        except asyncio.CancelledError:
            if ending != "cancel":
                raise
            self.tally.add(ending, door, "CANCELLED")
        except grpc.aio.AioRpcError as exc:
            self.tally.add(ending, door, exc.code().name, exc.details() or "")

    async def _rest(self, session: aiohttp.ClientSession, ending: str) -> None:
        seconds = WHOLE_TIMEOUT_S if ending == "whole" else self._rng.uniform(0.001, 0.050)
        timeout = aiohttp.ClientTimeout(total=seconds)
        headers = {"content-type": "application/json"}
        try:
            async with session.post(
                self._rest_url, data=REST_BODY, headers=headers, timeout=timeout
            ) as reply:
                text = await reply.text()
                code = "OK" if reply.status == 200 else f"HTTP {reply.status}"
                self.tally.add(ending, "rest", code, text)
        except TimeoutError:
            self.tally.add(ending, "rest", "DEADLINE_EXCEEDED")
        except aiohttp.ClientError as exc:
            self.tally.add(ending, "rest", type(exc).__name__, str(exc))


# -- the checks after ------------------------------------------------------------


PENDING_GAUGES = ("nv_inference_pending_request_count", *ENGINE_GAUGES)
"""What every process must bring back to 0 once the storm is over."""


def edge_closes(info: MeshInfo) -> float:
    """Connections Envoy's edge closed for too many premature resets (Rapid Reset)."""
    return sum(
        value
        for (name, labels), value in scrape_metrics(info.metrics_ports["envoy"]).items()
        if name == "envoy_http_downstream_rq_too_many_premature_resets"
        and ("envoy_http_conn_manager_prefix", "edge") in labels
    )


def pending_counts(info: MeshInfo) -> dict[str, float]:
    """Every process's pending requests, by process, gauge and model (non-zero only)."""
    found: dict[str, float] = {}
    for process, port in info.metrics_ports.items():
        for (name, labels), value in scrape_metrics(port).items():
            if name in PENDING_GAUGES and value:
                found[f"{process} {name} {dict(sorted(labels))}"] = value
    return found


async def drained(info: MeshInfo) -> dict[str, float]:
    """Pending counts once all are 0, or what is left after PENDING_WITHIN_S."""
    deadline = time.monotonic() + PENDING_WITHIN_S
    while True:
        left = await asyncio.to_thread(pending_counts, info)
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.5)


@dataclass(frozen=True)
class Health:
    """A model's rate at 16 in flight (not for the LLM) and p50 at 1 in flight."""

    rate: float | None
    p50_ms: float


async def health(info: MeshInfo, seconds: float, llm: bool) -> dict[str, Health]:
    """Each ensemble's closed-loop rate (16 in flight) and p50 (1 in flight); with
    ``llm``, the p50 of a short chat completion through Envoy too."""
    channel = grpc.aio.insecure_channel(info.orchestrator)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    settings = LoadSettings(seconds=seconds, warmup_s=1.0, settle_s=0.0)
    requests = plain_requests()
    found = {}
    try:
        for model in ENSEMBLES:
            request = requests[model]

            async def call(request: pb.ModelInferRequest = request) -> None:
                await stub.ModelInfer(request, timeout=WHOLE_TIMEOUT_S)

            busy = await run_closed_loop(model, [call], 16, {}, settings)
            alone = await run_closed_loop(model, [call], 1, {}, settings)
            if busy.errors or alone.errors:
                raise RuntimeError(f"{model}: errors under the health load")
            found[model] = Health(busy.rate, float(np.percentile(alone.latencies_ms, 50)))
    finally:
        await channel.close()
    if llm:
        found["llm"] = Health(None, await chat_p50(info.edge))
    return found


# -- one mesh --------------------------------------------------------------------


@dataclass(frozen=True)
class Afterwards:
    """What the storm left: queues not emptied, processes replaced, health and RSS
    before and after."""

    left: Mapping[str, float]
    replaced: Sequence[str]
    before: Mapping[str, Health]
    after: Mapping[str, Health]
    rss: tuple[Mapping[str, float], Mapping[str, float]]

    def report(self) -> bool:
        """Print the checks; True when all held."""
        print(f"pending after the storm: {dict(self.left) or 'none'}")
        print(f"processes replaced: {list(self.replaced) or 'none'}")
        fine = not self.left and not self.replaced
        rows = []
        for model, b in self.before.items():
            a = self.after[model]
            ok = a.p50_ms <= P50_AT_MOST * b.p50_ms
            ratio = None
            if a.rate is not None and b.rate is not None:
                ratio = a.rate / b.rate
                ok = ok and ratio >= RATE_AT_LEAST
            fine = fine and ok
            rates = [float("nan") if r is None else r for r in (b.rate, a.rate, ratio)]
            rows.append([model, *rates, b.p50_ms, a.p50_ms, ok])
        headers = ["model", "req/s before", "after", "ratio", "p50 ms before", "after", "ok"]
        print(format_table(headers, [[*row[:-1], "yes" if row[-1] else "NO"] for row in rows]))
        start, end = self.rss
        print(
            format_table(
                ["process", "RSS MiB before", "after"], [[n, start[n], end[n]] for n in start]
            )
        )
        return fine


async def storm_mesh(info: MeshInfo, settings: argparse.Namespace) -> bool:
    """Before, the storm, after; prints the tables; True when every check held."""
    ticks = {name: start_ticks(pid) for name, pid in info.pids.items()}
    rss_before = {name: rss_mib(pid) for name, pid in info.pids.items()}
    before = await health(info, settings.seconds, settings.llm)
    storm = Storm(info, settings.seed, settings.llm)
    started = time.monotonic()
    try:
        await storm.run(settings.callers, settings.storm_s)
    finally:
        await storm.close()
    fine = storm.tally.report(time.monotonic() - started)
    closes = edge_closes(info)
    print(f"connections Envoy closed for premature resets: {closes:g}")
    fine = fine and closes == 0
    left = await drained(info)
    replaced = [name for name, pid in info.pids.items() if start_ticks(pid) != ticks[name]]
    after = await health(info, settings.seconds, settings.llm)
    rss_after = {name: rss_mib(pid) for name, pid in info.pids.items()}
    return Afterwards(left, replaced, before, after, (rss_before, rss_after)).report() and fine


def main(argv: Sequence[str] | None = None) -> int:
    install_sigterm_exit()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--layout", choices=("separate", "colocated", "both"), default="both")
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--storm-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=46)
    parser.add_argument("--seconds", type=float, default=4.0, help="each health window")
    parser.add_argument(
        "--llm", action="store_true", help="the LLM too: a tenth of the calls streamed LLM calls"
    )
    settings = parser.parse_args(argv)
    models = MODELS + LLM_MODELS if settings.llm else MODELS
    missing = missing_models(settings.repository, models)
    if missing:
        print(f"{settings.repository} lacks {missing}: run `python -m models.prepare`")
        return 2
    layouts = {"separate": (False,), "colocated": (True,), "both": (False, True)}[settings.layout]
    fine = True
    for one_process in layouts:
        print(f"\n== stages {'in one process' if one_process else 'each in its own process'}")
        with pipeline_mesh(settings.repository, MeshModels(models, one_process), False) as info:
            fine = asyncio.run(storm_mesh(info, settings)) and fine
    print("\nall checks held" if fine else "\nSOME CHECKS FAILED")
    return 0 if fine else 1


if __name__ == "__main__":
    sys.exit(main())
