"""The ``tokenizer`` backend: UTF-8 text (or chat messages) -> token ids and masks.

A model version folder holds ``tokenizer.json`` (the HF ``tokenizers`` format),
and for chat models ``tokenizer_config.json`` with a chat template. One batch,
one line per step::

    decode   each request's TEXT elements as UTF-8 (a bad element fails its request only)
    render   MESSAGES elements (a JSON chat) through the chat template, to text
    encode   every text of every request: one at a time while they are short, else in
             one ``encode_batch`` (Rust, multi-threaded)
    pad      to the batch's longest row, rounded up to ``pad_to_multiple_of``
    split    rows back per request: the input's shape with its last dim -> tokens

Padding to a batch-wide width rounded to a multiple means requests of similar
length leave with equal shapes, so the next stage's batcher (which combines only
equal shapes) can batch them again. The width therefore depends on the batch;
``attention_mask`` says which positions are real.

Config parameters: the fields of ``TokenizerSettings``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer

from inference import model_config_pb2 as mc
from shared import jsontext
from shared.backend import InstanceSpec, ModelSpec, parameter_settings
from shared.errors import ConfigError, InvalidArgument
from shared.request import InferRequest, InferResponse

TEXT = "TEXT"
MESSAGES = "MESSAGES"
OUTPUTS = ("input_ids", "attention_mask", "token_type_ids")
REQUIRED_OUTPUTS = OUTPUTS[:2]
INLINE_BYTES = 1024
"""Requests with at most this much text in all run on the event loop: their
template and encoding cost less than the hop to the instance's thread
(docs/performance.md). Texts this short are also encoded one at a time:
``encode_batch`` hands them to its thread pool, which on two cores took twice the
CPU for four 64-byte texts (84 against 38 µs each) and was no faster."""


@dataclass(frozen=True)
class TokenizerSettings:
    """The model's tokenizer parameters, validated once at load."""

    max_length: int = 512
    """Longest row after truncation, special tokens included; 1..1048576."""
    pad_to_multiple_of: int = 16
    """Rows are padded to the batch's longest, rounded up to this; 1..4096 (1: no rounding)."""
    add_special_tokens: bool = True
    """Whether TEXT rows get special tokens ([CLS] ... [SEP]); chat templates write their own."""

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> TokenizerSettings:
        """Read the config parameters; a bad value is a ConfigError naming it."""
        bounds = {"max_length": (1, 1 << 20), "pad_to_multiple_of": (1, 4096)}
        return parameter_settings(cls, spec, bounds)

    def width(self, longest: int) -> int:
        """Padded row length for a batch whose longest row has ``longest`` tokens."""
        multiple = self.pad_to_multiple_of
        rounded = -(-longest // multiple) * multiple
        # Never pad past max_length: positions beyond it may not exist in the model.
        return min(rounded, max(self.max_length, longest))


@dataclass
class _Texts:
    """One request's strings, waiting for the batch-wide encode."""

    slot: int  # the request's position in the batch
    shape: tuple[int, ...]  # its output shape without the token dimension
    texts: list[str]
    special: bool  # whether these rows get special tokens
    start: int = 0  # its first row among the batch's encodings

    def take(self, rows: np.ndarray) -> np.ndarray:
        """This request's rows of a padded ``[rows, width]`` batch array, in its shape."""
        return rows[self.start : self.start + len(self.texts)].reshape(*self.shape, rows.shape[1])


class TokenizerInstance:
    """One loaded ``tokenizers.Tokenizer`` (plus a chat template if MESSAGES is declared)."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self.spec = spec
        self.settings = TokenizerSettings.from_spec(spec)
        inputs = _check_inputs(spec)
        self.outputs = _check_outputs(spec)
        path = spec.model_file("tokenizer.json")
        if not path.is_file():
            raise ConfigError(
                f"model '{spec.name}' version {spec.version}: no {path.name} in {spec.path}"
            )
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ConfigError(f"{path}: not a tokenizers file: {exc}") from exc
        self.pad_id = _pad_id(self.tokenizer, spec.path)
        # The file's own padding/truncation (MiniLM's pads every row to 128) would fight ours.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.settings.max_length)
        self.chat = ChatTemplate(spec) if MESSAGES in inputs else None

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Encode every text of the batch at once, pad once, split per request."""
        results: dict[int, InferResponse | Exception] = {}
        pending: list[_Texts] = []
        for slot, request in enumerate(requests):
            try:
                pending.append(self._texts(slot, request))
            except InvalidArgument as exc:
                results[slot] = exc
        arrays = self._pad(self._encode(pending)) if pending else {}
        for item in pending:
            wanted = requests[item.slot].requested_outputs or self.outputs
            results[item.slot] = InferResponse(
                outputs={name: item.take(arrays[name]) for name in self.outputs if name in wanted}
            )
        return [results[slot] for slot in range(len(requests))]

    def runs_inline(self, requests: list[InferRequest]) -> bool:
        """True for short texts and chats (a typical prompt)."""
        total = 0
        for request in requests:
            for name in (TEXT, MESSAGES):
                tensor = request.inputs.get(name)
                if tensor is not None:
                    # A non-bytes element fails validation in execute; count it as long.
                    total += sum(
                        len(item) if isinstance(item, bytes) else INLINE_BYTES + 1
                        for item in tensor.reshape(-1)
                    )
        return total <= INLINE_BYTES

    def close(self) -> None:
        """Nothing to release beyond what garbage collection frees."""

    def _texts(self, slot: int, request: InferRequest) -> _Texts:
        text, messages = request.inputs.get(TEXT), request.inputs.get(MESSAGES)
        if (text is None) == (messages is None):
            raise InvalidArgument(
                f"model '{self.spec.name}': send exactly one of the inputs TEXT or MESSAGES"
            )
        if messages is not None:
            assert self.chat is not None  # validation admits MESSAGES only where it is declared
            rendered = [
                self.chat.render(item, f"{MESSAGES}[{index}]")
                for index, item in enumerate(messages.reshape(-1))
            ]
            return _Texts(slot, messages.shape[:-1], rendered, special=False)
        assert text is not None  # exactly one of the two is set, checked above
        decoded = [
            _utf8(item, f"model '{self.spec.name}': {TEXT}[{index}]")
            for index, item in enumerate(text.reshape(-1))
        ]
        return _Texts(slot, text.shape[:-1], decoded, special=self.settings.add_special_tokens)

    def _encode(self, pending: list[_Texts]) -> list[Encoding]:
        """Every text, per special-token setting (usually just one): one at a time
        when they are short (``INLINE_BYTES``), else in one ``encode_batch``."""
        encodings: list[Encoding] = []
        for special in (True, False):
            texts: list[str] = []
            for item in pending:
                if item.special == special:
                    item.start = len(encodings) + len(texts)
                    texts.extend(item.texts)
            if sum(map(len, texts)) <= INLINE_BYTES:
                encode = self.tokenizer.encode
                encodings.extend(encode(text, add_special_tokens=special) for text in texts)
            else:
                encodings.extend(self.tokenizer.encode_batch(texts, add_special_tokens=special))
        return encodings

    def _pad(self, encodings: list[Encoding]) -> dict[str, np.ndarray]:
        width = self.settings.width(max((len(e.ids) for e in encodings), default=0))
        shape = (len(encodings), width)
        ids = np.full(shape, self.pad_id, dtype=np.int64)
        mask, types = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
        for row, encoding in enumerate(encodings):
            count = len(encoding.ids)
            ids[row, :count] = encoding.ids
            mask[row, :count] = encoding.attention_mask
            types[row, :count] = encoding.type_ids
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _utf8(item: Any, where: str) -> str:
    if isinstance(item, str):
        return item
    try:
        return bytes(item).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{where} is not UTF-8 ({exc.reason} at byte {exc.start})") from exc


def _check_inputs(spec: ModelSpec) -> set[str]:
    inputs = {tensor.name: tensor for tensor in spec.config.input}
    where = f"model '{spec.name}'"
    if not inputs or set(inputs) - {TEXT, MESSAGES}:
        raise ConfigError(f"{where}: inputs must be TEXT and/or MESSAGES, got {sorted(inputs)}")
    for tensor in inputs.values():
        if tensor.data_type != mc.TYPE_STRING or list(tensor.dims) != [1]:
            raise ConfigError(f"{where}: input '{tensor.name}' must be TYPE_STRING with dims [ 1 ]")
    if len(inputs) == 2 and not all(tensor.optional for tensor in inputs.values()):
        raise ConfigError(f"{where}: declare TEXT and MESSAGES 'optional: true' to accept either")
    return set(inputs)


def _check_outputs(spec: ModelSpec) -> list[str]:
    outputs = {tensor.name: tensor for tensor in spec.config.output}
    where = f"model '{spec.name}'"
    if not set(REQUIRED_OUTPUTS) <= set(outputs) <= set(OUTPUTS):
        raise ConfigError(
            f"{where}: outputs must be input_ids, attention_mask and optionally "
            f"token_type_ids, got {sorted(outputs)}"
        )
    for tensor in outputs.values():
        if tensor.data_type != mc.TYPE_INT64 or list(tensor.dims) != [-1]:
            raise ConfigError(
                f"{where}: output '{tensor.name}' must be TYPE_INT64 with dims [ -1 ]"
            )
    return [name for name in OUTPUTS if name in outputs]


def _pad_id(tokenizer: Tokenizer, folder: Path) -> int:
    """The pad token id: the tokenizer file's padding, else the configs' pad_token, else 0."""
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            token = json.loads((folder / name).read_text(encoding="utf-8")).get("pad_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(token, dict):  # serialised AddedToken
            token = token.get("content")
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            return token_id
    return 0


class ChatTemplate:
    """The folder's chat template, rendered by transformers exactly as HF renders it.

    transformers (seconds to import) loads only for models that declare MESSAGES;
    encoding stays with ``tokenizers``, so chat and TEXT rows share one encode.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.model = spec.name
        # No model hub at run time: everything is in the version folder.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            self._hf = AutoTokenizer.from_pretrained(str(spec.path), local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"model '{spec.name}': transformers cannot load it: {exc}") from exc
        if not getattr(self._hf, "chat_template", None):
            raise ConfigError(
                f"model '{spec.name}' declares MESSAGES; {spec.path} has no chat template"
            )

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders tool definitions (it reads ``tools``)."""
        return "tools" in str(self._hf.chat_template)

    def render(self, item: Any, where: str) -> str:
        """One MESSAGES element (a JSON list of {role, content}, or an object with
        ``messages`` and ``tools``) -> prompt text."""
        label = f"model '{self.model}': {where}"
        messages, tools = parse_chat(item, label)
        if tools and not self.takes_tools:
            raise InvalidArgument(
                f"tools: model '{self.model}' has no tool format (its chat template "
                "renders no tools); send the request without tools"
            )
        try:
            text = self._hf.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja errors, raise_exception() in the template
            raise InvalidArgument(f"{label}: the chat template failed: {exc}") from exc
        return str(text)


def parse_chat(item: Any, label: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """One MESSAGES element: a JSON list of messages, or ``{"messages": [...],
    "tools": [...]}``; the checked messages and the tools ([] when none)."""
    try:
        chat = jsontext.parse(item)
    except (ValueError, TypeError) as exc:  # TypeError: not bytes or str
        raise InvalidArgument(f"{label}: not valid JSON: {exc}") from exc
    if not isinstance(chat, dict):
        return parse_messages(chat, label), []
    tools = chat.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidArgument(f"{label}: tools must be a list of objects")
    return parse_messages(chat.get("messages"), label), tools


def parse_messages(item: Any, label: str) -> list[dict[str, Any]]:
    """Parse and check one chat: a non-empty JSON list of objects with role and content
    (a list as it is, or its JSON text)."""
    try:
        messages = item if isinstance(item, list) else jsontext.parse(item)
    except (ValueError, TypeError) as exc:  # TypeError: not bytes or str
        raise InvalidArgument(f"{label}: not valid JSON: {exc}") from exc
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(f"{label}: expected a non-empty JSON list of messages")
    for index, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str | list)
        ):
            raise InvalidArgument(
                f"{label}: message {index} must be an object with a string 'role' "
                "and a 'content' (string or list of parts)"
            )
    return messages


class TokenizerBackend:
    """Creates TokenizerInstance objects."""

    name = "tokenizer"

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> TokenizerInstance:
        """Load the tokenizer (in the instance's own thread)."""
        return TokenizerInstance(model, instance)
