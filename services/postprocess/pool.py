"""The ``embedding_pool`` backend: token embeddings -> one sentence embedding.

``TOKEN_EMBEDDINGS`` (TYPE_FP32, dims [ -1, D ]) and ``ATTENTION_MASK``
(TYPE_INT64, dims [ -1 ]) in; ``EMBEDDING`` (TYPE_FP32, dims [ D ]) out: the mean
of the token embeddings weighted by the mask, then L2-normalised (parameter
``normalize``, default true), as sentence-transformers pools all-MiniLM-L6-v2.
A row whose mask is all zero pools to the zero vector (never NaN).

The whole batch is one batched matmul: requests of equal length are concatenated;
requests of different lengths are zero-padded to the longest first (the padding
has mask 0, so it does not change any mean).
"""

from __future__ import annotations

import numpy as np

from inference import model_config_pb2 as mc
from shared.backend import InstanceSpec, ModelSpec, parameter
from shared.errors import ConfigError, InvalidArgument
from shared.request import InferRequest, InferResponse

TOKEN_EMBEDDINGS = "TOKEN_EMBEDDINGS"
ATTENTION_MASK = "ATTENTION_MASK"
EMBEDDING = "EMBEDDING"


def mean_pool(embeddings: np.ndarray, mask: np.ndarray, normalize: bool) -> np.ndarray:
    """``[R, L, D]`` embeddings and ``[R, L]`` mask -> ``[R, D]`` masked means."""
    weights = mask.astype(np.float32)
    summed = np.matmul(weights[:, None, :], embeddings.astype(np.float32, copy=False))[:, 0, :]
    # The clamps are sentence-transformers' (1e-9) and torch's F.normalize (1e-12).
    pooled: np.ndarray = summed / np.maximum(weights.sum(axis=1, keepdims=True), 1e-9)
    if normalize:
        pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    return pooled


def stack_padded(
    embeddings: list[np.ndarray], masks: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ``[r, L_i, D]`` / ``[r, L_i]`` pieces, zero-padding L to the longest."""
    lengths = {piece.shape[1] for piece in embeddings}
    if len(lengths) == 1:
        return np.concatenate(embeddings), np.concatenate(masks)
    longest, rows = max(lengths), sum(len(piece) for piece in embeddings)
    stacked = np.zeros((rows, longest, embeddings[0].shape[2]), dtype=np.float32)
    stacked_mask = np.zeros((rows, longest), dtype=masks[0].dtype)
    row = 0
    for piece, mask in zip(embeddings, masks, strict=True):
        stacked[row : row + len(piece), : piece.shape[1]] = piece
        stacked_mask[row : row + len(piece), : piece.shape[1]] = mask
        row += len(piece)
    return stacked, stacked_mask


def _check_tensors(spec: ModelSpec) -> None:
    where = f"model '{spec.name}'"
    inputs = {tensor.name: tensor for tensor in spec.config.input}
    outputs = {tensor.name: tensor for tensor in spec.config.output}
    tokens, mask = inputs.get(TOKEN_EMBEDDINGS), inputs.get(ATTENTION_MASK)
    embedding = outputs.get(EMBEDDING)
    if len(inputs) != 2 or tokens is None or mask is None:
        raise ConfigError(f"{where}: inputs must be '{TOKEN_EMBEDDINGS}' and '{ATTENTION_MASK}'")
    if tokens.data_type != mc.TYPE_FP32 or len(tokens.dims) != 2:
        raise ConfigError(f"{where}: input '{TOKEN_EMBEDDINGS}' must be TYPE_FP32, dims [ -1, D ]")
    if mask.data_type != mc.TYPE_INT64 or len(mask.dims) != 1:
        raise ConfigError(f"{where}: input '{ATTENTION_MASK}' must be TYPE_INT64, dims [ -1 ]")
    if len(outputs) != 1 or embedding is None or embedding.data_type != mc.TYPE_FP32:
        raise ConfigError(f"{where}: declare one output '{EMBEDDING}' of TYPE_FP32, dims [ D ]")
    if list(embedding.dims) != [tokens.dims[1]]:
        raise ConfigError(
            f"{where}: output '{EMBEDDING}' dims {list(embedding.dims)} must be "
            f"[ {tokens.dims[1]} ], the last dim of '{TOKEN_EMBEDDINGS}'"
        )


class EmbeddingPoolInstance:
    """Masked mean pooling (and L2 normalisation) over a whole batch at once."""

    loop_safe = True
    """numpy on arrays already in memory, no callback into the loop: a batch runs
    on the loop once measured cheap (shared/inline_budget.py), without the hop to
    the instance's thread that costs a request more than the pooling itself."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self.spec = spec
        try:
            self.normalize: bool = parameter(spec, "normalize", True, bool)
        except InvalidArgument as exc:
            raise ConfigError(str(exc)) from exc
        _check_tensors(spec)

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Pool every request of the batch in one pass per embedding width."""
        results: dict[int, InferResponse | Exception] = {}
        groups: dict[int, list[int]] = {}
        for slot, request in enumerate(requests):
            try:
                self._check_request(request)
            except InvalidArgument as exc:
                results[slot] = exc
                continue
            width = request.inputs[TOKEN_EMBEDDINGS].shape[-1]
            groups.setdefault(width, []).append(slot)
        for slots in groups.values():
            results.update(self._pool([(slot, requests[slot]) for slot in slots]))
        return [results[slot] for slot in range(len(requests))]

    def _check_request(self, request: InferRequest) -> None:
        tokens, mask = request.inputs[TOKEN_EMBEDDINGS], request.inputs[ATTENTION_MASK]
        if tokens.shape[:-1] != mask.shape:
            raise InvalidArgument(
                f"model '{self.spec.name}': '{ATTENTION_MASK}' has shape {list(mask.shape)}, "
                f"but '{TOKEN_EMBEDDINGS}' {list(tokens.shape)} needs {list(tokens.shape[:-1])}"
            )

    def _pool(self, members: list[tuple[int, InferRequest]]) -> dict[int, InferResponse]:
        tokens = [request.inputs[TOKEN_EMBEDDINGS] for _, request in members]
        flat = [array.reshape(-1, *array.shape[-2:]) for array in tokens]
        masks = [
            request.inputs[ATTENTION_MASK].reshape(rows.shape[:2])
            for (_, request), rows in zip(members, flat, strict=True)
        ]
        pooled = mean_pool(*stack_padded(flat, masks), normalize=self.normalize)
        bounds = np.cumsum([len(rows) for rows in flat])[:-1]
        return {
            slot: InferResponse(
                outputs={EMBEDDING: part.reshape(*array.shape[:-2], part.shape[-1])}
            )
            for (slot, _), array, part in zip(
                members, tokens, np.split(pooled, bounds), strict=True
            )
        }

    def close(self) -> None:
        """Nothing to release."""


class EmbeddingPoolBackend:
    """Creates EmbeddingPoolInstance objects."""

    name = "embedding_pool"

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> EmbeddingPoolInstance:
        """Check the config (in the instance's own thread)."""
        return EmbeddingPoolInstance(model, instance)
