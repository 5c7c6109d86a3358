"""The orchestrator's side of n choices, logprobs and structured output (generation.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable

import pytest

from meshserve.v1 import meshserve_pb2 as api
from services.orchestrator.generation import (
    choice_count,
    choice_sampling,
    merged,
    sampling_settings,
    token_logprobs,
)
from shared.errors import InvalidArgument, Unavailable


def test_choice_i_samples_with_seed_plus_i_as_vllm_children_do() -> None:
    settings = sampling_settings(api.SamplingParams(n=3, seed=1234, temperature=1.0))
    assert "n" not in settings  # each choice is a stream of its own
    seeds = [json.loads(choice_sampling(settings, i))["seed"] for i in range(3)]
    assert seeds == [1234, 1235, 1236]
    unseeded = sampling_settings(api.SamplingParams(n=2))
    assert "seed" not in json.loads(choice_sampling(unseeded, 1))
    assert choice_count(api.SamplingParams()) == 1
    with pytest.raises(InvalidArgument, match="sampling.n"):
        choice_count(api.SamplingParams(n=0))
    with pytest.raises(InvalidArgument, match="greedy"):
        choice_count(api.SamplingParams(n=2, temperature=0))


def test_sampling_settings_carry_every_set_field() -> None:
    sampling = api.SamplingParams(
        presence_penalty=0.5,
        min_p=0.1,
        min_tokens=2,
        ignore_eos=True,
        logprobs=5,
        logit_bias={12: -100.0},
        structured=api.StructuredOutput(json_schema='{"type": "object"}'),
    )
    settings = sampling_settings(sampling)
    assert settings["logit_bias"] == {"12": -100.0}
    assert settings["structured"] == {"json": {"type": "object"}}
    assert (settings["logprobs"], settings["min_tokens"], settings["ignore_eos"]) == (5, 2, True)
    choice = sampling_settings(api.SamplingParams(structured=api.StructuredOutput(choice=["a"])))
    assert choice["structured"] == {"choice": ["a"]}
    with pytest.raises(InvalidArgument, match="exactly one"):
        sampling_settings(
            api.SamplingParams(structured=api.StructuredOutput(regex="a", grammar="b"))
        )


def test_token_logprobs_parse_the_detokenizers_rows() -> None:
    (token,) = token_logprobs(
        json.dumps([[[7, -0.5, " Paris"], [7, -0.5, " Paris"], [9, -2.0, "é"]]])
    )
    assert (token.token, token.token_id, token.logprob, token.token_bytes) == (
        " Paris",
        7,
        -0.5,
        b" Paris",
    )
    assert [t.token for t in token.top_logprobs] == [" Paris", "é"]
    assert token.top_logprobs[1].token_bytes == "é".encode()
    assert token_logprobs("") == []


def _stream(
    texts: list[str], delay: float, fail: bool = False
) -> Callable[[], AsyncGenerator[api.TextDelta, None]]:
    async def deltas() -> AsyncGenerator[api.TextDelta, None]:
        for text in texts:
            await asyncio.sleep(delay)
            yield api.TextDelta(text=text)
        if fail:
            raise Unavailable("the engine went away")

    return deltas


def test_merged_streams_tag_each_delta_with_its_choice() -> None:
    async def run() -> list[tuple[int, str]]:
        streams = [_stream(["a", "b"], 0.01), _stream(["x", "y", "z"], 0.004)]
        return [(d.index, d.text) async for d in merged(streams)]

    got = asyncio.run(run())
    assert [t for i, t in got if i == 0] == ["a", "b"]
    assert [t for i, t in got if i == 1] == ["x", "y", "z"]
    assert got[0] == (1, "x")  # as they come, not one choice after the other


def test_one_failing_choice_fails_the_request_and_stops_the_others() -> None:
    stopped = asyncio.Event()

    async def endless() -> AsyncGenerator[api.TextDelta, None]:
        try:
            while True:
                await asyncio.sleep(0.005)
                yield api.TextDelta(text=".")
        finally:
            stopped.set()

    async def run() -> None:
        async for _ in merged([endless, _stream(["a"], 0.01, fail=True)]):
            pass

    async def main() -> None:
        with pytest.raises(Unavailable):
            await run()
        assert stopped.is_set()

    asyncio.run(main())
