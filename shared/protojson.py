"""Protobuf messages as the JSON documents Triton writes (model configs, indexes).

The proto's JSON form with the proto field names (``max_batch_size``,
``TYPE_FP32``), every field present, and 64-bit integers as JSON numbers:
protobuf's JSON mapping writes them as strings, but v2 REST clients and
Python-backend models read shapes and counters as numbers (``dims[0] == 1``).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

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
