"""The SAMPLING fields beyond the basic ones: penalties, logit bias, logprobs, structure.

``vllm_settings.Sampling`` holds them; this module checks the ones that are
not plain numbers (``ignore_eos``, ``logit_bias``, ``structured``), gives the
ranges of all of them (as vLLM's own, so the error names the field before
vLLM sees it), and turns them into vLLM's ``SamplingParams`` keywords.
``structured`` becomes vLLM's ``StructuredOutputsParams``, served by the
engine's own structured-output backend (xgrammar, llguidance or outlines).

No vLLM import at module level.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np

from shared.errors import InvalidArgument


class Sampling(Protocol):
    """The fields of vllm_settings.Sampling this module reads."""

    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def structured(self) -> tuple[tuple[str, Any], ...]: ...


MAX_LOGPROBS = 20
"""The most top alternatives per token (OpenAI's and vLLM's default limit)."""
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The constraints ``structured`` takes (vLLM's StructuredOutputsParams fields)."""


def other_field(key: str, value: Any, where: str) -> Any:
    """``ignore_eos``, ``logit_bias`` or ``structured`` as the Sampling field's type."""
    if key == "ignore_eos":
        if not isinstance(value, bool):
            raise InvalidArgument(f"{where} must be true or false, got {value!r}")
        return value
    if key == "logit_bias":
        return _logit_bias(value, where)
    return _structured(value, where)


def _logit_bias(value: Any, where: str) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be an object of token id -> bias, got {value!r}")
    pairs = []
    for key, bias in value.items():
        token = str(key)
        if not token.isdigit():
            raise InvalidArgument(f"{where}: key {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise InvalidArgument(f"{where}.{token} must be a number, got {bias!r}")
        if not -100 <= bias <= 100:
            raise InvalidArgument(f"{where}.{token} must be in -100..100, got {bias}")
        pairs.append((int(token), float(bias)))
    return tuple(pairs)


def _structured(value: Any, where: str) -> tuple[tuple[str, Any], ...]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be an object, got {value!r}")
    given = {k: v for k, v in value.items() if v is not None}
    unknown = sorted(set(given) - set(STRUCTURED_KINDS))
    if unknown:
        raise InvalidArgument(f"{where}: unknown field(s) {unknown}; expected {STRUCTURED_KINDS}")
    if len(given) != 1:
        raise InvalidArgument(f"{where}: give exactly one of {', '.join(STRUCTURED_KINDS)}")
    ((kind, spec),) = given.items()
    fits = {
        "json": isinstance(spec, dict | str),
        "json_object": spec is True,
        "regex": isinstance(spec, str) and bool(spec),
        "grammar": isinstance(spec, str) and bool(spec),
        "choice": isinstance(spec, list) and bool(spec) and all(isinstance(c, str) for c in spec),
    }
    if not fits[kind]:
        raise InvalidArgument(f"{where}.{kind}: not a valid {kind} constraint: {spec!r}")
    if kind == "json" and isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise InvalidArgument(f"{where}.json: not a JSON schema: {exc}") from exc
    if kind == "choice":
        spec = tuple(spec)
    return ((kind, spec),)


def extra_rules(sampling: Sampling) -> list[tuple[str, bool, str]]:
    """(field, holds, rule) for the fields of this module, as ``Sampling.check`` reads them."""
    logprobs = sampling.logprobs
    return [
        ("presence_penalty", -2.0 <= sampling.presence_penalty <= 2.0, "must be in -2..2"),
        ("frequency_penalty", -2.0 <= sampling.frequency_penalty <= 2.0, "must be in -2..2"),
        ("min_p", 0.0 <= sampling.min_p <= 1.0, "must be in 0..1"),
        ("min_tokens", sampling.min_tokens >= 0, "must be at least 0"),
        (
            "logprobs",
            logprobs is None or 0 <= logprobs <= MAX_LOGPROBS,
            f"must be in 0..{MAX_LOGPROBS}",
        ),
    ]


def extra_params(sampling: Sampling) -> dict[str, Any]:
    """vLLM SamplingParams keywords for the fields of this module."""
    params: dict[str, Any] = {
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "min_p": sampling.min_p,
        "min_tokens": sampling.min_tokens,
        "ignore_eos": sampling.ignore_eos,
        "logprobs": sampling.logprobs,
    }
    if sampling.logit_bias:
        params["logit_bias"] = dict(sampling.logit_bias)
    if sampling.structured:
        from vllm.sampling_params import StructuredOutputsParams

        ((kind, spec),) = sampling.structured
        value = list(spec) if kind == "choice" else spec
        params["structured_outputs"] = StructuredOutputsParams(**{kind: value})
    return params


def logprob_arrays(logprobs: Any, new: list[int], top: int | None) -> tuple[np.ndarray, np.ndarray]:
    """One engine step's logprobs as ``LOGPROB_IDS`` INT64 and ``LOGPROBS`` FP32, both
    [new tokens, 1 + top]: column 0 the sampled token, then the ``top`` likeliest by
    rank. Empty ([0, 0]) when the request asked for none."""
    if top is None or logprobs is None:
        return _NO_IDS, _NO_VALUES
    ids = np.zeros((len(new), 1 + top), dtype=np.int64)
    values = np.zeros((len(new), 1 + top), dtype=np.float32)
    for row, (token, position) in enumerate(zip(new, logprobs, strict=False)):
        ids[row, 0], values[row, 0] = token, position[token].logprob
        ranked = sorted(position.items(), key=lambda item: item[1].rank)
        for column, (candidate, logprob) in enumerate(ranked[:top], start=1):
            ids[row, column], values[row, column] = candidate, logprob.logprob
    return ids, values


_NO_IDS = np.zeros((0, 0), dtype=np.int64)
_NO_VALUES = np.zeros((0, 0), dtype=np.float32)
