"""The spec's JSON documents for everything but inference, to and from v2 protos.

Responses are the proto's JSON form with the proto field names (what Triton
answers: ``max_batch_size``, ``TYPE_FP32``), every field present, and 64-bit
integers as JSON numbers: protobuf's JSON mapping writes them as strings, but
v2 REST clients read shapes and counters as numbers. Two documents are not a
message's JSON form: the repository index is a bare array, and a model
config is the config itself, not ``{"config": ...}``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from inference import grpc_service_pb2 as pb
from shared import jsontext
from shared.errors import InvalidArgument

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def to_json(message: Message) -> dict[str, Any]:
    """A message as a JSON document (proto field names, all fields, int64 as numbers)."""
    document = json_format.MessageToDict(
        message,
        always_print_fields_with_no_presence=True,
        preserving_proto_field_name=True,
    )
    _int64_as_numbers(message.DESCRIPTOR, document)
    return document


def _int64_as_numbers(descriptor: Any, document: dict[str, Any]) -> None:
    for field in descriptor.fields:
        value = document.get(field.name)
        if value is None:
            continue
        message_type = field.message_type
        if message_type is not None and message_type.GetOptions().map_entry:
            _map_values(message_type.fields_by_name["value"], value)
        elif message_type is not None:
            for item in value if field.is_repeated else [value]:
                _int64_as_numbers(message_type, item)
        elif field.type in _INT64_TYPES:
            document[field.name] = [int(v) for v in value] if field.is_repeated else int(value)


def _map_values(field: FieldDescriptor, mapping: dict[str, Any]) -> None:
    if field.message_type is not None:
        for item in mapping.values():
            _int64_as_numbers(field.message_type, item)
    elif field.type in _INT64_TYPES:
        for key, item in mapping.items():
            mapping[key] = int(item)


def model_config(response: pb.ModelConfigResponse) -> dict[str, Any]:
    """GET .../config: the model configuration itself."""
    return to_json(response.config)


def repository_index(response: pb.RepositoryIndexResponse) -> list[dict[str, Any]]:
    """POST /v2/repository/index: a bare array of ``{name, version, state, reason}``."""
    return [to_json(model) for model in response.models]


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """A request body that must be a JSON object; an empty body is ``{}``."""
    if not body.strip():
        return {}
    try:
        document = jsontext.parse(body)
    except ValueError as exc:
        raise InvalidArgument(f"{what}: malformed JSON in the request body: {exc}") from exc
    if not isinstance(document, dict):
        raise InvalidArgument(f"{what}: the request body must be a JSON object")
    return document


def index_request(body: bytes) -> pb.RepositoryIndexRequest:
    """``{"ready": bool}`` (optional) -> RepositoryIndexRequest."""
    document = json_object(body, "repository index")
    ready = document.get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidArgument(f"repository index: 'ready' must be a boolean, got {ready!r}")
    return pb.RepositoryIndexRequest(
        repository_name=str(document.get("repository_name", "")), ready=ready
    )


def _repository_parameters(target: Any, body: bytes, what: str) -> None:
    parameters = json_object(body, what).get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{what}: 'parameters' must be a JSON object")
    for key, value in parameters.items():
        param = target[key]
        if key.startswith("file:"):
            # The spec sends file contents base64-encoded in a JSON string.
            try:
                param.bytes_param = base64.b64decode(str(value), validate=True)
            except binascii.Error as exc:
                raise InvalidArgument(f"{what}: parameter '{key}' is not base64: {exc}") from exc
        elif isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            param.int64_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise InvalidArgument(
                f"{what}: parameter '{key}' must be a boolean, 64-bit integer or string, "
                f"got {type(value).__name__}"
            )


def load_request(name: str, body: bytes) -> pb.RepositoryModelLoadRequest:
    """``{"parameters": {"config": str, "file:...": base64}}`` -> the load request."""
    request = pb.RepositoryModelLoadRequest(model_name=name)
    _repository_parameters(request.parameters, body, f"load '{name}'")
    return request


def unload_request(name: str, body: bytes) -> pb.RepositoryModelUnloadRequest:
    """``{"parameters": {"unload_dependents": bool}}`` -> the unload request."""
    request = pb.RepositoryModelUnloadRequest(model_name=name)
    _repository_parameters(request.parameters, body, f"unload '{name}'")
    return request


def log_settings_request(body: bytes) -> pb.LogSettingsRequest:
    """``{"log_verbose_level": 1, ...}`` (the settings to change; none: read them)."""
    request = pb.LogSettingsRequest()
    for key, value in json_object(body, "logging").items():
        setting = request.settings[key]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int) and 0 <= value < 2**32:
            setting.uint32_param = value
        elif isinstance(value, str):
            setting.string_param = value
        else:
            raise InvalidArgument(
                f"logging: '{key}' must be a boolean, an unsigned 32-bit integer or a "
                f"string, got {value!r}"
            )
    return request


def log_settings(response: pb.LogSettingsResponse) -> dict[str, Any]:
    """The log settings as Triton's ``GET /v2/logging`` shows them: name -> value."""
    return {
        key: getattr(value, value.WhichOneof("parameter_choice"))
        for key, value in response.settings.items()
        if value.WhichOneof("parameter_choice")
    }


def trace_settings_request(model: str, body: bytes) -> pb.TraceSettingRequest:
    """``{"trace_level": ["TIMESTAMPS"], "trace_rate": "100", ...}``: a string or a
    list of strings per setting; null clears it."""
    request = pb.TraceSettingRequest(model_name=model)
    for key, value in json_object(body, "trace setting").items():
        values = [value] if isinstance(value, str) else [] if value is None else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise InvalidArgument(
                f"trace setting: '{key}' must be a string, a list of strings or null, got {value!r}"
            )
        request.settings[key].value.extend(values)
    return request


def trace_settings(response: pb.TraceSettingResponse) -> dict[str, Any]:
    """The trace settings as Triton shows them: ``trace_level`` a list, the rest a
    string where they hold one value."""
    return {
        key: values[0] if len(values) == 1 and key != "trace_level" else values
        for key, values in ((k, list(v.value)) for k, v in response.settings.items())
    }
