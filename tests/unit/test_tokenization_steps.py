"""Finding an LLM pipeline's tokenizer, engine and detokenizer steps (Tokenize / Detokenize)."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from inference import model_config_pb2 as mc
from services.orchestrator.ensemble import EnsemblePlan, ModelIO
from services.orchestrator.tokenization import (
    MESSAGES,
    PROMPT,
    decoder_inputs,
    text_steps,
    token_ids,
)
from shared.errors import InvalidArgument

MODELS = {
    "tok": """
        name: "tok" backend: "tokenizer"
        input [ { name: "TEXT" data_type: TYPE_STRING dims: [1] optional: true },
                { name: "MESSAGES" data_type: TYPE_STRING dims: [1] optional: true } ]
        output [ { name: "ids" data_type: TYPE_INT64 dims: [-1] } ]""",
    "engine": """
        name: "engine" backend: "vllm" model_transaction_policy { decoupled: true }
        input [ { name: "INPUT_IDS" data_type: TYPE_INT64 dims: [-1] } ]
        output [ { name: "OUTPUT_IDS" data_type: TYPE_INT64 dims: [-1] },
                 { name: "NEW_TOKENS" data_type: TYPE_INT32 dims: [1] },
                 { name: "ENGINE_FINISH" data_type: TYPE_STRING dims: [1] } ]""",
    "detok": """
        name: "detok" backend: "detokenize"
        input [ { name: "OUTPUT_IDS" data_type: TYPE_INT64 dims: [-1] },
                { name: "NEW_TOKENS" data_type: TYPE_INT32 dims: [1] },
                { name: "ENGINE_FINISH" data_type: TYPE_STRING dims: [1] } ]
        output [ { name: "TEXT_DELTA" data_type: TYPE_STRING dims: [1] } ]""",
}
DETOKENIZER_STEP = """
    step { model_name: "detok" model_version: -1
           input_map { key: "OUTPUT_IDS" value: "out" }
           input_map { key: "NEW_TOKENS" value: "new" }
           input_map { key: "ENGINE_FINISH" value: "finish" }
           output_map { key: "TEXT_DELTA" value: "TEXT_DELTA" } }"""


def _plan(inputs: str, steps: str, outputs: str) -> EnsemblePlan:
    config = text_format.Parse(
        f'name: "pipe" platform: "ensemble" {inputs} {outputs} ensemble_scheduling {{ {steps} }}',
        mc.ModelConfig(),
    )
    models = {
        name: ModelIO.from_config(text_format.Parse(text, mc.ModelConfig()))
        for name, text in MODELS.items()
    }
    return EnsemblePlan.build(config, models)


def _llm(tokenizer_inputs: str = 'input_map { key: "TEXT" value: "PROMPT" }') -> EnsemblePlan:
    return _plan(
        'input [ { name: "PROMPT" data_type: TYPE_STRING dims: [1] optional: true },'
        '        { name: "MESSAGES" data_type: TYPE_STRING dims: [1] optional: true } ]',
        f"""
        step {{ model_name: "tok" model_version: 3 {tokenizer_inputs}
                output_map {{ key: "ids" value: "prompt_ids" }} }}
        step {{ model_name: "engine" model_version: -1
                input_map {{ key: "INPUT_IDS" value: "prompt_ids" }}
                output_map {{ key: "OUTPUT_IDS" value: "out" }}
                output_map {{ key: "NEW_TOKENS" value: "new" }}
                output_map {{ key: "ENGINE_FINISH" value: "finish" }} }}
        {DETOKENIZER_STEP}""",
        'output [ { name: "TEXT_DELTA" data_type: TYPE_STRING dims: [1] } ]',
    )


def test_the_steps_of_an_llm_pipeline() -> None:
    both = (
        'input_map { key: "TEXT" value: "PROMPT" } input_map { key: "MESSAGES" value: "MESSAGES" }'
    )
    steps = text_steps(_llm(both))
    assert (steps.tokenizer.model, steps.tokenizer.version, steps.ids) == ("tok", "3", "ids")
    assert steps.engine.model == "engine" and steps.detokenizer.model == "detok"
    assert steps.tokenizer_input(PROMPT) == "TEXT"
    assert steps.tokenizer_input(MESSAGES) == "MESSAGES"


def test_a_tokenizer_step_without_chat_says_so() -> None:
    steps = text_steps(_llm())
    with pytest.raises(InvalidArgument, match="takes no messages"):
        steps.tokenizer_input(MESSAGES)


def test_a_pipeline_without_an_engine_is_not_an_llm_pipeline() -> None:
    plan = _plan(
        'input [ { name: "PROMPT" data_type: TYPE_STRING dims: [1] } ]',
        'step { model_name: "tok" model_version: -1 input_map { key: "TEXT" value: "PROMPT" }'
        ' output_map { key: "ids" value: "IDS" } }',
        'output [ { name: "IDS" data_type: TYPE_INT64 dims: [-1] } ]',
    )
    with pytest.raises(InvalidArgument, match="not an LLM pipeline"):
        text_steps(plan)


def test_token_ids_name_the_bad_one() -> None:
    assert token_ids([3, 0, 7]).tolist() == [3, 0, 7]
    assert token_ids([3]).dtype == np.int64
    with pytest.raises(InvalidArgument, match=r"tokens\[2\]"):
        token_ids([3, 0, -7])
    with pytest.raises(InvalidArgument, match="at least one"):
        token_ids([])


def test_decoder_inputs_ask_for_the_whole_text_with_special_tokens() -> None:
    steps = text_steps(_llm())
    inputs = decoder_inputs(steps.detokenizer, [5, 6])
    assert inputs["OUTPUT_IDS"].tolist() == [5, 6] and inputs["NEW_TOKENS"].tolist() == [2]
    assert inputs["ENGINE_FINISH"].tolist() == [b"length"]
    assert "SAMPLING" not in inputs  # this pipeline's detokenizer step takes none
    with pytest.raises(InvalidArgument, match=r"tokens\[0\]"):
        decoder_inputs(steps.detokenizer, [-5])
