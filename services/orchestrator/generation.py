"""Generate / Chat beyond one plain stream: n choices, logprobs, structure, tools.

A request for ``n`` choices runs ``n`` streams of the pipeline side by side,
one per choice, each with its own detokenizer state (the detokenizer step
reads each stream's own ids), and merges their deltas, each tagged with its
choice ``index``. As vLLM does for its ``n`` children, choice ``i`` samples
with ``seed + i`` when a seed is set, so a seeded request gives ``n``
different choices and the same ones on a repeat. The prompt is tokenized once
per choice, and the engine's prefix cache prefills it once.

The SAMPLING JSON carries every field to the engine and the detokenizer; the
detokenizer's ``TOKEN_LOGPROBS`` (JSON rows of ``[id, logprob, token]``,
the sampled token first) become TextDelta.logprobs. Nothing here knows the
network: streams in, TextDeltas out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import numpy as np
from google.protobuf import json_format

from meshserve.v1 import meshserve_pb2 as api
from shared.errors import InvalidArgument

MAX_CHOICES = 128
"""The most choices one request may ask for (vLLM's own limit is higher; each is a stream)."""
_SCALARS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "logprobs",
)
_STRUCTURED = ("json_schema", "json_object", "regex", "grammar")


def sampling_settings(sampling: api.SamplingParams) -> dict[str, Any]:
    """The SamplingParams fields that are set, as the SAMPLING JSON object the LLM steps
    read (``n`` stays here: each choice is a stream of its own)."""
    values: dict[str, Any] = {
        name: getattr(sampling, name) for name in _SCALARS if sampling.HasField(name)
    }
    if sampling.stop_token_ids:
        values["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.stop:
        values["stop"] = list(sampling.stop)
    if sampling.logit_bias:
        values["logit_bias"] = {str(k): v for k, v in sampling.logit_bias.items()}
    if sampling.HasField("structured"):
        values["structured"] = _structured(sampling.structured)
    return values


def _structured(structured: api.StructuredOutput) -> dict[str, Any]:
    given = [name for name in _STRUCTURED if getattr(structured, name)]
    given += ["choice"] if structured.choice else []
    if len(given) != 1:
        raise InvalidArgument(
            "sampling.structured: set exactly one of json_schema, json_object, regex, "
            f"choice and grammar (got {given or 'none'})"
        )
    kind = given[0]
    if kind == "json_schema":
        try:
            return {"json": json.loads(structured.json_schema)}
        except ValueError as exc:
            raise InvalidArgument(f"sampling.structured.json_schema: not JSON: {exc}") from exc
    if kind == "choice":
        return {"choice": list(structured.choice)}
    return {kind: getattr(structured, kind)}


def choice_count(sampling: api.SamplingParams) -> int:
    """How many choices the request asks for (``n``, 1 when unset)."""
    n = sampling.n if sampling.HasField("n") else 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidArgument(f"sampling.n must be in 1..{MAX_CHOICES}, got {n}")
    if n > 1 and sampling.HasField("temperature") and sampling.temperature == 0:
        # As vLLM: greedy choices would all be the same answer.
        raise InvalidArgument(f"sampling.n must be 1 when using greedy sampling, got {n}")
    return n


def choice_sampling(settings: dict[str, Any], index: int) -> bytes:
    """The SAMPLING JSON of choice ``index``: its seed offset by the index, as vLLM's."""
    if index and "seed" in settings:
        settings = {**settings, "seed": settings["seed"] + index}
    return json.dumps(settings).encode()


def chat_tensor(messages: Sequence[api.ChatMessage], tools: Sequence[Any]) -> np.ndarray:
    """The pipeline's MESSAGES tensor: the chat as JSON; with tools, an object holding both."""
    chat: Any = [{"role": m.role, "content": m.content} for m in messages]
    if tools:
        chat = {"messages": chat, "tools": [json_format.MessageToDict(t) for t in tools]}
    return np.array([json.dumps(chat).encode()], dtype=object)


def token_logprobs(raw: str) -> list[api.TokenLogprob]:
    """The detokenizer's TOKEN_LOGPROBS JSON as TextDelta.logprobs."""
    if not raw:
        return []
    tokens = []
    for row in json.loads(raw):
        (token_id, logprob, token), *top = row
        tokens.append(
            api.TokenLogprob(
                token=token,
                token_id=token_id,
                logprob=logprob,
                token_bytes=token.encode("utf-8", errors="replace"),
                top_logprobs=[
                    api.TokenLogprob(
                        token=t, token_id=i, logprob=lp, token_bytes=t.encode(errors="replace")
                    )
                    for i, lp, t in top
                ],
            )
        )
    return tokens


async def merged(
    streams: Sequence[Callable[[], AsyncGenerator[api.TextDelta, None]]],
) -> AsyncGenerator[api.TextDelta, None]:
    """The deltas of every choice's stream as they come, each tagged with its index.

    One choice streams straight through. With more, each stream is pumped by a
    task of its own; the first error ends them all, and so does closing this."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]()) as deltas:
            async for delta in deltas:
                yield delta
        return
    queue: asyncio.Queue[api.TextDelta | BaseException | None] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async with contextlib.aclosing(streams[index]()) as deltas:
                async for delta in deltas:
                    delta.index = index
                    queue.put_nowait(delta)
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(index)) for index in range(len(streams))]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
