"""One batch line through the orchestrator: the request the online front door would send.

The translation is the HTTP adapter's own (``gateway.http.openai_documents``
for the OpenAI bodies, ``gateway.http.rest`` for KServe v2 JSON), so a line's
answer is the document the same request gets online. Every line carries the
worker's priority level (the v2 ``priority`` parameter; the ``x-meshserve-priority``
header on the meshserve.v1 calls), capped at the lowest level its models
declare, so models with ``priority_levels`` (and an LLM engine with priority
scheduling) serve online requests first.

A chat or completion line asks for the final response only
(``x-meshserve-final-only``): the engine answers once with every token and
the detokenizer runs once, instead of one message per token through three
stages. Lines whose answer the stream shapes (stop strings, several choices,
logprobs, tools) stream as online requests do.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from gateway.http.openai_documents import (
    Choices,
    Generation,
    chat_request,
    completion_request,
    embed_request,
    embeddings_document,
    error_document,
)
from gateway.http.rest import parse_infer, render_infer
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from meshserve.v1 import meshserve_pb2 as api
from meshserve.v1 import meshserve_pb2_grpc as api_grpc
from services.batch.lines import V2_URL, BatchLine
from shared.errors import InvalidArgument, MeshError, error_for_status
from shared.tensors import serialize_bytes

TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
)
"""Codes that say "not now" (the mesh restarting, a full queue): the line is tried again."""


PRIORITY_HEADER = "x-meshserve-priority"
FINAL_ONLY_HEADER = "x-meshserve-final-only"
"""The orchestrator's request headers (services/orchestrator/route_headers.py)."""
ANY_LEVEL = 1_000_000
"""The cap of a model without a batcher (a decoupled engine): it takes any level."""
FINAL_ONLY_FIELDS = frozenset(
    {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
     "top_p", "top_k", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
     "min_p", "min_tokens", "ignore_eos", "logit_bias", "stop_token_ids", "user", "n"}
)  # fmt: skip
"""Body fields that leave the answer the same whether it streams or comes at once."""


class Transient(Exception):
    """The orchestrator could not take the line now; it stays claimed and is retried."""


@dataclass(frozen=True)
class Answer:
    """A line's result: the HTTP status and body the online request would have got."""

    status: int
    body: dict[str, Any]


class LineRunner:
    """Runs lines on the orchestrator's MeshService (OpenAI) and KServe v2 (v2 lines)."""

    def __init__(self, channel: grpc.aio.Channel, priority: int, timeout_s: float) -> None:
        self.mesh = api_grpc.MeshServiceStub(channel)  # type: ignore[no-untyped-call]
        self.v2 = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        self.priority = priority
        self.timeout_s = timeout_s
        self._levels: dict[str, int] = {}
        """Priority levels by model (read once from its config)."""

    async def run(self, line: BatchLine) -> Answer:
        """The line's answer; a refusal by the model is an answer too (its error document)."""
        try:
            return Answer(200, await self._call(line))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in TRANSIENT:
                raise Transient(f"{exc.code().name}: {exc.details()}") from exc
            error = error_for_status(exc.code(), exc.details() or exc.code().name)
            return Answer(
                error.http_status, error_document(error.http_status, error.message, error)
            )
        except MeshError as error:
            return Answer(
                error.http_status, error_document(error.http_status, error.message, error)
            )

    async def _call(self, line: BatchLine) -> dict[str, Any]:
        if line.url == "/v1/embeddings":
            message, encoding, dimensions = embed_request(line.body)
            headers = await self._headers(message.model, line.body)
            answer = await self.mesh.Embed(message, timeout=self.timeout_s, metadata=headers)
            return embeddings_document(answer, encoding, dimensions)
        if line.url == "/v1/chat/completions":
            chat, generation = chat_request(line.body)
            headers = await self._headers(chat.model, line.body, generates=True)
            call = self.mesh.Chat(chat, timeout=self.timeout_s, metadata=headers)
            return await self._generate(call, generation)
        if line.url == "/v1/completions":
            prompt, generation = completion_request(line.body)
            headers = await self._headers(prompt.model, line.body, generates=True)
            call = self.mesh.Generate(prompt, timeout=self.timeout_s, metadata=headers)
            return await self._generate(call, generation)
        match = V2_URL.match(line.url)
        assert match is not None  # lines.parse_line let only these through
        return await self._infer(match["model"], line.body)

    async def _generate(self, call: Any, generation: Generation) -> dict[str, Any]:
        choices = Choices(generation)
        async for response in call:
            delta: api.TextDelta = response.delta
            choices.add(delta)
        return choices.document()

    async def _headers(
        self, model: str, body: dict[str, Any], generates: bool = False
    ) -> tuple[tuple[str, str], ...]:
        """The meshserve.v1 call's headers: its priority, and final-only where it fits."""
        headers: list[tuple[str, str]] = []
        level = await self._level(model)
        if level:
            headers.append((PRIORITY_HEADER, str(level)))
        if generates and set(body) <= FINAL_ONLY_FIELDS and body.get("n") in (None, 1):
            headers.append((FINAL_ONLY_HEADER, "true"))
        return tuple(headers)

    async def _level(self, model: str) -> int:
        """The priority level v2 lines of ``model`` get: ours, capped at the model's lowest.

        A model without priority levels gets none (it still sees at most
        ``concurrency`` lines at a time); an ensemble passes the level to every
        step, so it gets one only when each of its steps has levels (a decoupled
        engine has no batcher to refuse one: vLLM orders by it when its
        ``scheduling_policy`` is ``priority``)."""
        if not self.priority:
            return 0
        if model not in self._levels:
            self._levels[model] = await self._levels_of(model)
        return min(self.priority, self._levels[model])

    async def _levels_of(self, model: str) -> int:
        request = pb.ModelConfigRequest(name=model)
        config = (await self.v2.ModelConfig(request, timeout=self.timeout_s)).config
        steps = [step.model_name for step in config.ensemble_scheduling.step]
        if config.platform == "ensemble" and steps:
            return min([await self._levels_of(step) for step in steps])
        if config.model_transaction_policy.decoupled:
            return ANY_LEVEL
        return int(config.dynamic_batching.priority_levels)

    async def _infer(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        payload, header_length = binary_body(body)
        infer = parse_infer(model, "", payload, header_length)
        request: pb.ModelInferRequest = infer.request
        level = await self._level(model)
        if level and "priority" not in request.parameters:
            request.parameters["priority"].int64_param = level
        response = await self.v2.ModelInfer(request, timeout=self.timeout_s)
        document, header = render_infer(infer, response)
        parsed: dict[str, Any] = json.loads(document[:header] if header else document)
        return parsed


def _refused(error: MeshError) -> Answer:
    return Answer(error.http_status, error_document(error.http_status, error.message, error))


def binary_body(body: dict[str, Any]) -> tuple[bytes, str | None]:
    """A v2 JSON body, its base64 BYTES inputs moved to Triton's binary extension.

    JSON cannot carry raw bytes (an image), so a BYTES input may say
    ``"parameters": {"content_encoding": "base64"}``: its strings are decoded
    and sent as binary data (``binary_data_size``), as Triton's clients send it.
    """
    inputs = body.get("inputs")
    if not isinstance(inputs, list):
        return json.dumps(body).encode(), None
    tails: list[bytes] = []
    converted: list[Any] = []
    for item in inputs:
        parameters = item.get("parameters") if isinstance(item, dict) else None
        if not isinstance(parameters, dict) or parameters.get("content_encoding") != "base64":
            converted.append(item)
            continue
        raw = _decoded(str(item.get("name")), item.get("data"))
        kept = {k: v for k, v in parameters.items() if k != "content_encoding"}
        entry = {k: v for k, v in item.items() if k not in ("data", "parameters")}
        converted.append(entry | {"parameters": kept | {"binary_data_size": len(raw)}})
        tails.append(raw)
    if not tails:
        return json.dumps(body).encode(), None
    header = json.dumps(body | {"inputs": converted}).encode()
    return header + b"".join(tails), str(len(header))


def _decoded(name: str, data: Any) -> bytes:
    items = data if isinstance(data, list) else [data]
    try:
        values = [base64.b64decode(item, validate=True) for item in np.ravel(items).tolist()]
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"input '{name}': data is not base64: {exc}") from exc
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return serialize_bytes(array)
