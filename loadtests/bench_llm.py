"""Chat streams side by side: the mesh vs vLLM's own OpenAI server vs transformers.

    python loadtests/bench_llm.py [--streams 16] [--max-tokens 64] [--rounds 3]
                                  [--probes 30] [--probe-tokens 16]
                                  [--skip "vllm server,transformers"] [--quick]
                                  [--n 4] [--logprobs 5]

One workload (``--streams`` concurrent chat requests, each asking SmolLM2-135M-
Instruct for a short story, greedy, ``--max-tokens`` tokens at most) sent to:

- ``mesh openai``   POST /v1/chat/completions with ``stream: true`` through Envoy:
                    Envoy -> HTTP adapter -> orchestrator -> tokenizer -> vLLM
                    (inference service) -> detokenizer (postprocess);
- ``mesh grpc``     meshserve.v1 Chat (server streaming) through Envoy's gRPC port;
- ``vllm server``   ``python -m vllm.entrypoints.openai.api_server`` on the same
                    model folder with the same engine settings (read from the
                    model's config.pbtxt through the backend's own EngineSettings),
                    the same /v1/chat/completions request;
- ``transformers``  ``model.generate`` on the whole batch at once (static
                    batching, left padding) in this process: the naive baseline.

The mesh (``deploy.local.supervisor --ports auto``) and vLLM's server both start
first and stay up (idle); then each round runs every target once, one after the
other, each after a pause (``QUIET_S``) that lets the other engine go idle, so
the engines never compete for the cores. A round is one batch of concurrent
streams: tokens/s is the completion tokens of every stream over the time from
the first request to the last stream's end; TTFT is
the time from sending a request to its first non-empty text; CPU is the whole
machine's busy time over the round per token (server, client and all). Each
target's fastest round (by tokens/s) is reported; TTFT percentiles pool every
measured round. Under 16 streams TTFT is mostly the engine's prefill queue, so
``--probes`` lone requests per target (``--probe-tokens`` tokens each, timed to
their first) measure the time the path itself adds: the difference of p50s, and
the median of differences between probes sent back to back with the same
prompt (the engine's time for a prompt moves by tens of ms from probe to probe;
pairing takes the prompt's share out); each round of probes starts at the next
target, so no target always follows the same one. A probe asks for 16 tokens
by default, as a chat goes on generating while its first token travels out (a
one-token probe's first token is also its last, and every process on the way
ends its request meanwhile instead); ``--probe-tokens 1`` times that. Around
each probe the bench also reads the engine's own clocks from its /metrics (the
mesh's inference service relays its engine's ``vllm:*`` series, vLLM's server
shows its own), so the time outside the engine is the serving path alone, free
of the engine's ups and downs: HTTP, the mesh's hops, the detokenizer. Two
clocks, two columns:

- "outside engine": TTFT minus ``vllm:time_to_first_token_seconds``. It leans
  against the mesh: vLLM's server starts that clock before its chat template
  and tokenizer, the mesh's inference stage after the tokenizer stage, so
  vLLM's own tokenizing counts as engine time and the mesh's does not;
- "outside core": TTFT minus the engine core's own time to the first token,
  ``vllm:request_queue_time_seconds`` + ``vllm:request_prefill_time_seconds``
  (queued to scheduled to first token, both read in the engine core process).
  The same clock on both sides: each side's tokenizing, its hand-over to the
  engine core and the way back out all count as outside.
Token counts come from each server's own usage numbers (transformers: the tokens before end
of text), so a target that stops early is not credited with tokens it did not
make. Everything started is stopped by PID (process group) on
exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
from common import (
    DEFAULT_REPOSITORY,
    MeshInfo,
    format_table,
    install_sigterm_exit,
    load_average,
    machine_cpu_seconds,
    missing_models,
    running_mesh,
)

from meshserve.v1 import meshserve_pb2 as api
from meshserve.v1 import meshserve_pb2_grpc as api_grpc
from shared.backend import ModelSpec, config_parameters
from shared.ports import free_port
from shared.repository import parse_config

ENGINE_MODEL = "smollm2"
"""The vLLM model of the default repository (safetensors folder + config.pbtxt)."""
MESH_MODEL = "llm"
"""The mesh's streaming ensemble: tokenizer -> smollm2 -> detokenizer."""
TARGETS = ("mesh openai", "mesh grpc", "vllm server", "transformers")
BASELINE = "vllm server"
QUIET_S = 1.5
"""Pause before each measured run. After its last step a vLLM engine keeps polling
its shared-memory queues for 1 s (busy-waiting), and both engines' CPU workers
are bound to the same core: a run that starts while the other engine still
polls loses that core to it (seen: a lone 1-token request at 1.3 s instead of
0.39 s). Every run starts with both engines idle."""

SUBJECTS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to bake bread",
    "a fox who wants to fly",
    "two friends lost in a snowy forest",
    "a dragon afraid of the dark",
    "a girl who can talk to trees",
    "a sailor and a whale",
    "an old clock that stops time",
    "a cat that becomes mayor of a town",
    "a boy who builds a rocket",
    "a library that is alive",
    "a knight who hates fighting",
    "a small seed that grows into a giant tree",
    "a detective mouse",
    "a painter who paints the wind",
    "a city under the sea",
]


def prompts(count: int) -> list[str]:
    """``count`` distinct-ish story requests (the subjects repeat beyond 16)."""
    return [
        f"Write a short story about {SUBJECTS[i % len(SUBJECTS)]}." + " Please." * (i // 16)
        for i in range(count)
    ]


# -- one stream, one round -----------------------------------------------------


@dataclass(frozen=True)
class StreamResult:
    """One chat request, timed from its send."""

    ttft_s: float
    """Until the first non-empty text."""
    end_s: float
    """Until the stream ended."""
    tokens: int
    """Completion tokens, as the server counted them."""
    prompt_tokens: int
    """The rendered chat's tokens (equal across targets when the templates agree)."""
    text: str


@dataclass(frozen=True)
class RoundResult:
    """One batch of concurrent streams on one target."""

    label: str
    streams: list[StreamResult]
    wall_s: float
    cpu_s: float = 0.0
    """Busy CPU seconds of the whole machine over the round."""
    engine_ttft_s: float | None = None
    """A lone probe's TTFT inside the engine, from its /metrics (None: not read)."""
    engine_core_s: float | None = None
    """A lone probe's time from the engine core's queue to its first token (None: not read)."""

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


class StreamClock:
    """Times one stream the same way for every target: TTFT at the first non-empty text."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first = 0.0
        self.parts: list[str] = []

    def text(self, piece: str) -> None:
        if piece and not self.first:
            self.first = time.perf_counter() - self.started
        self.parts.append(piece)

    def result(self, tokens: int, prompt_tokens: int) -> StreamResult:
        elapsed = time.perf_counter() - self.started
        # A stream whose only token is not text (yet) counts to its end.
        first = self.first or elapsed
        return StreamResult(first, elapsed, tokens, prompt_tokens, "".join(self.parts))


StreamCall = Callable[[str, int], Awaitable[StreamResult]]
"""Send one chat prompt with a max_tokens; returns its timings."""


ENGINE_TTFT = "vllm:time_to_first_token_seconds"
ENGINE_QUEUE = "vllm:request_queue_time_seconds"
ENGINE_PREFILL = "vllm:request_prefill_time_seconds"


@dataclass(frozen=True)
class EngineClocks:
    """An engine's own histograms, summed: seconds (and requests) so far."""

    ttft_s: float = 0.0
    """From the request's arrival at the engine's front end to its first token."""
    ttft_count: float = 0.0
    core_s: float = 0.0
    """Queued in the engine core to its first token (queue + prefill; finished requests)."""
    core_count: float = 0.0

    def __sub__(self, other: EngineClocks) -> EngineClocks:
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return EngineClocks(*(mine - theirs for mine, theirs in pairs))


class EngineTtft:
    """An engine's own TTFT histograms, summed over the /metrics pages that show them."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = list(urls)

    def totals(self) -> EngineClocks:
        """Seconds and requests so far."""
        sums = dict.fromkeys(
            (
                f"{name}_{part}"
                for name in (ENGINE_TTFT, ENGINE_QUEUE, ENGINE_PREFILL)
                for part in ("sum", "count")
            ),
            0.0,
        )
        for url in self._urls:
            with urllib.request.urlopen(url, timeout=10) as reply:
                for line in reply.read().decode().splitlines():
                    # The value follows the last space: a label value may hold spaces.
                    series, _, value = line.rpartition(" ")
                    name = series.partition("{")[0]
                    if name in sums and not line.startswith("#"):
                        sums[name] += float(value)
        return EngineClocks(
            ttft_s=sums[f"{ENGINE_TTFT}_sum"],
            ttft_count=sums[f"{ENGINE_TTFT}_count"],
            core_s=sums[f"{ENGINE_QUEUE}_sum"] + sums[f"{ENGINE_PREFILL}_sum"],
            core_count=sums[f"{ENGINE_PREFILL}_count"],
        )


async def run_round(
    label: str, call: StreamCall, texts: Sequence[str], max_tokens: int
) -> RoundResult:
    """Every prompt at once; the round ends with its last stream."""
    started = time.perf_counter()
    streams = await asyncio.gather(*(call(text, max_tokens) for text in texts))
    return RoundResult(label, list(streams), time.perf_counter() - started)


class OpenAiChat:
    """Streamed /v1/chat/completions over one keep-alive connection per stream."""

    def __init__(
        self, base_url: str, model: str, streams: int, extra: dict[str, Any] | None = None
    ) -> None:
        self._extra = extra or {}
        """More body fields (n, logprobs), the same for every target."""
        connector = aiohttp.TCPConnector(limit=streams)
        timeout = aiohttp.ClientTimeout(total=600)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self._url = f"{base_url}/chat/completions"
        self._model = model

    async def __call__(self, prompt: str, max_tokens: int) -> StreamResult:
        body = {
            "model": self._model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self._extra,
        }
        clock, tokens, prompt_tokens = StreamClock(), 0, 0
        try:
            reply = await self._session.post(self._url, json=body)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            # A keep-alive connection its server closed just now (uvicorn, behind
            # vLLM's server, closes them after 5 s idle, the gap between a target's
            # lone probes): the request never left; send it again on a new one.
            clock = StreamClock()
            reply = await self._session.post(self._url, json=body)
        async with reply:
            if reply.status != 200:
                raise RuntimeError(f"{self._url}: HTTP {reply.status}: {await reply.text()}")
            async for raw in reply.content:  # one SSE line at a time
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    clock.text(choice["delta"].get("content") or "")
        return clock.result(tokens, prompt_tokens)

    async def close(self) -> None:
        await self._session.close()


class GrpcChat:
    """meshserve.v1 Chat, one HTTP/2 connection shared by every stream."""

    def __init__(self, address: str, n: int = 1, logprobs: int | None = None) -> None:
        self._options: dict[str, int] = (
            {"n": n} if logprobs is None else {"n": n, "logprobs": logprobs}
        )
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = api_grpc.MeshServiceStub(self._channel)

    async def __call__(self, prompt: str, max_tokens: int) -> StreamResult:
        request = api.ChatRequest(
            messages=[api.ChatMessage(role="user", content=prompt)],
            model=MESH_MODEL,
            sampling=api.SamplingParams(
                temperature=1.0 if self._options["n"] > 1 else 0.0,
                seed=7,
                max_tokens=max_tokens,
                **self._options,
            ),
        )
        clock, prompt_tokens = StreamClock(), 0
        tokens: dict[int, int] = {}  # per choice
        async for response in self._stub.Chat(request, timeout=600):
            delta = response.delta
            clock.text(delta.text)
            tokens[delta.index] = max(tokens.get(delta.index, 0), delta.completion_tokens)
            prompt_tokens = max(prompt_tokens, delta.prompt_tokens)
        return clock.result(sum(tokens.values()), prompt_tokens)

    async def close(self) -> None:
        await self._channel.close()


# -- transformers: the naive baseline -------------------------------------------


class StaticBatch:
    """``generate`` on the whole batch at once, greedy, with a step clock."""

    def __init__(self, folder: Path, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        # The engine's dtype, so that all sides compute alike ("auto": the checkpoint's, as vLLM).
        wanted = dtype if dtype == "auto" else getattr(torch, dtype)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=wanted)
        self._model = model.eval()

    def run(self, texts: Sequence[str], max_tokens: int) -> RoundResult:
        tokenizer = self._tokenizer
        chats = [[{"role": "user", "content": text}] for text in texts]
        rendered = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=False)
        steps: list[float] = []

        def clock(input_ids: Any, scores: Any, **_: Any) -> Any:
            # Called once per generated token (for the whole batch): never stops it.
            steps.append(time.perf_counter())
            return self._torch.zeros(input_ids.shape[0], dtype=self._torch.bool)

        started = time.perf_counter()
        batch = tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
        with self._torch.inference_mode():
            output = self._model.generate(
                **batch,
                max_new_tokens=max_tokens,
                do_sample=False,
                stopping_criteria=[clock],
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        wall = time.perf_counter() - started
        new = output[:, batch["input_ids"].shape[1] :]
        streams = []
        prompt_lengths = batch["attention_mask"].sum(dim=1).tolist()
        for row, prompt_tokens in zip(new.tolist(), prompt_lengths, strict=True):
            length = next((i for i, t in enumerate(row) if t == tokenizer.eos_token_id), len(row))
            text = str(tokenizer.decode(row[:length], skip_special_tokens=True))
            # Every row of a static batch gets its first token at the same step.
            streams.append(StreamResult(steps[0] - started, wall, length, prompt_tokens, text))
        return RoundResult("transformers", streams, wall)


# -- vLLM's own server ---------------------------------------------------------


def engine_spec(repository: Path) -> ModelSpec:
    """The engine model's spec, read from its config.pbtxt as the inference stage reads it."""
    model_dir = repository / ENGINE_MODEL
    config = parse_config(model_dir / "config.pbtxt")
    return ModelSpec(ENGINE_MODEL, 1, model_dir / "1", config, config_parameters(config))


def engine_dtype(repository: Path) -> str:
    """The dtype the model's config asks the engine for (float32 by default)."""
    from services.inference.vllm_settings import EngineSettings

    return EngineSettings.from_spec(engine_spec(repository)).dtype


def mesh_dtype_in_use(edge: str) -> str:
    """The dtype the mesh's engine resolved: ``dtype_in_use`` in the model's config."""
    url = f"http://{edge}/v2/models/{ENGINE_MODEL}/config"
    with urllib.request.urlopen(url, timeout=30) as answer:
        parameters = json.load(answer).get("parameters", {})
    return str(parameters.get("dtype_in_use", {}).get("string_value", "unknown"))


def engine_flags(repository: Path) -> tuple[list[str], dict[str, str]]:
    """vLLM server flags (and environment) equal to the mesh's engine settings."""
    from services.inference.vllm_settings import EngineSettings

    spec = engine_spec(repository)
    args = EngineSettings.from_spec(spec).engine_args(spec)
    flags = [
        "--model", str(args.model),
        "--served-model-name", ENGINE_MODEL,
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--dtype", str(args.dtype),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--enforce-eager" if args.enforce_eager else "--no-enforce-eager",
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if args.kv_cache_memory_bytes:
        flags += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    return flags, {}


@contextlib.contextmanager
def vllm_server(repository: Path, timeout_s: float = 600) -> Iterator[str]:
    """vLLM's OpenAI server on a free port; yields its /v1 URL; stops its process group."""
    flags, env = engine_flags(repository)
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--host", "127.0.0.1", "--port", str(port), *flags]
    # Its log, ZeroMQ sockets and rendezvous file go to a folder removed after it.
    with tempfile.TemporaryDirectory(prefix="vllm-server-") as private:
        log_path = Path(private) / "server.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, "VLLM_RPC_BASE_PATH": private, "TMPDIR": private},
                start_new_session=True,  # its own group: the engine process is stopped with it
            )
        try:
            deadline = time.monotonic() + timeout_s
            while not _healthy(f"http://127.0.0.1:{port}/health"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text()[-3000:]
                    raise RuntimeError(f"vLLM's server did not start; log tail:\n{tail}")
                time.sleep(1)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


# -- the run -------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    repository: Path
    streams: int
    max_tokens: int
    rounds: int
    probes: int
    probe_tokens: int
    """max_tokens of a lone probe: more than one, like a chat, keeps the engine
    stepping while the first token is on its way out."""
    skip: frozenset[str]
    n: int = 1
    """Choices per request (each stream's tokens count all of them)."""
    logprobs: int | None = None
    """Top logprobs per token asked for (None: none)."""

    def body(self) -> dict[str, Any]:
        """The OpenAI body fields for ``n`` and ``logprobs``."""
        # n > 1 samples (greedy copies are refused, as by vLLM), seeded for both servers alike.
        extra: dict[str, Any] = {"n": self.n, "temperature": 1.0, "seed": 7} if self.n > 1 else {}
        if self.logprobs is not None:
            extra |= {"logprobs": True, "top_logprobs": self.logprobs}
        return extra


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--streams", type=int, default=16, help="concurrent chat streams")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream at most")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per target")
    parser.add_argument(
        "--probes", type=int, default=30, help="lone requests per target (TTFT alone)"
    )
    parser.add_argument(
        "--probe-tokens", type=int, default=16, help="max_tokens of each lone request"
    )
    parser.add_argument(
        "--skip", default="", help=f"comma-separated targets to leave out, of: {', '.join(TARGETS)}"
    )
    parser.add_argument("--quick", action="store_true", help="4 streams x 16 tokens, 1 round")
    parser.add_argument("--n", type=int, default=1, help="choices per request (OpenAI's n)")
    parser.add_argument(
        "--logprobs", type=int, default=None, help="top logprobs per token (0..20; off if unset)"
    )
    args = parser.parse_args(argv)
    skip = frozenset(s.strip() for s in args.skip.split(",") if s.strip())
    unknown = skip - set(TARGETS)
    if unknown:
        parser.error(f"--skip: unknown target(s) {sorted(unknown)}; expected {list(TARGETS)}")
    if args.n > 1 or args.logprobs is not None:
        skip |= {"transformers"}  # its static batch asks for one greedy choice, no logprobs
    if args.quick:
        args.streams, args.max_tokens, args.rounds, args.probes = 4, 16, 1, 3
    if min(args.streams, args.max_tokens, args.rounds, args.probe_tokens) < 1 or args.probes < 0:
        parser.error(
            "--streams, --max-tokens, --rounds and --probe-tokens must be at least 1, "
            "--probes 0 or more"
        )
    return Settings(
        args.repository.expanduser(),
        args.streams,
        args.max_tokens,
        args.rounds,
        args.probes,
        args.probe_tokens,
        skip,
        args.n,
        args.logprobs,
    )


Runner = Callable[[Sequence[str], int], Awaitable[RoundResult]]
"""Run one batch of prompts with a max_tokens on one target."""


def _stream_runner(label: str, call: StreamCall) -> Runner:
    async def run(texts: Sequence[str], max_tokens: int) -> RoundResult:
        return await run_round(label, call, texts, max_tokens)

    return run


def _static_runner(static: StaticBatch) -> Runner:
    async def run(texts: Sequence[str], max_tokens: int) -> RoundResult:
        return static.run(texts, max_tokens)  # blocks the loop: nothing else runs meanwhile

    return run


async def measure(
    settings: Settings, mesh: MeshInfo, vllm_url: str | None
) -> tuple[list[RoundResult], list[RoundResult]]:
    """Warm every target once, then ``rounds`` interleaved measured rounds of the
    whole batch, then ``probes`` lone requests per target (TTFT alone,
    with the engine's own share)."""
    edge = mesh.edge
    texts = prompts(settings.streams)
    clients: dict[str, OpenAiChat | GrpcChat] = {}
    if "mesh openai" not in settings.skip:
        clients["mesh openai"] = OpenAiChat(
            f"http://{edge}/v1", MESH_MODEL, settings.streams, settings.body()
        )
    if "mesh grpc" not in settings.skip:
        clients["mesh grpc"] = GrpcChat(edge, settings.n, settings.logprobs)
    if vllm_url is not None:
        clients["vllm server"] = OpenAiChat(
            vllm_url, ENGINE_MODEL, settings.streams, settings.body()
        )
    runners = {label: _stream_runner(label, client) for label, client in clients.items()}
    mesh_engine = EngineTtft(
        [
            f"http://127.0.0.1:{port}/metrics"
            for name, port in mesh.metrics_ports.items()
            if name.startswith("inference")
        ]
    )
    engines = {"mesh openai": mesh_engine, "mesh grpc": mesh_engine}
    if vllm_url is not None:
        engines["vllm server"] = EngineTtft([vllm_url.removesuffix("/v1") + "/metrics"])
    if "transformers" not in settings.skip:
        runners["transformers"] = _static_runner(
            StaticBatch(settings.repository / ENGINE_MODEL / "1", engine_dtype(settings.repository))
        )
    rounds: list[RoundResult] = []
    probes: list[RoundResult] = []
    try:
        for round_index in range(settings.rounds + 1):  # round 0 warms up
            for label, run in runners.items():
                done = await _timed(run, texts, settings.max_tokens)
                _check(done, settings.max_tokens * settings.n)
                if round_index:
                    rounds.append(done)
                print(f"  round {round_index} {label}: {done.tokens_per_s:.1f} tok/s", flush=True)
        order = list(runners)
        for index in range(settings.probes):
            # Each probe round starts at the next target, so that none always runs
            # right after the same other one (an engine that just worked, say).
            turn = index % len(order)
            for label in order[turn:] + order[:turn]:
                text = texts[index % len(texts)]
                probe = await _timed(
                    runners[label], [text], settings.probe_tokens, engines.get(label)
                )
                probes.append(probe)
    finally:
        for client in clients.values():
            await client.close()
    return rounds, probes


async def _timed(
    run: Runner, texts: Sequence[str], max_tokens: int, engine: EngineTtft | None = None
) -> RoundResult:
    """``run``, with the machine's busy CPU seconds over it (idle engines add ~0),
    and the engine's own TTFT where ``engine`` is given and ran exactly one request."""
    await asyncio.sleep(QUIET_S)
    engine_before = engine.totals() if engine is not None else None
    before = machine_cpu_seconds()
    done = await run(texts, max_tokens)
    done = dataclasses.replace(done, cpu_s=machine_cpu_seconds() - before)
    if engine is None or engine_before is None:
        return done
    spent = engine.totals() - engine_before
    return dataclasses.replace(
        done,
        engine_ttft_s=spent.ttft_s if spent.ttft_count == 1 else None,
        engine_core_s=spent.core_s if spent.core_count == 1 else None,
    )


def _check(done: RoundResult, max_tokens: int) -> None:
    empty = [i for i, s in enumerate(done.streams) if not s.tokens or not s.text.strip()]
    if empty:
        raise RuntimeError(f"{done.label}: streams {empty} produced no text")
    over = [s.tokens for s in done.streams if s.tokens > max_tokens]
    if over:
        raise RuntimeError(f"{done.label}: streams went past max_tokens: {over}")


def _percentiles_ms(runs: Sequence[RoundResult]) -> tuple[float, float]:
    ttft = np.array([s.ttft_s for r in runs for s in r.streams]) * 1000
    return float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99))


def _paired_median_ms(runs: Sequence[RoundResult], base: Sequence[RoundResult]) -> float:
    """Median TTFT difference of probes sent back to back with the same prompt.

    The engine's own time for a prompt varies by tens of ms from probe to
    probe (one CPU core, prompts of different lengths); pairing takes the
    prompt's share out, so the number moves less than a difference of p50s.
    """
    differences = [
        (mine.ttft_s - theirs.ttft_s) * 1000
        for run, other in zip(runs, base, strict=True)
        for mine, theirs in zip(run.streams, other.streams, strict=True)
    ]
    return float(np.median(differences))


def _outside_p50_ms(runs: Sequence[RoundResult], clock: str) -> float | None:
    """p50 of the probes' TTFT beyond the engine's own time on ``clock``
    (``engine_ttft_s`` or ``engine_core_s``); None when that clock was not read."""
    outside = [
        (stream.ttft_s - inside) * 1000
        for run in runs
        if (inside := getattr(run, clock)) is not None
        for stream in run.streams
    ]
    return float(np.median(outside)) if outside else None


def report(
    rounds: Sequence[RoundResult], probes: Sequence[RoundResult], settings: Settings, dtypes: str
) -> str:
    """The batch table (best round per target) and the lone-request TTFT table;
    ``dtypes`` says which dtype each side computed in."""
    labels = [label for label in TARGETS if any(r.label == label for r in rounds)]
    mine = {label: [r for r in rounds if r.label == label] for label in labels}
    best = {label: max(runs, key=lambda r: r.tokens_per_s) for label, runs in mine.items()}
    base = best.get(BASELINE)
    base_p50 = _percentiles_ms(mine[BASELINE])[0] if base else None
    rows = []
    for label in labels:
        run = best[label]
        p50, p99 = _percentiles_ms(mine[label])
        rows.append(
            [
                label,
                f"{run.tokens_per_s:.1f}",
                run.tokens,
                sum(stream.prompt_tokens for stream in run.streams),
                f"{1000 * run.cpu_s / run.tokens:.1f}",
                f"{p50:.0f}",
                f"{p99:.0f}",
                f"{run.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-",
                f"{p50 - base_p50:+.0f}" if base_p50 is not None else "-",
            ]
        )
    headers = [
        "target",
        "tok/s",
        "tokens",
        "prompt tok",
        "CPU ms/tok",
        "TTFT p50 ms",
        "p99 ms",
        "vs vllm",
        "+TTFT p50 ms",
    ]
    text = (
        f"{settings.streams} concurrent chat streams x {settings.max_tokens} tokens at most, "
        f"greedy; tok/s and CPU (whole machine) of the fastest of {settings.rounds} round(s), "
        f"TTFT over all of them; {dtypes}\n{format_table(headers, rows)}"
    )
    if probes:
        alone = {label: [r for r in probes if r.label == label] for label in labels}
        base_alone = _percentiles_ms(alone[BASELINE])[0] if BASELINE in alone else None
        clocks = ("engine_ttft_s", "engine_core_s")
        base_outside = {clock: _outside_p50_ms(alone.get(BASELINE, []), clock) for clock in clocks}
        rows = []
        for label in labels:
            p50, p99 = _percentiles_ms(alone[label])
            added = f"{p50 - base_alone:+.1f}" if base_alone is not None else "-"
            paired = (
                f"{_paired_median_ms(alone[label], alone[BASELINE]):+.1f}"
                if base_alone is not None
                else "-"
            )
            row: list[object] = [
                label,
                len(alone[label]),
                f"{p50:.1f}",
                f"{p99:.1f}",
                added,
                paired,
            ]
            for clock in clocks:
                outside, theirs = _outside_p50_ms(alone[label], clock), base_outside[clock]
                row.append("-" if outside is None else f"{outside:.1f}")
                row.append("-" if outside is None or theirs is None else f"{outside - theirs:+.1f}")
            rows.append(row)
        headers = [
            "target",
            "requests",
            "TTFT p50 ms",
            "p99 ms",
            "+TTFT p50 ms",
            "paired +ms",
            "outside engine p50 ms",
            "+outside ms",
            "outside core p50 ms",
            "+core ms",
        ]
        text += (
            f"\n\none request at a time, {settings.probe_tokens} token(s) at most (TTFT without"
            f" queueing); paired: the median"
            f" over probes of (target - {BASELINE}) on the same prompt, back to back;"
            f" outside engine: TTFT minus the engine's own (vllm:time_to_first_token_seconds),"
            f" p50; outside core: TTFT minus the engine core's queue + prefill time, p50\n"
            f"{format_table(headers, rows)}"
        )
    return text


def dtype_summary(repository: Path, in_mesh: str) -> str:
    """Each side's dtype in one line: the comparison holds only where they agree."""
    wanted = engine_dtype(repository)
    text = f"dtype: {wanted} (mesh engine: {in_mesh} in use, vllm server: --dtype {wanted}, "
    text += f"transformers: {wanted})"
    if wanted not in ("auto", in_mesh):
        text += " -- WARNING: the mesh's engine does not run in the configured dtype"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    install_sigterm_exit()
    missing = missing_models(settings.repository, [ENGINE_MODEL, MESH_MODEL])
    if missing:
        print(f"missing models {missing}: run python -m models.prepare first", file=sys.stderr)
        return 2
    print(f"load average before: {load_average()}", flush=True)
    with contextlib.ExitStack() as stack:
        print("starting the mesh ...", flush=True)
        mesh = stack.enter_context(running_mesh(settings.repository, ready_timeout_s=600))
        vllm_url = None
        if "vllm server" not in settings.skip:
            print("starting vLLM's OpenAI server ...", flush=True)
            vllm_url = stack.enter_context(vllm_server(settings.repository))
        dtypes = dtype_summary(settings.repository, mesh_dtype_in_use(mesh.edge))
        print(dtypes, flush=True)
        rounds, probes = asyncio.run(measure(settings, mesh, vllm_url))
    print(report(rounds, probes, settings, dtypes))
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
