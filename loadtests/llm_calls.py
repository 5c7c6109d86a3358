"""The streamed LLM calls of ``cancel_storm.py --llm``, through every door a user
streams from: an OpenAI chat completion and KServe's ``generate_stream`` (SSE
through Envoy), and Triton's ``ModelStreamInfer`` (gRPC, through Envoy and to the
orchestrator). Each call is read to its end, closed after a few chunks, or given
a short deadline; the calls given up ask for a long answer, so a request the
engine failed to abort would still be running when the storm's check looks."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import encode_inputs

LLM_MODELS = ("llm", "smollm2_tokenizer", "smollm2", "smollm2_detokenizer")
LLM_SHARE = 0.1
"""Of the storm's calls, the share that are streamed LLM calls (``--llm``)."""
LLM_TIMEOUT_S = 120.0
"""The deadline of an LLM call that should run to its end."""
PROMPT = "Name three rivers."
WHOLE_TOKENS = 24
ABANDONED_TOKENS = 1500
"""The answer length asked for by a call that will be given up: an engine that went
on generating it would still hold the request long after the storm's pending check."""
ENGINE_GAUGES = (
    "meshserve_llm_requests_unfinished",
    "meshserve_llm_requests_running",
    "meshserve_llm_requests_waiting",
)
"""The LLM engine's requests, which must fall back to 0 as the queues do."""

Record = Callable[[str, str, str, str], None]
"""Where a call's outcome goes: (end, door, code, message)."""


def _sampling(ending: str) -> dict[str, Any]:
    if ending == "whole":
        return {"max_tokens": WHOLE_TOKENS, "temperature": 0}
    return {"max_tokens": ABANDONED_TOKENS, "temperature": 0, "ignore_eos": True}


def chat_body(ending: str, stream: bool = True) -> dict[str, Any]:
    """An OpenAI chat completion request for the ``llm`` model."""
    messages = [{"role": "user", "content": PROMPT}]
    return {"model": "llm", "messages": messages, "stream": stream, **_sampling(ending)}


@dataclass(frozen=True)
class End:
    """How one call ends: ``ending`` (whole, cancel or deadline), its deadline, and
    for a cancel how many chunks are read before the call is closed."""

    ending: str
    seconds: float
    keep: int | None


class LlmCaller:
    """One streamed LLM call at a time, through a door picked at random."""

    def __init__(
        self,
        edge: str,
        channels: Mapping[str, Sequence[grpc.aio.Channel]],
        rng: random.Random,
        record: Record,
    ) -> None:
        self._edge = edge
        self._channels = channels
        self._rng = rng
        self._record = record

    async def call(self, session: aiohttp.ClientSession, ending: str) -> None:
        """One call that ends as ``ending`` says: whole, cancel or deadline."""
        seconds = self._rng.uniform(0.05, 1.0) if ending == "deadline" else LLM_TIMEOUT_S
        end = End(ending, seconds, self._rng.randint(0, 4) if ending == "cancel" else None)
        door = self._rng.choice(("chat", "generate", *self._channels))
        if door == "chat":
            url = f"http://{self._edge}/v1/chat/completions"
            await self._sse(session, door, url, chat_body(ending), end)
        elif door == "generate":
            url = f"http://{self._edge}/v2/models/llm/generate_stream"
            body = {"text_input": PROMPT, "parameters": _sampling(ending)}
            await self._sse(session, door, url, body, end)
        else:
            channel = self._rng.choice(self._channels[door])
            await self._stream(channel, f"llm {door}", end)

    async def _sse(
        self,
        session: aiohttp.ClientSession,
        door: str,
        url: str,
        body: dict[str, Any],
        end: End,
    ) -> None:
        """An SSE stream through Envoy; its end is OpenAI's ``[DONE]`` or the KServe
        event that carries a finish reason."""
        ending, keep = end.ending, end.keep
        try:
            async with session.post(
                url, json=body, timeout=aiohttp.ClientTimeout(total=end.seconds)
            ) as reply:
                if reply.status != 200:
                    self._record(ending, door, f"HTTP {reply.status}", await reply.text())
                    return
                chunks = 0
                async for line in reply.content:
                    if not line.startswith(b"data:"):
                        continue
                    if _last_event(door, line):
                        self._record(ending, door, "OK", "")
                        return
                    chunks += 1
                    if keep is not None and chunks > keep:
                        self._record(ending, door, "CANCELLED", "")
                        return  # leaving the block closes the connection
                self._record(ending, door, "no last event", "")
        except TimeoutError:
            self._record(ending, door, "DEADLINE_EXCEEDED", "")
        except aiohttp.ClientError as exc:
            self._record(ending, door, type(exc).__name__, str(exc))
        except ValueError as exc:
            self._record(ending, door, "event not JSON", str(exc))

    async def _stream(self, channel: grpc.aio.Channel, door: str, end: End) -> None:
        """Triton's decoupled stream: responses until the one marked final."""
        ending, keep = end.ending, end.keep
        request = pb.ModelInferRequest(model_name="llm")
        sampling = json.dumps(_sampling(ending)).encode()
        inputs = {"PROMPT": [PROMPT.encode()], "SAMPLING": [sampling]}
        encode_inputs(request, {k: np.array(v, dtype=object) for k, v in inputs.items()})
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        call = stub.ModelStreamInfer(iter([request]), timeout=end.seconds)
        chunks = 0
        try:
            async for message in call:
                if message.error_message:
                    self._record(ending, door, "error response", message.error_message)
                    return
                if message.infer_response.parameters["triton_final_response"].bool_param:
                    self._record(ending, door, "OK", "")
                    return
                chunks += 1
                if keep is not None and chunks > keep:
                    call.cancel()
                    self._record(ending, door, "CANCELLED", "")
                    return
            self._record(ending, door, "no final response", "")
        except grpc.aio.AioRpcError as exc:
            self._record(ending, door, exc.code().name, exc.details() or "")


def _last_event(door: str, line: bytes) -> bool:
    """Whether this SSE ``data:`` line ends the stream; ValueError if it is not JSON."""
    if door == "chat":
        return line.startswith(b"data: [DONE]")
    event = json.loads(line[len(b"data:") :])
    return isinstance(event, dict) and "finish_reason" in event


async def chat_p50(edge: str, calls: int = 5) -> float:
    """The median time of a short, whole, unstreamed chat completion through Envoy."""
    body = chat_body("whole", stream=False) | {"max_tokens": 8}
    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(calls):
            started = time.perf_counter()
            async with session.post(f"http://{edge}/v1/chat/completions", json=body) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"llm: HTTP {reply.status} under the health load")
                await reply.read()
            times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))
