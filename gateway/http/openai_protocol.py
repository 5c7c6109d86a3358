"""The OpenAI (and vLLM tokenize) request bodies as pydantic protocol classes.

As vLLM's ``ChatCompletionRequest``: one class per body says which fields
exist, and each field's validator says what is wrong with it. A validator
raises ``InvalidParam`` (not a ``ValueError``), which pydantic lets through
untouched: the client's 400 names the field in ``error.param`` and the
message says what was expected and what came, in the words OpenAI's SDKs and
vLLM's clients are used to. Validation stops at the first wrong field.

Fields the mesh cannot honour are declared too (``Unsupported``): refused
with ``unsupported_parameter`` unless they carry their neutral value.
Fields that do not change the answer (``user``, ``metadata``, ...) and
unknown ones are ignored, as vLLM ignores them.

Nothing here knows aiohttp or gRPC beyond the messages it builds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo

from meshserve.v1 import meshserve_pb2 as api
from shared.errors import InvalidArgument
from shared.jsontext import kind

DEFAULT_LLM = "llm"
DEFAULT_EMBEDDER = "text_embedding"
INT32_MAX = 2**31 - 1
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

MAX_CHOICES = 128
"""The most choices (``n``) one request may ask for."""
MAX_LOGPROBS = 20
"""The most top alternatives per token (OpenAI's limit, and vLLM's default)."""
# Field -> the values that ask for nothing this server lacks.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "suffix": (None, ""),
}
# vLLM's /tokenize fields the mesh's tokenizer step does not take, and their neutral values.
TOKENIZE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "return_token_strs": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "tools": (None, []),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
}


class InvalidParam(InvalidArgument):
    """A request field is wrong; ``param`` names it in the OpenAI error body."""

    def __init__(self, param: str, message: str, error_code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.error_code = error_code


# --- One check per kind of field (the field's name comes from pydantic) -------------

Check = Callable[[Any, Any], Any]
B = TypeVar("B", bound=BaseModel)


class _Named:
    """What a check reads of pydantic's ValidationInfo, for a check run by hand."""

    def __init__(self, field_name: str) -> None:
        self.field_name = field_name


def _name(info: ValidationInfo | _Named) -> str:
    return info.field_name or "body"


def number(low: float, high: float, *, above_low: bool = False) -> Check:
    """A number in [low, high] (``above_low``: low itself refused); null: unset."""

    def check(value: Any, info: ValidationInfo) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidParam(_name(info), f"expected a number, got {kind(value)}")
        if not low <= value <= high:
            raise InvalidParam(_name(info), f"must be between {low:g} and {high:g}, got {value}")
        if above_low and value == low:
            raise InvalidParam(_name(info), f"must be greater than {low:g}")
        return float(value)

    return check


def integer(low: int, high: int = INT32_MAX) -> Check:
    """An integer in [low, high]; null: unset."""

    def check(value: Any, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidParam(_name(info), f"expected an integer, got {kind(value)}")
        if not low <= value <= high:
            raise InvalidParam(_name(info), f"must be between {low} and {high}, got {value}")
        return value

    return check


def _token_ids(value: Any, info: ValidationInfo) -> list[int]:
    ids = [] if value is None and info.field_name == "stop_token_ids" else value
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= INT32_MAX for i in ids
    ):
        raise InvalidParam(_name(info), "expected a list of token ids (integers >= 0)")
    return ids


def _strings(value: Any, info: ValidationInfo) -> list[str]:
    values = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        message = "expected a non-empty string or a list of non-empty strings"
        raise InvalidParam(_name(info), message)
    return values


def _switch(value: Any, info: ValidationInfo) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidParam(_name(info), f"expected a boolean, got {kind(value)}")
    return value


def _model_name(value: Any, info: ValidationInfo) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidParam(_name(info), f"expected a string, got {kind(value)}")
    return value or None


def unsupported(table: Mapping[str, tuple[Any, ...]]) -> Check:
    """A field this server cannot honour: only its neutral values (``table``) pass."""

    def check(value: Any, info: ValidationInfo) -> Any:
        neutral = table[_name(info)]
        if not any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral):
            accepted = ", ".join(json.dumps(n) for n in neutral[1:])
            message = f"not supported by this server (accepted: {accepted})"
            raise InvalidParam(_name(info), message, "unsupported_parameter")
        return value

    return check


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidParam(where, f"expected a string or a list of text parts, got {kind(value)}")
    texts = []
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise InvalidParam(f"{where}[{i}]", "only parts of type 'text' are supported")
        if not isinstance(part.get("text"), str):
            raise InvalidParam(f"{where}[{i}].text", "expected a string")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(value: Any, info: ValidationInfo | None = None) -> list[api.ChatMessage]:
    """OpenAI ``messages`` (string or text-part content) as ChatMessages."""
    if not isinstance(value, list) or not value:
        raise InvalidParam("messages", "expected a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidParam(where, f"expected an object, got {kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise InvalidParam(f"{where}.role", f"expected one of {sorted(_ROLES)}, got {role!r}")
        if "content" not in message:
            raise InvalidParam(f"{where}.content", "required")
        content = _content(message["content"], f"{where}.content")
        messages.append(api.ChatMessage(role=_ROLES[role], content=content))
    return messages


def _texts(value: Any, info: ValidationInfo) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        problem = "expected a string or a list of strings (token arrays are not supported)"
        raise InvalidParam(_name(info), problem)
    return texts


def _encoding(value: Any, info: ValidationInfo) -> str:
    encoding = value or "float"
    if encoding not in ("float", "base64"):
        raise InvalidParam(_name(info), f"expected 'float' or 'base64', got {encoding!r}")
    return str(encoding)


def _tokenize_prompt(value: Any, info: ValidationInfo) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidParam(_name(info), "expected a non-empty string")
    return value


def _prompt(value: Any, info: ValidationInfo) -> str:
    prompt = value[0] if isinstance(value, list) and len(value) == 1 else value
    if not isinstance(prompt, str) or not prompt:
        problem = "expected one non-empty string (token arrays and batches are not supported)"
        raise InvalidParam(_name(info), problem)
    return prompt


# --- The protocol classes ------------------------------------------------------------

Unsupported = Annotated[Any, BeforeValidator(unsupported(NEUTRAL))]
Model = Annotated[str | None, BeforeValidator(_model_name)]
Switch = Annotated[bool, BeforeValidator(_switch)]


class _Body(BaseModel):
    # Validators take the raw JSON value; fields absent or null keep the default.
    model_config = ConfigDict(arbitrary_types_allowed=True, validate_default=False)


class SamplingFields(_Body):
    """The sampling fields of a (chat) completion, and of Triton's generate ``parameters``."""

    n: Annotated[int | None, BeforeValidator(integer(1, MAX_CHOICES))] = None
    frequency_penalty: Annotated[float | None, BeforeValidator(number(-2.0, 2.0))] = None
    presence_penalty: Annotated[float | None, BeforeValidator(number(-2.0, 2.0))] = None
    logit_bias: Any = None
    """Checked by openai_fields.logit_bias."""
    functions: Unsupported = None
    function_call: Unsupported = None
    modalities: Unsupported = None
    suffix: Unsupported = None
    stop: Annotated[list[str], BeforeValidator(_strings)] = []
    stop_token_ids: Annotated[list[int], BeforeValidator(_token_ids)] = []
    temperature: Annotated[float | None, BeforeValidator(number(0.0, 2.0))] = None
    top_p: Annotated[float | None, BeforeValidator(number(0.0, 1.0, above_low=True))] = None
    repetition_penalty: Annotated[float | None, BeforeValidator(number(0.01, 10.0))] = None
    min_p: Annotated[float | None, BeforeValidator(number(0.0, 1.0))] = None
    min_tokens: Annotated[int | None, BeforeValidator(integer(0))] = None
    ignore_eos: Annotated[bool | None, BeforeValidator(_switch)] = None
    max_tokens: Annotated[int | None, BeforeValidator(integer(1))] = None
    max_completion_tokens: Annotated[int | None, BeforeValidator(integer(1))] = None
    """The newer name of max_tokens; it wins when both are sent."""
    top_k: Annotated[int | None, BeforeValidator(integer(-1))] = None
    seed: Annotated[int | None, BeforeValidator(integer(-INT32_MAX - 1))] = None
    user: Annotated[str | None, BeforeValidator(_model_name)] = None
    """Accepted and ignored, as vLLM does (it changes no answer)."""

    def sampling(self) -> api.SamplingParams:
        """The fields as meshserve.v1 SamplingParams (unset ones stay unset)."""
        params = api.SamplingParams(stop=self.stop, stop_token_ids=self.stop_token_ids)
        values = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "top_k": self.top_k,
            "seed": self.seed,
            "n": self.n,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
        }
        for name, value in values.items():
            if value is not None:
                setattr(params, name, value)
        return params


class _Streamed(SamplingFields):
    model: Model = None
    stream: Switch = False
    stream_options: Any = None
    """Checked by openai_fields.stream_options."""
    response_format: Any = None
    structured_outputs: Any = None
    """vLLM's: json, json_object, regex, choice or grammar (openai_fields)."""


class ChatCompletionRequest(_Streamed):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[api.ChatMessage], BeforeValidator(chat_messages)] = Field(
        None, validate_default=True
    )
    logprobs: Annotated[bool | None, BeforeValidator(_switch)] = None
    top_logprobs: Annotated[int | None, BeforeValidator(integer(0, MAX_LOGPROBS))] = None
    tools: Any = None
    tool_choice: Any = None


class CompletionRequest(_Streamed):
    """``POST /v1/completions``: one prompt string."""

    prompt: Annotated[str, BeforeValidator(_prompt)] = Field(None, validate_default=True)
    logprobs: Annotated[int | None, BeforeValidator(integer(0, MAX_LOGPROBS))] = None
    echo: Annotated[bool | None, BeforeValidator(_switch)] = None
    best_of: Annotated[int | None, BeforeValidator(integer(1, MAX_CHOICES))] = None
    """Accepted where it equals n: the mesh returns every choice it generates."""


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize``: a ``prompt`` or chat ``messages``, at vLLM's defaults."""

    model: Model = None
    prompt: Annotated[str | None, BeforeValidator(_tokenize_prompt)] = None
    messages: Annotated[list[api.ChatMessage] | None, BeforeValidator(chat_messages)] = None
    add_special_tokens: Any = None
    """Checked against the kind of body (``TokenizeRequest.message``)."""
    add_generation_prompt: Annotated[Any, BeforeValidator(unsupported(TOKENIZE_NEUTRAL))] = None
    continue_final_message: Annotated[Any, BeforeValidator(unsupported(TOKENIZE_NEUTRAL))] = None
    return_token_strs: Annotated[Any, BeforeValidator(unsupported(TOKENIZE_NEUTRAL))] = None
    chat_template: Annotated[Any, BeforeValidator(unsupported(TOKENIZE_NEUTRAL))] = None
    chat_template_kwargs: Annotated[Any, BeforeValidator(unsupported(TOKENIZE_NEUTRAL))] = None
    tools: Annotated[Any, BeforeValidator(unsupported(TOKENIZE_NEUTRAL))] = None
    mm_processor_kwargs: Annotated[Any, BeforeValidator(unsupported(TOKENIZE_NEUTRAL))] = None
    media_io_kwargs: Annotated[Any, BeforeValidator(unsupported(TOKENIZE_NEUTRAL))] = None

    def message(self) -> api.TokenizeRequest:
        """The TokenizeRequest; the ids are the pipeline's, as it feeds its engine:
        vLLM's defaults are what it does, and asking for others is refused."""
        chat = self.messages is not None
        # vLLM adds special tokens to a prompt by default, not to a chat.
        table = {"add_special_tokens": (None, not chat)}
        unsupported(table)(self.add_special_tokens, _Named("add_special_tokens"))
        model = self.model or DEFAULT_LLM
        if chat:
            return api.TokenizeRequest(model=model, messages=self.messages)
        return api.TokenizeRequest(model=model, prompt=self.prompt)


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model: Model = None
    tokens: Annotated[list[int], BeforeValidator(_token_ids)] = Field(None, validate_default=True)


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: strings (token arrays are not supported)."""

    input: Annotated[list[str], BeforeValidator(_texts)] = Field(None, validate_default=True)
    model: Model = None
    encoding_format: Annotated[str, BeforeValidator(_encoding)] = "float"
    dimensions: Annotated[int | None, BeforeValidator(integer(1))] = None


def parse(protocol: type[B], body: Mapping[str, Any]) -> B:
    """``body`` as ``protocol``; a wrong field raises InvalidParam naming it."""
    try:
        return protocol.model_validate(body)
    except ValidationError as exc:  # a field no validator of ours checks first
        error = exc.errors(include_url=False)[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        raise InvalidParam(where[1:] or "body", error["msg"]) from None


def sampling_params(body: Mapping[str, Any]) -> api.SamplingParams:
    """The sampling fields of a (chat) completion request, or of generate's parameters."""
    return parse(SamplingFields, body).sampling()
