"""TextDeltas -> OpenAI (chat) completion documents, for ``n`` choices.

Each TextDelta names its choice (``index``); a choice's text, finish reason
and logprobs are its own. Logprobs take vLLM's server's shapes: a chat's
``{"content": [{token, logprob, bytes, top_logprobs}]}``, the first
``top_logprobs`` of the sampled token and its likeliest alternatives; a
completion's ``{tokens, token_logprobs, top_logprobs, text_offset}``, with
``logprobs + 1`` entries per token. Usage counts the prompt once and every
choice's tokens.

Nothing here knows aiohttp or gRPC: functions take protos and return dicts.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from gateway.http.openai_fields import StreamOptions
from meshserve.v1 import meshserve_pb2 as api
from shared.errors import Unavailable
from shared.trace_ids import current_trace_id

FLOOR = -9999.0
"""The logprob written for -inf (OpenAI's, and vLLM's)."""


def _alternatives(token: api.TokenLogprob, count: int) -> list[api.TokenLogprob]:
    """The sampled token, then its alternatives by rank, each once; the first ``count``."""
    seen: dict[int, api.TokenLogprob] = {token.token_id: token}
    for top in token.top_logprobs:
        seen.setdefault(top.token_id, top)
    return list(seen.values())[:count]


def _entry(token: api.TokenLogprob) -> dict[str, Any]:
    return {
        "token": token.token,
        "logprob": max(token.logprob, FLOOR),
        "bytes": list(token.token_bytes),
    }


@dataclass
class Generation:
    """One chat or text completion being answered: ids, choices, running token counts."""

    chat: bool
    model: str
    stream: bool = False
    n: int = 1
    """How many choices are generated."""
    options: StreamOptions = field(default_factory=StreamOptions)
    logprobs: int | None = None
    """None: none asked; else the alternatives per token (chat: top_logprobs; text: logprobs)."""
    echo: str = ""
    """Text put before each choice's own (a completion's ``echo``)."""
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    completion_tokens: dict[int, int] = field(default_factory=dict)
    _offsets: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    _opened: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        # The request's trace id (the same 32 hex digits as a uuid): the id finds the trace.
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{current_trace_id() or uuid.uuid4().hex}"

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return self.options.include_usage

    def absorb(self, delta: api.TextDelta) -> str | None:
        """Count ``delta``'s tokens; its finish reason, if it is its choice's last."""
        self.prompt_tokens = max(self.prompt_tokens, delta.prompt_tokens)
        index = delta.index
        self.completion_tokens[index] = max(
            self.completion_tokens.get(index, 0), delta.completion_tokens
        )
        if delta.finish_reason == "abort":
            raise Unavailable("the generation was aborted by the server; retry the request")
        return delta.finish_reason or None

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` object."""
        completion = sum(self.completion_tokens.values())
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        kind += ".chunk" if chunk and self.chat else ""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs_document(
        self, index: int, tokens: list[api.TokenLogprob], text_start: int = 0
    ) -> dict[str, Any] | None:
        """A choice's ``logprobs`` for ``tokens`` (None when none were asked for)."""
        if self.logprobs is None:
            return None
        if self.chat:
            content = [
                {**_entry(t), "top_logprobs": [_entry(a) for a in _alternatives(t, self.logprobs)]}
                for t in tokens
            ]
            return {"content": content}
        offsets = []
        for token in tokens:
            offsets.append(text_start + self._offsets[index])
            self._offsets[index] += len(token.token)
        top = [
            {a.token: max(a.logprob, FLOOR) for a in _alternatives(t, self.logprobs + 1)}
            for t in tokens
        ]
        return {
            "text_offset": offsets,
            "token_logprobs": [max(t.logprob, FLOOR) for t in tokens],
            "tokens": [t.token for t in tokens],
            "top_logprobs": top,
        }

    def choice(self, index: int, text: str, finish: str, tokens: list[api.TokenLogprob]) -> Any:
        """One choice of the whole (non-streamed) answer."""
        logprobs = self.logprobs_document(index, tokens, len(self.echo))
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = self.echo + text
        return choice

    def document(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole (non-streamed) answer."""
        return {**self._head(False), "choices": choices, "usage": self.usage()}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """One streamed chunk holding ``choice``."""
        document = {**self._head(True), "choices": [choice]}
        if self.options.continuous_usage_stats:
            document["usage"] = self.usage()
        elif self.include_usage:
            document["usage"] = None
        return document

    def chunks(self, delta: api.TextDelta) -> list[dict[str, Any]]:
        """The chunks one TextDelta becomes: a chat choice's role chunk first, its text
        (and logprobs), then the finish chunk if it is the choice's last."""
        index = delta.index
        out = []
        if index not in self._opened:
            self._opened.add(index)
            if self.chat:
                role = {"role": "assistant", "content": ""}
                out.append(self._choice_chunk(index, role, None, None))
            elif self.echo:
                out.append(self._choice_chunk(index, self.echo, None, None))
        finish = self.absorb(delta)
        tokens = list(delta.logprobs)
        if delta.text or tokens:
            logprobs = self.logprobs_document(index, tokens)
            content = {"content": delta.text} if self.chat else delta.text
            out.append(self._choice_chunk(index, content, logprobs, None))
        if finish:
            out.append(self._choice_chunk(index, {} if self.chat else "", None, finish))
        return [self.chunk(choice) for choice in out]

    def _choice_chunk(
        self, index: int, content: Any, logprobs: Any, finish: str | None
    ) -> dict[str, Any]:
        key = "delta" if self.chat else "text"
        return {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish}

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": self.usage()}


@dataclass
class Choices:
    """A non-streamed answer's choices, gathered from the deltas of every choice."""

    generation: Generation
    texts: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    finishes: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[api.TokenLogprob]] = field(default_factory=lambda: defaultdict(list))

    def add(self, delta: api.TextDelta) -> None:
        """Take in one delta."""
        index = delta.index
        self.texts[index].append(delta.text)
        self.tokens[index].extend(delta.logprobs)
        finish = self.generation.absorb(delta)
        if finish:
            self.finishes[index] = finish

    def document(self) -> dict[str, Any]:
        """The whole answer, its choices in index order."""
        choices = [
            self.generation.choice(
                index,
                "".join(self.texts[index]),
                self.finishes.get(index, "stop"),
                self.tokens[index],
            )
            for index in range(self.generation.n)
        ]
        return self.generation.document(choices)
