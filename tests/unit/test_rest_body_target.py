"""KServe v2 REST bodies may repeat the URL's model and version (KServe's own
clients do); what agrees passes, what contradicts the URL is a 400 naming both."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.http.rest import parse_infer
from shared.errors import InvalidArgument

INPUTS = [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]


def _parse(url_model: str, url_version: str, **fields: Any) -> tuple[str, str]:
    body = json.dumps({**fields, "inputs": INPUTS}).encode()
    request = parse_infer(url_model, url_version, body, None).request
    return request.model_name, request.model_version


def test_fields_that_agree_with_the_url_pass() -> None:
    assert _parse("mlp", "", model_name="mlp") == ("mlp", "")
    assert _parse("mlp", "1", model_name="mlp", model_version="1") == ("mlp", "1")
    assert _parse("mlp", "1", model_version="") == ("mlp", "1")


def test_a_body_version_applies_where_the_url_names_none() -> None:
    assert _parse("mlp", "", model_name="mlp", model_version="2") == ("mlp", "2")


def test_a_contradicting_model_name_is_refused_naming_both() -> None:
    with pytest.raises(InvalidArgument) as caught:
        _parse("mlp", "", model_name="simple")
    assert caught.value.http_status == 400
    assert str(caught.value) == (
        "model_name 'simple' in the request body contradicts the model 'mlp' in the URL"
    )


def test_a_contradicting_version_is_refused_naming_both() -> None:
    with pytest.raises(InvalidArgument, match="model_version '3' .* version '1' in the URL"):
        _parse("mlp", "1", model_version="3")


def test_the_message_is_bounded() -> None:
    with pytest.raises(InvalidArgument) as caught:
        _parse("mlp", "", model_name="m" * 10_000)
    assert len(str(caught.value)) < 300
