"""The detokenizer turns streamed SmolLM2 ids into text exactly, without state.

Text is tokenized with SmolLM2's own tokenizer (from the prepared
``smollm2_detokenizer`` folder) and fed back one token at a time, the way the
engine streams it: the deltas must add up to the text, characters split across
tokens must appear whole, and stop strings must end the text right before them
wherever the token boundaries fall.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from models.prepare import prepare_repository
from services.postprocess.detokenize import (
    DetokenizeInstance,
    IncrementalDecoder,
    row_settings,
)
from shared.backend import InstanceSpec, ModelSpec, config_parameters
from shared.errors import InvalidArgument
from shared.repository import ModelRepository
from shared.request import InferRequest
from tests.conftest import cache_dir

MODEL = "smollm2_detokenizer"
MULTI_BYTE = "héllo 世界 🎉 naïve café, 日本語のテキスト 👩‍💻 done."


@pytest.fixture(scope="module")
def folder() -> Path:
    repository = prepare_repository(cache_dir(), models=[MODEL], echo=lambda _: None)
    return repository / MODEL


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "1" / "tokenizer.json"))


@pytest.fixture(scope="module")
def decoder(tokenizer: Tokenizer) -> IncrementalDecoder:
    return IncrementalDecoder(tokenizer)


def stream(
    decoder: IncrementalDecoder, ids: list[int], stops: Sequence[str] = (), finish: str = "length"
) -> Iterator[tuple[str, str]]:
    """Feed ``ids`` one at a time, as cumulative OUTPUT_IDS; the last response is final."""
    for count in range(1, len(ids) + 1):
        engine_finish = finish if count == len(ids) else ""
        delta, reason = decoder.delta(ids[:count], 1, engine_finish, stops)
        yield delta, reason
        if reason:
            return


def test_multi_byte_text_reassembles_exactly_one_token_at_a_time(
    decoder: IncrementalDecoder, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(MULTI_BYTE).ids
    # The emoji and CJK characters span several byte-level tokens each.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas = list(stream(decoder, ids))
    assert "".join(delta for delta, _ in deltas) == MULTI_BYTE
    assert not any("\ufffd" in delta for delta, _ in deltas)
    assert [reason for _, reason in deltas] == [""] * (len(ids) - 1) + ["length"]


def test_several_new_tokens_per_response_give_the_same_text(
    decoder: IncrementalDecoder, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(MULTI_BYTE).ids
    text, sent = "", 0
    for end in [*range(3, len(ids), 3), len(ids)]:
        delta, _ = decoder.delta(ids[:end], end - sent, "stop" if end == len(ids) else "")
        text, sent = text + delta, end
    assert text == MULTI_BYTE


def test_special_tokens_such_as_end_of_turn_are_not_text(
    decoder: IncrementalDecoder, tokenizer: Tokenizer
) -> None:
    end_of_turn = tokenizer.token_to_id("<|im_end|>")
    ids = [*tokenizer.encode("Paris.").ids, end_of_turn]
    assert "".join(delta for delta, _ in stream(decoder, ids, finish="stop")) == "Paris."


@pytest.mark.parametrize("stop", ["France is Par", "is P", "\n\n", "🎉"])
def test_stop_string_across_token_boundaries_ends_the_text_before_it(
    decoder: IncrementalDecoder, tokenizer: Tokenizer, stop: str
) -> None:
    text = "The capital of France is Paris 🎉\n\nIt is lovely."
    ids = tokenizer.encode(text).ids
    deltas = list(stream(decoder, ids, [stop, "never appears"]))
    assert deltas[-1][1] == "stop"
    assert "".join(delta for delta, _ in deltas) == text[: text.index(stop)]
    assert len(deltas) < len(ids)  # stopped before the engine did


def test_text_held_back_for_a_stop_string_is_released_when_it_does_not_match(
    decoder: IncrementalDecoder, tokenizer: Tokenizer
) -> None:
    text = "The capital is Paradise"
    ids = tokenizer.encode(text).ids
    deltas = list(stream(decoder, ids, ["Paris"], finish="length"))
    assert "".join(delta for delta, _ in deltas) == text
    assert deltas[-1][1] == "length"
    # While "Par" could still become "Paris" it was held back, not sent.
    partial = decoder.visible(tokenizer.encode("The capital is Par").ids, ["Paris"], final=False)
    assert partial == ("The capital is ", False)


def test_stops_and_skip_special_tokens_come_from_the_sampling_json() -> None:
    def settings(raw: bytes) -> tuple[list[str], bool]:
        return row_settings(raw, "SAMPLING", True)

    assert settings(b'{"stop": ["a", "bc"], "temperature": 0}') == (["a", "bc"], True)
    assert settings(b'{"stop": "end", "skip_special_tokens": false}') == (["end"], False)
    assert settings(b"{}") == ([], True)
    assert row_settings(b"{}", "SAMPLING", False) == ([], False)
    bad_ones = (b'{"stop": [""]}', b'{"stop": [1]}', b"[]", b"{not json")
    for bad in (*bad_ones, b'{"skip_special_tokens": "no"}'):
        with pytest.raises(InvalidArgument, match="SAMPLING"):
            settings(bad)


@pytest.fixture(scope="module")
def instance(folder: Path) -> DetokenizeInstance:
    entry = ModelRepository(folder.parent).entry(MODEL)
    spec = ModelSpec(MODEL, 1, entry.version_path(1), entry.config, config_parameters(entry.config))
    return DetokenizeInstance(spec, InstanceSpec(f"{MODEL}_0", "KIND_CPU", "cpu", 1))


def request(ids: list[int], new: int, finish: bytes = b"", sampling: bytes | None = None) -> Any:
    inputs = {
        "OUTPUT_IDS": np.array(ids, dtype=np.int64),
        "NEW_TOKENS": np.array([new], dtype=np.int32),
        "ENGINE_FINISH": np.array([finish], dtype=object),
    }
    if sampling is not None:
        inputs["SAMPLING"] = np.array([sampling], dtype=object)
    return InferRequest(model_name=MODEL, model_version="1", inputs=inputs)


def test_backend_answers_text_delta_and_finish_reason(
    instance: DetokenizeInstance, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("Hello there, general Kenobi").ids
    sampling = json.dumps({"stop": ["general"], "max_tokens": 9}).encode()
    (running, stopped) = instance.execute(
        [request(ids[:2], 2, sampling=sampling), request(ids, len(ids) - 2, sampling=sampling)]
    )
    assert not isinstance(running, Exception) and not isinstance(stopped, Exception)
    assert running.outputs["TEXT_DELTA"].tolist() == [b"Hello there"]
    assert running.outputs["FINISH_REASON"].tolist() == [b""]
    assert stopped.outputs["TEXT_DELTA"].tolist() == [b", "]
    assert stopped.outputs["FINISH_REASON"].tolist() == [b"stop"]


def test_a_request_may_keep_special_tokens(
    instance: DetokenizeInstance, tokenizer: Tokenizer
) -> None:
    ids = [*tokenizer.encode("Paris.").ids, tokenizer.token_to_id("<|im_end|>")]
    keep = json.dumps({"skip_special_tokens": False}).encode()
    (skipped, kept) = instance.execute(
        [request(ids, len(ids), b"stop"), request(ids, len(ids), b"stop", sampling=keep)]
    )
    assert not isinstance(skipped, Exception) and not isinstance(kept, Exception)
    assert skipped.outputs["TEXT_DELTA"].tolist() == [b"Paris."]
    assert kept.outputs["TEXT_DELTA"].tolist() == [b"Paris.<|im_end|>"]


@pytest.mark.parametrize(
    ("inputs", "named"),
    [
        ({"ids": [1, 2], "new": 3}, "NEW_TOKENS"),
        ({"ids": [1, 10**9], "new": 1}, "OUTPUT_IDS"),
        ({"ids": [1, 2], "new": 1, "sampling": b"{oops"}, "SAMPLING"),
        ({"ids": [1, 2], "new": 1, "finish": b"\xff"}, "ENGINE_FINISH"),
    ],
)
def test_a_bad_request_fails_alone_naming_the_tensor(
    instance: DetokenizeInstance, inputs: dict[str, Any], named: str
) -> None:
    bad = request(inputs["ids"], inputs["new"], inputs.get("finish", b""), inputs.get("sampling"))
    good = request([19556], 1)
    result, fine = instance.execute([bad, good])
    assert isinstance(result, InvalidArgument) and named in str(result)
    assert not isinstance(fine, Exception)
    assert fine.outputs["TEXT_DELTA"].tolist() == [b"Hello"]


def test_short_sequences_run_inline_long_ones_in_the_instance_thread(
    instance: DetokenizeInstance,
) -> None:
    assert instance.runs_inline([request(list(range(100, 600)), 1)])
    assert not instance.runs_inline([request(list(range(100, 400)), 1)] * 2)


def test_logprobs_come_back_with_each_token_decoded_alone(
    instance: DetokenizeInstance, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(" Paris é").ids  # "é" is two byte-level tokens' worth
    message = request(ids, len(ids))
    columns = np.array([[i, 504] for i in ids], dtype=np.int64)  # sampled, then an alternative
    message.inputs["LOGPROB_IDS"] = columns
    message.inputs["LOGPROBS"] = np.full(columns.shape, -0.25, dtype=np.float32)
    (answer,) = instance.execute([message])
    assert not isinstance(answer, Exception)
    rows = json.loads(answer.outputs["TOKEN_LOGPROBS"][0])
    assert [row[0][0] for row in rows] == ids
    assert [row[0][2] for row in rows] == [tokenizer.decode([i]) for i in ids]
    assert {row[1][2] for row in rows} == {tokenizer.decode([504])}
    assert {value for row in rows for _, value, _ in row} == {-0.25}
    # Without logprobs the output is there, and empty.
    (plain,) = instance.execute([request(ids, len(ids))])
    assert not isinstance(plain, Exception)
    assert plain.outputs["TOKEN_LOGPROBS"].tolist() == [b""]
