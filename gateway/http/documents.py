"""The spec's JSON documents for everything but inference, to and from v2 protos.

Responses are the proto's JSON form as Triton writes it (``shared.protojson``:
proto field names, every field present, 64-bit integers as numbers). Two
documents are not a message's JSON form: the repository index is a bare
array, and a model config is the config itself, not ``{"config": ...}``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from inference import grpc_service_pb2 as pb
from shared import jsontext
from shared.errors import InvalidArgument
from shared.protojson import to_json


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
    return jsontext.parse_object(body, f"{what}: the request body")


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


def region_register_request(name: str, body: bytes) -> pb.SystemSharedMemoryRegisterRequest:
    """``{"key": str, "offset": int, "byte_size": int}`` -> the register request."""
    what = f"shared-memory region '{name:.200}'"
    document = json_object(body, what)
    key = document.get("key")
    if not isinstance(key, str):
        raise InvalidArgument(f"{what}: 'key' must be the shared-memory object's name")
    sizes = {field: document.get(field, 0) for field in ("offset", "byte_size")}
    for field, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
            raise InvalidArgument(f"{what}: '{field}' must be a byte count, got {value!r:.40}")
    return pb.SystemSharedMemoryRegisterRequest(name=name, key=key, **sizes)


def region_status(answer: pb.SystemSharedMemoryStatusResponse) -> list[dict[str, Any]]:
    """The regions as Triton's status list: name, key, offset, byte_size."""
    return [
        {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
        for r in answer.regions.values()
    ]
