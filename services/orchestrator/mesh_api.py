"""meshserve.v1.MeshService: the JSON-friendly API, translated to the core's calls.

Envoy transcodes these RPCs to HTTP/JSON (``/api/v1/...``). Each RPC turns
its message into calls on the orchestrator's core (core.py), the one the v2
servicer calls too, so ensembles, routing and errors behave exactly as for a
v2 client.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf import struct_pb2

from inference import grpc_service_pb2 as pb
from meshserve.v1 import meshserve_pb2 as api
from meshserve.v1 import meshserve_pb2_grpc as api_grpc
from services.orchestrator.core import Orchestrator
from services.orchestrator.generation import (
    chat_tensor,
    choice_count,
    choice_sampling,
    merged,
    sampling_settings,
    token_logprobs,
)
from services.orchestrator.route_headers import Invocation, announce_target, take_route_headers
from services.orchestrator.servicer import Context, timeout_of
from services.orchestrator.tokenization import (
    MESSAGES,
    PROMPT,
    TEXT_DELTA,
    TextSteps,
    decoder_inputs,
    text_steps,
)
from shared.errors import InvalidArgument, MeshError, NotFound
from shared.tensors import DATATYPES, decode_outputs, element_count, encode_inputs

DEFAULT_CLASSIFIER = "image_classifier"
DEFAULT_EMBEDDER = "text_embedding"
DEFAULT_LLM = "llm"
_STATES = {
    "READY": api.MODEL_STATE_READY,
    "LOADING": api.MODEL_STATE_LOADING,
    "UNLOADING": api.MODEL_STATE_UNLOADING,
    "UNAVAILABLE": api.MODEL_STATE_UNAVAILABLE,
}


def _flatten(values: struct_pb2.ListValue) -> list[Any]:
    flat: list[Any] = []
    for value in values.values:
        kind = value.WhichOneof("kind")
        if kind == "list_value":
            flat.extend(_flatten(value.list_value))
        elif kind == "number_value":
            flat.append(value.number_value)
        elif kind == "string_value":
            flat.append(value.string_value)
        elif kind == "bool_value":
            flat.append(value.bool_value)
        else:
            raise InvalidArgument(
                f"tensor data holds a {kind}; expected numbers, booleans or strings"
            )
    return flat


def tensor_to_array(tensor: api.Tensor) -> np.ndarray:
    """A JSON tensor as a numpy array of its declared datatype and shape."""
    dtype = DATATYPES.get(tensor.datatype)
    if dtype is None:
        raise InvalidArgument(f"tensor '{tensor.name}': unknown datatype '{tensor.datatype}'")
    flat = _flatten(tensor.data)
    # Python ints, and negative dimensions refused: numpy's product overflows and
    # reshape fails on them, which would end as INTERNAL.
    count = element_count(f"tensor '{tensor.name}'", tensor.shape)
    if len(flat) != count:
        raise InvalidArgument(
            f"tensor '{tensor.name}': shape {list(tensor.shape)} needs "
            f"{count} elements, data has {len(flat)}"
        )
    try:
        if tensor.datatype == "BYTES":
            array = np.empty(count, dtype=object)
            array[:] = [str(v).encode() for v in flat]
        else:
            array = np.asarray(flat, dtype=np.float64).astype(dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"tensor '{tensor.name}': data does not fit {tensor.datatype}: {exc}"
        ) from exc
    return array.reshape(list(tensor.shape))


def array_to_tensor(name: str, datatype: str, array: np.ndarray) -> api.Tensor:
    """A numpy array as a JSON tensor (BYTES as UTF-8 text)."""
    tensor = api.Tensor(name=name, datatype=datatype, shape=[int(d) for d in array.shape])
    flat = array.reshape(-1)
    if datatype == "BYTES":
        tensor.data.extend([bytes(v).decode(errors="replace") for v in flat])
    elif datatype == "BOOL":
        tensor.data.extend([bool(v) for v in flat])
    else:
        tensor.data.extend([float(v) for v in flat.astype(np.float64)])
    return tensor


class MeshApiServicer(api_grpc.MeshServiceServicer):
    """MeshService over the orchestrator's core."""

    def __init__(self, core: Orchestrator) -> None:
        self.core = core

    async def _infer(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        version: str = "",
        outputs: list[str] | None = None,
        timeout_s: float | None = None,
        caller: Invocation | None = None,
        announce: bool = True,
    ) -> tuple[pb.ModelInferResponse, dict[str, np.ndarray]]:
        request = pb.ModelInferRequest(model_name=model, model_version=version)
        encode_inputs(request, inputs)
        for name in outputs or []:
            request.outputs.add(name=name)
        if caller is not None:  # a route's sticky key or override, from the headers
            take_route_headers(caller, request)
        response = await self.core.infer(request, timeout_s)
        if caller is not None and announce:
            await announce_target(caller, response)
        return response, decode_outputs(response)

    async def ListModels(
        self,
        request: api.ListModelsRequest,
        context: Context[api.ListModelsRequest, api.ListModelsResponse],
    ) -> api.ListModelsResponse:
        versions: dict[str, list[str]] = defaultdict(list)
        states: dict[str, str] = {}
        for row in await self.core.index(request.ready_only):
            if row.version:
                versions[row.name].append(row.version)
            if states.get(row.name) != "READY":
                states[row.name] = row.state
        response = api.ListModelsResponse()
        for name in sorted(states):
            model = response.models.add(
                name=name,
                versions=versions[name],
                state=_STATES.get(states[name], api.MODEL_STATE_UNSPECIFIED),
            )
            if states[name] == "READY":
                await self.core.adapters.ensure(name)  # an adapter gets its pipeline
                await self._describe(model, timeout_of(context))
        return response

    async def _describe(self, model: api.Model, timeout_s: float | None) -> None:
        try:
            config = await self.core.config(model.name, timeout_s=timeout_s)
        except MeshError:
            return
        model.backend = config.platform or config.backend
        model.max_batch_size = config.max_batch_size
        model.stage = ",".join(self.core.stages_of(model.name))
        model.parent = self.core.adapters.parents.get(model.name, "")

    async def GetModel(
        self,
        request: api.GetModelRequest,
        context: Context[api.GetModelRequest, api.GetModelResponse],
    ) -> api.GetModelResponse:
        metadata = await self.core.metadata(request.name, timeout_s=timeout_of(context))
        response = api.GetModelResponse(
            model=api.Model(
                name=metadata.name, versions=list(metadata.versions), state=api.MODEL_STATE_READY
            )
        )
        await self._describe(response.model, timeout_of(context))
        for target, tensors in (
            (response.inputs, metadata.inputs),
            (response.outputs, metadata.outputs),
        ):
            for tensor in tensors:
                target.add(
                    name=tensor.name, datatype=tensor.datatype, shape=[int(d) for d in tensor.shape]
                )
        return response

    async def Infer(
        self, request: api.InferRequest, context: Context[api.InferRequest, api.InferResponse]
    ) -> api.InferResponse:
        if not request.inputs:
            raise InvalidArgument("inputs: at least one tensor is required")
        arrays = {tensor.name: tensor_to_array(tensor) for tensor in request.inputs}
        raw, outputs = await self._infer(
            request.model,
            arrays,
            request.version,
            list(request.outputs),
            timeout_of(context),
            context,
        )
        response = api.InferResponse(model=raw.model_name, version=raw.model_version)
        for tensor in raw.outputs:
            response.outputs.append(
                array_to_tensor(tensor.name, tensor.datatype, outputs[tensor.name])
            )
        return response

    async def Classify(
        self,
        request: api.ClassifyRequest,
        context: Context[api.ClassifyRequest, api.ClassifyResponse],
    ) -> api.ClassifyResponse:
        if not request.image:
            raise InvalidArgument("image: the encoded image is required (base64 in JSON)")
        model = request.model or DEFAULT_CLASSIFIER
        image = np.array([[request.image]], dtype=object)
        _, outputs = await self._infer(
            model,
            {"IMAGE": image},
            outputs=["LABELS", "PROBABILITIES"],
            timeout_s=timeout_of(context),
            caller=context,
        )
        labels, probabilities = outputs["LABELS"][0], outputs["PROBABILITIES"][0]
        response = api.ClassifyResponse(model=model)
        for label, probability in zip(labels, probabilities, strict=True):
            response.classes.add(
                label=bytes(label).decode(errors="replace"), probability=float(probability)
            )
        return response

    async def Embed(
        self, request: api.EmbedRequest, context: Context[api.EmbedRequest, api.EmbedResponse]
    ) -> api.EmbedResponse:
        if not request.texts:
            raise InvalidArgument("texts: at least one text is required")
        model = request.model or DEFAULT_EMBEDDER
        response = api.EmbedResponse(model=model)
        # One request per 64 texts: the largest batch the default pipeline takes.
        for start in range(0, len(request.texts), 64):
            chunk = request.texts[start : start + 64]
            texts = np.array([[text.encode()] for text in chunk], dtype=object)
            # Response headers go out once: the first chunk's answer names its target.
            _, outputs = await self._infer(
                model,
                {"TEXT": texts},
                outputs=["EMBEDDING"],
                timeout_s=timeout_of(context),
                caller=context,
                announce=start == 0,
            )
            for vector in outputs["EMBEDDING"]:
                response.embeddings.add(values=[float(v) for v in vector])
        response.dimensions = len(response.embeddings[0].values)
        return response

    async def Generate(
        self,
        request: api.GenerateRequest,
        context: Context[api.GenerateRequest, api.GenerateResponse],
    ) -> AsyncIterator[api.GenerateResponse]:
        if not request.prompt:
            raise InvalidArgument("prompt: a non-empty prompt is required")
        inputs = {PROMPT: np.array([request.prompt.encode()], dtype=object)}
        async for delta in self._generate(
            request.model, inputs, request.sampling, timeout_of(context), context
        ):
            yield api.GenerateResponse(delta=delta)

    async def Chat(
        self, request: api.ChatRequest, context: Context[api.ChatRequest, api.ChatResponse]
    ) -> AsyncIterator[api.ChatResponse]:
        _chat(request.messages)  # checks the roles
        inputs = {MESSAGES: chat_tensor(request.messages, request.tools)}
        async for delta in self._generate(
            request.model, inputs, request.sampling, timeout_of(context), context
        ):
            yield api.ChatResponse(delta=delta)

    async def Tokenize(
        self,
        request: api.TokenizeRequest,
        context: Context[api.TokenizeRequest, api.TokenizeResponse],
    ) -> api.TokenizeResponse:
        if bool(request.prompt) == bool(request.messages):
            raise InvalidArgument("exactly one of prompt and messages is required")
        model = request.model or DEFAULT_LLM
        steps = self._text_steps(model)
        if request.messages:
            text = {steps.tokenizer_input(MESSAGES): _chat(request.messages)}
        else:
            prompt = np.array([request.prompt.encode()], dtype=object)
            text = {steps.tokenizer_input(PROMPT): prompt}
        tokenizer = steps.tokenizer
        _, outputs = await self._infer(
            tokenizer.model, text, tokenizer.version, [steps.ids], timeout_of(context)
        )
        engine = await self.core.config(
            steps.engine.model, steps.engine.version, timeout_of(context)
        )
        limit = engine.parameters.get("max_model_len")
        text_limit = limit.string_value.strip() if limit is not None else ""
        return api.TokenizeResponse(
            model=model,
            tokens=outputs[steps.ids].reshape(-1).tolist(),
            # The engine checked it when it loaded; anything else is "not set" here.
            max_model_len=int(text_limit) if text_limit.isdigit() else 0,
        )

    async def Detokenize(
        self,
        request: api.DetokenizeRequest,
        context: Context[api.DetokenizeRequest, api.DetokenizeResponse],
    ) -> api.DetokenizeResponse:
        model = request.model or DEFAULT_LLM
        decoder = self._text_steps(model).detokenizer
        inputs = decoder_inputs(decoder, list(request.tokens))
        _, outputs = await self._infer(
            decoder.model, inputs, decoder.version, [TEXT_DELTA], timeout_of(context)
        )
        return api.DetokenizeResponse(model=model, text=_text(outputs.get(TEXT_DELTA)))

    def _text_steps(self, model: str) -> TextSteps:
        plan = self.core.plan(model)
        if plan is None and not self.core.stages_of(model):
            raise NotFound(f"Request for unknown model: '{model}' is not found")
        if plan is None:
            raise InvalidArgument(f"model '{model}' is not an LLM pipeline (not an ensemble)")
        return text_steps(plan)

    async def _generate(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        sampling: api.SamplingParams,
        timeout_s: float | None,
        caller: Invocation,
    ) -> AsyncIterator[api.TextDelta]:
        """The deltas of ``sampling.n`` choices (generation.py), merged."""
        settings = sampling_settings(sampling)
        announced: list[bool] = []

        def choice(index: int) -> Callable[[], AsyncGenerator[api.TextDelta, None]]:
            sampling_input = np.array([choice_sampling(settings, index)], dtype=object)
            choice_inputs = {**inputs, "SAMPLING": sampling_input}
            return lambda: self._choice(model, choice_inputs, timeout_s, caller, announced)

        streams = [choice(index) for index in range(choice_count(sampling))]
        async with contextlib.aclosing(merged(streams)) as deltas:
            async for delta in deltas:
                yield delta

    async def _choice(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        timeout_s: float | None,
        caller: Invocation,
        announced: list[bool],
    ) -> AsyncGenerator[api.TextDelta, None]:
        request = pb.ModelInferRequest(model_name=model or DEFAULT_LLM)
        encode_inputs(request, inputs)
        take_route_headers(caller, request)
        async with contextlib.aclosing(self.core.stream(request, timeout_s)) as responses:
            async for response in responses:
                if not announced:  # a route's target, in the response headers
                    announced.append(True)
                    await announce_target(caller, response)
                outputs = decode_outputs(response)
                yield api.TextDelta(
                    text=_text(outputs.get("TEXT_DELTA")),
                    finish_reason=_text(outputs.get("FINISH_REASON")),
                    prompt_tokens=_count(outputs.get("PROMPT_TOKENS")),
                    completion_tokens=_count(outputs.get("COMPLETION_TOKENS")),
                    logprobs=token_logprobs(_text(outputs.get("TOKEN_LOGPROBS"))),
                )

    async def Health(
        self, request: api.HealthRequest, context: Context[api.HealthRequest, api.HealthResponse]
    ) -> api.HealthResponse:
        response = api.HealthResponse()
        for stage, ready in sorted(self.core.stages().items()):
            response.stages.add(
                stage=stage,
                ready_replicas=sum(ready),
                total_replicas=len(ready),
                status=api.SERVING_STATUS_SERVING if any(ready) else api.SERVING_STATUS_NOT_SERVING,
            )
        serving = all(s.status == api.SERVING_STATUS_SERVING for s in response.stages)
        response.status = api.SERVING_STATUS_SERVING if serving else api.SERVING_STATUS_NOT_SERVING
        return response


def _chat(messages: Sequence[api.ChatMessage]) -> np.ndarray:
    """Chat messages as the pipeline's MESSAGES tensor (one JSON string)."""
    if not messages:
        raise InvalidArgument("messages: at least one message is required")
    for index, message in enumerate(messages):
        if message.role not in ("system", "user", "assistant"):
            raise InvalidArgument(
                f"messages[{index}].role: expected system, user or assistant, got {message.role!r}"
            )
    chat = json.dumps([{"role": m.role, "content": m.content} for m in messages])
    return np.array([chat.encode()], dtype=object)


def _text(array: np.ndarray | None) -> str:
    if array is None or array.size == 0:
        return ""
    return bytes(array.reshape(-1)[0]).decode(errors="replace")


def _count(array: np.ndarray | None) -> int:
    return 0 if array is None or array.size == 0 else int(array.reshape(-1)[0])


def add_mesh_api(servicer: MeshApiServicer, server: grpc.aio.Server) -> None:
    """Register MeshService on a server."""
    api_grpc.add_MeshServiceServicer_to_server(servicer, server)


MESH_SERVICE_NAME = api.DESCRIPTOR.services_by_name["MeshService"].full_name
