"""Checks for the OpenAI fields beyond plain numbers: logit bias, output structure,
tools, stream options. Each raises ``InvalidParam`` naming the field.

``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` and its older ``guided_*`` fields all become one
``StructuredOutput``, as vLLM's server folds them into one
``StructuredOutputsParams`` (``response_format`` wins).

Nothing here knows aiohttp or gRPC beyond the messages it builds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2

from gateway.http.openai_protocol import InvalidParam
from meshserve.v1 import meshserve_pb2 as api
from shared.jsontext import kind

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older names for the structured_outputs fields, still sent by some clients."""
_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def logit_bias(value: Any, name: str = "logit_bias") -> dict[int, float]:
    """OpenAI's ``logit_bias``: token id (a string in JSON) -> bias in -100..100."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParam(name, f"expected an object of token id -> bias, got {kind(value)}")
    bias = {}
    for key, number in value.items():
        if not str(key).isdigit() or int(key) > 2**31 - 1:
            raise InvalidParam(f"{name}.{key}", "keys are token ids (integers >= 0)")
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise InvalidParam(f"{name}.{key}", f"expected a number, got {kind(number)}")
        if not -100 <= number <= 100:
            raise InvalidParam(f"{name}.{key}", f"must be between -100 and 100, got {number}")
        bias[int(key)] = float(number)
    return bias


def _schema_text(schema: Any, name: str) -> str:
    if not isinstance(schema, dict):
        raise InvalidParam(name, f"expected a JSON schema object, got {kind(schema)}")
    return json.dumps(schema)


def response_format(value: Any) -> api.StructuredOutput | None:
    """``response_format``: text (None), json_object, or json_schema with its schema."""
    name = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidParam(name, "expected an object with a string 'type'")
    kind_ = value["type"]
    if kind_ == "text":
        return None
    if kind_ == "json_object":
        return api.StructuredOutput(json_object=True)
    if kind_ != "json_schema":
        raise InvalidParam(
            f"{name}.type", f"expected text, json_object or json_schema, got {kind_!r}"
        )
    schema = value.get("json_schema")
    if not isinstance(schema, dict):
        message = "required when type is 'json_schema' (an object with 'name' and 'schema')"
        raise InvalidParam(f"{name}.json_schema", message)
    if "schema" not in schema:
        raise InvalidParam(f"{name}.json_schema.schema", "required: the JSON schema")
    return api.StructuredOutput(
        json_schema=_schema_text(schema["schema"], f"{name}.json_schema.schema")
    )


def structured_outputs(value: Any, name: str = "structured_outputs") -> api.StructuredOutput | None:
    """vLLM's ``structured_outputs``: exactly one of json, json_object, regex, choice, grammar."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParam(name, f"expected an object, got {kind(value)}")
    given = {k: v for k, v in value.items() if k in _STRUCTURED_KINDS and v not in (None, False)}
    if len(given) != 1:
        raise InvalidParam(name, f"give exactly one of {', '.join(_STRUCTURED_KINDS)}")
    ((key, spec),) = given.items()
    where = name if name in GUIDED else f"{name}.{key}"
    if key == "json":
        schema = json.loads(spec) if isinstance(spec, str) and spec.startswith("{") else spec
        return api.StructuredOutput(json_schema=_schema_text(schema, where))
    if key == "json_object":
        return api.StructuredOutput(json_object=True)
    if key == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
            raise InvalidParam(where, "expected a non-empty list of strings")
        return api.StructuredOutput(choice=spec)
    if not isinstance(spec, str) or not spec:
        raise InvalidParam(where, f"expected a non-empty string, got {kind(spec)}")
    if key == "regex":
        return api.StructuredOutput(regex=spec)
    return api.StructuredOutput(grammar=spec)


def guided(body: dict[str, Any]) -> api.StructuredOutput | None:
    """The older ``guided_*`` fields, as structured_outputs."""
    given = {GUIDED[k]: v for k, v in body.items() if k in GUIDED and v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise InvalidParam(sorted(k for k in body if k in GUIDED)[1], "give one guided_* field")
    ((key, spec),) = given.items()
    field = next(k for k, v in GUIDED.items() if v == key)
    if key == "json" and isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise InvalidParam(field, f"not a JSON schema: {exc}") from None
    return structured_outputs({key: spec}, field)


def tools(value: Any) -> list[struct_pb2.Struct]:
    """``tools``: a list of ``{"type": "function", "function": {"name": ...}}``."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidParam("tools", f"expected a list of tools, got {kind(value)}")
    structs = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidParam(f"{where}.type", "expected 'function'")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidParam(f"{where}.function.name", "required: the function's name")
        struct = struct_pb2.Struct()
        struct.update(tool)
        structs.append(struct)
    return structs


def tool_choice(value: Any, tools_given: bool) -> str | None:
    """``tool_choice``: none, auto, required, or a named function (its name)."""
    if value is None or value == "none":
        return None
    if value in ("auto", "required"):
        if not tools_given:
            raise InvalidParam("tool_choice", f"'{value}' needs tools")
        return str(value)
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        message = "expected none, auto, required or {type: function, function: {name}}"
        raise InvalidParam("tool_choice", message)
    if not tools_given:
        raise InvalidParam("tool_choice", "a named function needs tools")
    return str(function["name"])


@dataclass(frozen=True)
class StreamOptions:
    """``stream_options``: a last usage chunk, and usage in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


def stream_options(value: Any) -> StreamOptions:
    """``stream_options`` (null: neither)."""
    if value is None:
        return StreamOptions()
    if not isinstance(value, dict):
        raise InvalidParam("stream_options", f"expected an object, got {kind(value)}")
    flags = {}
    for key in ("include_usage", "continuous_usage_stats"):
        flag = value.get(key) or False
        if not isinstance(flag, bool):
            raise InvalidParam(f"stream_options.{key}", f"expected a boolean, got {kind(flag)}")
        flags[key] = flag
    return StreamOptions(**flags)
