"""The ``detokenize`` backend: an LLM's token ids -> text deltas, without state.

Each response of a decoupled LLM carries every id generated so far
(``OUTPUT_IDS``) and how many of them are new (``NEW_TOKENS``); the text a
response adds is computed from those alone, so any replica can answer any
response of any stream::

    visible(ids)  decode (tokenizers, special tokens skipped); cut at the first stop
                  string; unless final, hold back a trailing incomplete UTF-8
                  sequence (U+FFFD) and a tail that may be the start of a stop string
    delta         visible(all ids) minus visible(ids without the new ones)

Decoding from the first id each time keeps merged tokens and multi-byte
characters right (a character split over two tokens appears once both are
there). The final response (``ENGINE_FINISH`` non-empty) holds nothing back.

Tensors (``max_batch_size`` 0, or batched with one row per request row):
inputs ``OUTPUT_IDS`` INT64 [-1], ``NEW_TOKENS`` INT32 [1], ``ENGINE_FINISH``
BYTES [1] and optional ``SAMPLING`` BYTES [1] (JSON; its ``stop`` strings and
``skip_special_tokens`` are used, other fields belong to the engine), and
optional ``LOGPROB_IDS`` INT64 / ``LOGPROBS`` FP32 [new, 1 + k] (the engine's);
outputs ``TOKEN_LOGPROBS`` BYTES [1] (optional: JSON rows of ``[id, logprob,
token]`` per new token, each token decoded alone; "" when none came),
``TEXT_DELTA`` BYTES [1] and ``FINISH_REASON`` BYTES [1]: "stop" when a stop
string was reached (the text before it is the last delta), else
``ENGINE_FINISH``. A non-empty reason tells the orchestrator to end the stream
and cancel the generation.

Config parameter: ``skip_special_tokens`` (default true; a request's SAMPLING
may say otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from inference import model_config_pb2 as mc
from shared.backend import InstanceSpec, ModelSpec, json_object, parameter
from shared.errors import ConfigError, InvalidArgument
from shared.request import InferRequest, InferResponse

OUTPUT_IDS = "OUTPUT_IDS"
NEW_TOKENS = "NEW_TOKENS"
ENGINE_FINISH = "ENGINE_FINISH"
SAMPLING = "SAMPLING"
LOGPROB_IDS = "LOGPROB_IDS"
LOGPROBS = "LOGPROBS"
TEXT_DELTA = "TEXT_DELTA"
FINISH_REASON = "FINISH_REASON"
TOKEN_LOGPROBS = "TOKEN_LOGPROBS"
STOPPED = "stop"
OPTIONAL = {SAMPLING, LOGPROB_IDS, LOGPROBS, TOKEN_LOGPROBS}

_INPUTS = {
    OUTPUT_IDS: (mc.TYPE_INT64, [-1]),
    NEW_TOKENS: (mc.TYPE_INT32, [1]),
    ENGINE_FINISH: (mc.TYPE_STRING, [1]),
    SAMPLING: (mc.TYPE_STRING, [1]),
    LOGPROB_IDS: (mc.TYPE_INT64, [-1, -1]),
    LOGPROBS: (mc.TYPE_FP32, [-1, -1]),
}
_OUTPUTS = {
    TEXT_DELTA: (mc.TYPE_STRING, [1]),
    FINISH_REASON: (mc.TYPE_STRING, [1]),
    TOKEN_LOGPROBS: (mc.TYPE_STRING, [1]),
}
_INCOMPLETE = "\ufffd"  # what decoding makes of a UTF-8 sequence cut short
INLINE_IDS = 512
"""Requests with at most this many ids in all run on the event loop: decoding them
costs less than the hop to the instance's thread (docs/performance.md)."""


class IncrementalDecoder:
    """Text deltas of a growing id sequence, computed from the ids alone."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def delta(
        self,
        ids: Sequence[int],
        new: int,
        engine_finish: str,
        stops: Sequence[str] = (),
        skip: bool | None = None,
    ) -> tuple[str, str]:
        """The text the last ``new`` ids add, and the finish reason ("" while running);
        ``skip`` overrides skip_special_tokens."""
        final = bool(engine_finish)
        before, _ = self.visible(ids[: len(ids) - new], stops, final=False, skip=skip)
        after, stopped = self.visible(ids, stops, final, skip)
        # `after` extends `before` unless decoding is not prefix-stable (rare
        # normalisers): then send what differs after the common part.
        start = len(before) if after.startswith(before) else _common_prefix(before, after)
        return after[start:], STOPPED if stopped else engine_finish

    def visible(
        self, ids: Sequence[int], stops: Sequence[str], final: bool, skip: bool | None = None
    ) -> tuple[str, bool]:
        """The text of ``ids`` that may be shown now, and whether a stop string ended it."""
        skip = self.skip_special_tokens if skip is None else skip
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip)
        cut = _first_stop(text, stops)
        if cut is not None:
            return text[:cut], True
        if final:
            return text, False
        text = text.rstrip(_INCOMPLETE)
        return text[: len(text) - _stop_prefix_length(text, stops)], False


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else None


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that a stop string starts with."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def _common_prefix(a: str, b: str) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def token_logprobs(tokenizer: Tokenizer, ids: np.ndarray, values: np.ndarray) -> str:
    """``[[[id, logprob, token], ...], ...]`` as JSON: a row per token, the sampled one
    first, then its top alternatives; each token string as vLLM's server writes it
    (the token decoded alone, special tokens kept)."""
    strings: dict[int, str] = {}
    rows = []
    for id_row, value_row in zip(ids.tolist(), values.reshape(ids.shape).tolist(), strict=True):
        row = []
        for token, value in zip(id_row, value_row, strict=True):
            if token not in strings:
                strings[token] = tokenizer.decode([token], skip_special_tokens=False)
            row.append([token, value, strings[token]])
        rows.append(row)
    return json.dumps(rows)


def row_settings(raw: Any, where: str, skip_special_tokens: bool) -> tuple[list[str], bool]:
    """The ``stop`` strings of one SAMPLING element (JSON object; [] when absent) and
    its ``skip_special_tokens`` (vLLM's sampling field; the model's setting when absent)."""
    settings = json_object(raw, where)
    stop = settings.get("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidArgument(f"{where}.stop must be a non-empty string or a list of them")
    skip = settings.get("skip_special_tokens", skip_special_tokens)
    if not isinstance(skip, bool):
        raise InvalidArgument(f"{where}.skip_special_tokens must be true or false")
    return stops, skip


class DetokenizeInstance:
    """One tokenizer; every request row is decoded on its own."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self.spec = spec
        _check_tensors(spec)
        try:
            skip = parameter(spec, "skip_special_tokens", True, bool)
        except InvalidArgument as exc:
            raise ConfigError(str(exc)) from exc
        path = spec.model_file("tokenizer.json")
        if not path.is_file():
            raise ConfigError(
                f"model '{spec.name}' version {spec.version}: no {path.name} in {spec.path}"
            )
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ConfigError(f"{path}: not a tokenizers file: {exc}") from exc
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.decoder = IncrementalDecoder(tokenizer, skip)

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Decode each request (a bad one fails alone)."""
        results: list[InferResponse | Exception] = []
        for request in requests:
            try:
                results.append(self._one(request))
            except InvalidArgument as exc:
                results.append(exc)
        return results

    def runs_inline(self, requests: list[InferRequest]) -> bool:
        """True for short sequences (a generation's first hundreds of tokens)."""
        return sum(request.inputs[OUTPUT_IDS].size for request in requests) <= INLINE_IDS

    def close(self) -> None:
        """Nothing to release."""

    def _one(self, request: InferRequest) -> InferResponse:
        where = f"model '{self.spec.name}'"
        ids = request.inputs[OUTPUT_IDS]
        rows = ids.reshape(int(np.prod(ids.shape[:-1])), ids.shape[-1])  # [n] -> [1, n]
        shape = request.inputs[NEW_TOKENS].shape
        new = request.inputs[NEW_TOKENS].reshape(-1)
        finish = request.inputs[ENGINE_FINISH].reshape(-1)
        sampling = request.inputs.get(SAMPLING)
        samplings = sampling.reshape(-1) if sampling is not None else [b"{}"] * len(new)
        if not len(rows) == len(new) == len(finish) == len(samplings):
            raise InvalidArgument(
                f"{where}: {OUTPUT_IDS}, {NEW_TOKENS}, {ENGINE_FINISH} and {SAMPLING} "
                "must have the same number of rows"
            )
        texts, reasons = [], []
        outputs = {}
        if TOKEN_LOGPROBS in (request.requested_outputs or _OUTPUTS):
            table = self._logprobs(request) if len(new) == 1 else ""
            outputs[TOKEN_LOGPROBS] = np.array([table.encode()] * len(new), dtype=object)
        for row in range(len(new)):
            label = f"{where}: row {row}" if len(new) > 1 else where
            text, reason = self._row(rows[row], int(new[row]), finish[row], samplings[row], label)
            texts.append(text.encode())
            reasons.append(reason.encode())
        outputs[TEXT_DELTA] = np.array(texts, dtype=object)
        outputs[FINISH_REASON] = np.array(reasons, dtype=object)
        return InferResponse(outputs={k: v.reshape(shape) for k, v in outputs.items()})

    def _logprobs(self, request: InferRequest) -> str:
        """The new tokens' logprobs as JSON, with the token strings; "" if none came."""
        ids, values = request.inputs.get(LOGPROB_IDS), request.inputs.get(LOGPROBS)
        if ids is None or values is None or ids.size == 0:
            return ""
        if ids.shape != values.shape or ids.min() < 0 or ids.max() >= self.vocab_size:
            raise InvalidArgument(
                f"model '{self.spec.name}': {LOGPROB_IDS} must match {LOGPROBS} in shape "
                f"and hold ids in 0..{self.vocab_size - 1}"
            )
        return token_logprobs(self.decoder.tokenizer, ids.reshape(-1, ids.shape[-1]), values)

    def _row(
        self, ids: np.ndarray, new: int, finish: Any, sampling: Any, where: str
    ) -> tuple[str, str]:
        if not 0 <= new <= len(ids):
            raise InvalidArgument(
                f"{where}: {NEW_TOKENS} = {new} is outside 0..{len(ids)} (the {OUTPUT_IDS} sent)"
            )
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise InvalidArgument(
                f"{where}: {OUTPUT_IDS} holds ids outside the vocabulary 0..{self.vocab_size - 1}"
            )
        try:
            engine_finish = bytes(finish).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"{where}: {ENGINE_FINISH} is not UTF-8") from exc
        skip = self.decoder.skip_special_tokens
        stops, skip = row_settings(sampling, f"{where}: {SAMPLING}", skip)
        return self.decoder.delta(ids.tolist(), new, engine_finish, stops, skip)


def _check_tensors(spec: ModelSpec) -> None:
    where = f"model '{spec.name}'"
    for kind, tensors, expected in (
        ("input", spec.config.input, _INPUTS),
        ("output", spec.config.output, _OUTPUTS),
    ):
        declared = {tensor.name: tensor for tensor in tensors}
        required = set(expected) - OPTIONAL
        if not required <= set(declared) <= set(expected):
            optional = sorted(set(expected) & OPTIONAL)
            raise ConfigError(
                f"{where}: {kind}s must be {sorted(required)}"
                + f" and optionally {optional}"
                + f", got {sorted(declared)}"
            )
        for name, tensor in declared.items():
            data_type, dims = expected[name]
            if tensor.data_type != data_type or list(tensor.dims) != dims:
                type_name = mc.DataType.Name(data_type)
                raise ConfigError(f"{where}: {kind} '{name}' must be {type_name} with dims {dims}")


class DetokenizeBackend:
    """Creates DetokenizeInstance objects."""

    name = "detokenize"

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> DetokenizeInstance:
        """Load the tokenizer (in the instance's own thread)."""
        return DetokenizeInstance(model, instance)
