"""Which steps of an LLM pipeline tokenize and detokenize, for Tokenize / Detokenize.

vLLM's server answers ``/tokenize`` and ``/detokenize`` with the tokenizer the
engine uses. In the mesh that tokenizer is a pipeline's first step and the
decoder its last, so the answer comes from those same step models, and the
ids are exactly what the pipeline feeds its engine::

    PROMPT / MESSAGES -> [tokenizer] -ids-> [engine, decoupled] -ids-> [detokenizer] -> TEXT_DELTA

The tokenizer step is the one that makes a tensor the engine step reads; the
detokenizer step is the one after the engine that reads ``OUTPUT_IDS``. Input
names are the backends' own (the tokenizer's TEXT and MESSAGES, the
detokenize backend's OUTPUT_IDS, NEW_TOKENS and ENGINE_FINISH); the tokenizer's
output name comes from the step's output_map.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.orchestrator.ensemble import EnsemblePlan, Step
from shared.errors import InvalidArgument

PROMPT = "PROMPT"
"""The pipeline input a text prompt goes to (as Generate sends it)."""
MESSAGES = "MESSAGES"
"""The pipeline input a JSON chat goes to (as Chat sends it)."""
# The detokenize backend's tensors.
OUTPUT_IDS = "OUTPUT_IDS"
NEW_TOKENS = "NEW_TOKENS"
ENGINE_FINISH = "ENGINE_FINISH"
SAMPLING = "SAMPLING"
TEXT_DELTA = "TEXT_DELTA"


@dataclass(frozen=True)
class TextSteps:
    """An LLM pipeline's tokenizer, engine and detokenizer steps."""

    tokenizer: Step
    ids: str
    """The tokenizer's output the engine reads: the prompt's token ids."""
    engine: Step
    detokenizer: Step

    def tokenizer_input(self, pipeline_input: str) -> str:
        """The tokenizer's input fed from ``pipeline_input`` (PROMPT or MESSAGES)."""
        for name, source in self.tokenizer.input_map.items():
            if source == pipeline_input:
                return name
        what = "a prompt" if pipeline_input == PROMPT else "messages"
        raise InvalidArgument(
            f"model '{self.tokenizer.model}': the pipeline's tokenizer step takes no {what} "
            f"(no input mapped from {pipeline_input})"
        )


def text_steps(plan: EnsemblePlan) -> TextSteps:
    """The steps of ``plan`` that turn text into ids and back; InvalidArgument when
    ``plan`` is not an LLM pipeline of that shape."""
    engine = plan.streaming
    if engine is None:
        raise InvalidArgument(f"model '{plan.name}' is not an LLM pipeline (no decoupled step)")
    fed = set(engine.input_map.values())
    for step in plan.upstream:
        ids = next((name for name, tensor in step.output_map.items() if tensor in fed), None)
        if ids is not None:
            break
    else:
        raise InvalidArgument(f"model '{plan.name}': no step before the engine feeds it")
    detokenizer = next((s for s in plan.downstream if OUTPUT_IDS in s.input_map), None)
    if detokenizer is None:
        raise InvalidArgument(
            f"model '{plan.name}': no step after the engine reads {OUTPUT_IDS} (a detokenizer)"
        )
    return TextSteps(step, ids, engine, detokenizer)


def decoder_inputs(decoder: Step, tokens: list[int]) -> dict[str, np.ndarray]:
    """``tokens`` as one request to the detokenizer step that answers their whole text:
    every id new, a finish reason (nothing held back), and special tokens kept, as
    vLLM's /detokenize keeps them (where the step takes SAMPLING; else the model's
    own setting applies)."""
    ids = token_ids(tokens)
    inputs = {
        OUTPUT_IDS: ids,
        NEW_TOKENS: np.array([len(ids)], dtype=np.int32),
        ENGINE_FINISH: np.array([b"length"], dtype=object),
    }
    if SAMPLING in decoder.input_map:
        inputs[SAMPLING] = np.array([b'{"skip_special_tokens": false}'], dtype=object)
    return inputs


def token_ids(tokens: list[int]) -> np.ndarray:
    """Token ids as the detokenizer's INT64 input; InvalidArgument names a bad one."""
    if not tokens:
        raise InvalidArgument("tokens: at least one token id is required")
    for index, token in enumerate(tokens):
        if token < 0:
            raise InvalidArgument(f"tokens[{index}]: token ids are >= 0, got {token}")
    return np.asarray(tokens, dtype=np.int64)
