"""How a shadow target's answer compares with the answer the caller got.

For every output both answers carry: numeric tensors give the largest absolute
difference; a classification (a score vector per row: the last dimension above
1) also gives top-1 agreement; text (BYTES) tensors give exact match. A
stream's answers are compared whole: each output's pieces joined in order (the
generated text, token by token, against the shadow's whole text). Nothing
here is returned to a caller: the route table records it as metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inference import grpc_service_pb2 as pb
from shared.tensors import decode_outputs


@dataclass(frozen=True)
class Comparison:
    """One mirrored request's comparison (None: no tensor of that kind to compare)."""

    max_abs_diff: float | None = None
    top1_agree: bool | None = None
    exact_match: bool | None = None


def compare(served: list[pb.ModelInferResponse], shadow: list[pb.ModelInferResponse]) -> Comparison:
    """The shadow's answers against the served ones (one each, or a stream each)."""
    if len(served) == 1 and len(shadow) == 1:
        return compare_outputs(decode_outputs(served[0]), decode_outputs(shadow[0]))
    return compare_outputs(_joined(served), _joined(shadow))


def _joined(responses: list[pb.ModelInferResponse]) -> dict[str, np.ndarray]:
    """A stream's outputs, each output's pieces in order: text joined into one string,
    numbers into one flat vector."""
    pieces: dict[str, list[np.ndarray]] = {}
    for response in responses:
        for name, array in decode_outputs(response).items():
            pieces.setdefault(name, []).append(array.reshape(-1))
    joined: dict[str, np.ndarray] = {}
    for name, parts in pieces.items():
        flat = np.concatenate(parts)
        if flat.dtype == object:
            text = b"".join(bytes(item) for item in flat)
            joined[name] = np.array([text], dtype=object)
        else:
            joined[name] = flat
    return joined


def compare_outputs(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> Comparison:
    """The shadow's outputs against the served ones, over the outputs both have."""
    diffs: list[float] = []
    agreements: list[bool] = []
    matches: list[bool] = []
    for name, expected in ours.items():
        got = theirs.get(name)
        if got is None:
            matches.append(False)
            continue
        if object in (expected.dtype, got.dtype):
            matches.append(expected.shape == got.shape and bool(np.array_equal(expected, got)))
            continue
        if expected.shape != got.shape:
            diffs.append(float("inf"))
            continue
        delta = np.abs(expected.astype(np.float64) - got.astype(np.float64))
        diffs.append(float(delta.max()) if delta.size else 0.0)
        if expected.ndim >= 1 and expected.shape[-1] > 1:
            agreements.append(bool(np.array_equal(expected.argmax(axis=-1), got.argmax(axis=-1))))
    return Comparison(
        max_abs_diff=max(diffs) if diffs else None,
        top1_agree=all(agreements) if agreements else None,
        exact_match=all(matches) if matches else None,
    )
