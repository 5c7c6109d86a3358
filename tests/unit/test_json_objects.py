"""JSON objects from clients: one parser for request bodies and batch lines."""

from __future__ import annotations

import pytest

from services.batch.lines import parse_file
from shared.errors import InvalidArgument
from shared.jsontext import parse_object

GOOD = b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}'


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (b'{"a": ', "the request body is not valid JSON"),
        (b'"\\udcff"', "the request body is not valid JSON"),
        (b"[" * 300 + b"]" * 300, "the request body is not valid JSON"),
        (b"[1, 2]", "the request body must be a JSON object, got array"),
        (b"null", "the request body must be a JSON object, got null"),
    ],
)
def test_a_body_that_is_no_object_is_invalid_argument(text: bytes, problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        parse_object(text)


def test_an_object_parses_with_exact_integers() -> None:
    assert parse_object(b'{"n": 123456789012345678901234567890}') == {
        "n": 123456789012345678901234567890
    }


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (b'{"custom_id": "b", "body": "\\udcff"}', "line 2 is not valid JSON"),
        (b"[]", "line 2 must be a JSON object, got array"),
    ],
)
def test_a_batch_file_names_the_line_the_parser_refuses(bad: bytes, problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        parse_file(GOOD + b"\n" + bad + b"\n")
    assert [line.custom_id for line in parse_file(GOOD + b"\n")] == ["a"]
