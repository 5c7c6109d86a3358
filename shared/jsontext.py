"""JSON text from clients, read strictly enough that its values fit a protobuf.

Python's ``json.loads`` takes two things that only fail later, as internal
errors: an escaped lone surrogate (``"\\udcff"``), a str that no UTF-8 protobuf
string, tokenizer or encoder can hold; and nesting deep enough to raise
RecursionError. ``parse`` (pydantic-core's parser, with Python's values: big
integers exact, NaN and Infinity taken) refuses both with a ValueError that
gives the line and column, as it does any other malformed text and invalid
UTF-8, so the caller answers INVALID_ARGUMENT / 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json

from shared.errors import InvalidArgument


def parse(text: bytes | str) -> Any:
    """JSON text as Python values; ValueError (line and column) when it is not
    well-formed Unicode JSON or nests deeper than 200 levels (pydantic-core's fixed
    limit, far beyond any request's); TypeError when ``text`` is neither bytes nor str."""
    return from_json(text)


def kind(value: Any) -> str:
    """The JSON type name of a parsed value, for error messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}
    return "null" if value is None else names.get(type(value), "object")


def parse_object(text: bytes | str, what: str = "the request body") -> dict[str, Any]:
    """JSON text that must hold an object, parsed as ``parse`` does; otherwise
    InvalidArgument naming ``what`` ("the request body", "line 7")."""
    try:
        document = from_json(text)
    except ValueError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise InvalidArgument(f"{what} must be a JSON object, got {kind(document)}")
    return document
