"""The ``classify`` backend: LOGITS -> softmax -> top-k LABELS and PROBABILITIES.

``LOGITS`` (TYPE_FP32, dims [ N ]) in; ``LABELS`` (TYPE_STRING) and
``PROBABILITIES`` (TYPE_FP32), both dims [ k ], out, best first (ties: lower
class index first). The labels file is named by the ``label_filename``
parameter, else by the first output's ``label_filename``; it lives in the model
folder, one label per line, line i naming class i. Parameter ``top_k`` (default 5).

A batch is computed at once: requests with equal N are concatenated and go
through one vectorised softmax and one sort.
"""

from __future__ import annotations

import numpy as np

from inference import model_config_pb2 as mc
from shared.backend import InstanceSpec, ModelSpec, parameter
from shared.errors import ConfigError, InvalidArgument
from shared.request import InferRequest, InferResponse

LOGITS = "LOGITS"
LABELS = "LABELS"
PROBABILITIES = "PROBABILITIES"


def read_labels(spec: ModelSpec) -> list[str]:
    """The model's class labels; a missing, unreadable or empty file is a ConfigError."""
    name = spec.parameters.get("label_filename") or next(
        (output.label_filename for output in spec.config.output if output.label_filename), ""
    )
    where = f"model '{spec.name}'"
    if not name:
        raise ConfigError(
            f"{where}: classify needs a labels file: set an output's label_filename "
            "(or the 'label_filename' parameter)"
        )
    path = spec.model_dir / name
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read labels file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: labels file {path} is not UTF-8: {exc}") from exc
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise ConfigError(f"{where}: labels file {path} is empty")
    return lines


def softmax_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of logits ``[R, N]`` -> (class indices, probabilities), each ``[R, k]``, best first."""
    logits = logits.astype(np.float32, copy=False)
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = exp / exp.sum(axis=1, keepdims=True)
    indices = top_k_indices(probabilities, k)
    return indices, np.take_along_axis(probabilities, indices, axis=1)


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Per row, the indices of the ``k`` largest scores, best first; ties: lower index first.

    One ``partition`` finds each row's k-th largest score; everything above it is
    in, and ties with it fill the remaining places in index order. Only those k
    are sorted, so a row costs O(N + k log k) and equal inputs always get equal
    answers (a stable sort of whole rows costs several times more at N = 1000).
    """
    scores = np.where(np.isnan(scores), -np.inf, scores)  # NaN ranks last instead of breaking
    rows, classes = scores.shape
    k = min(k, classes)
    kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1 : k]
    above, tied = scores > kth, scores == kth
    need = k - above.sum(axis=1, keepdims=True)
    if (tied.sum(axis=1, keepdims=True) > need).any():  # more ties than places: lowest first
        tied &= np.cumsum(tied, axis=1) <= need
    candidates = np.nonzero(above | tied)[1].reshape(rows, k)  # k per row, ascending
    order = np.argsort(-np.take_along_axis(scores, candidates, axis=1), axis=1, kind="stable")
    return np.take_along_axis(candidates, order, axis=1)


def _check_tensors(spec: ModelSpec, top_k: int) -> int:
    """The configured class count N (-1 if variable); checks names, types and dims."""
    where = f"model '{spec.name}'"
    inputs = {tensor.name: tensor for tensor in spec.config.input}
    outputs = {tensor.name: tensor for tensor in spec.config.output}
    logits = inputs.get(LOGITS)
    if len(inputs) != 1 or logits is None or logits.data_type != mc.TYPE_FP32:
        raise ConfigError(f"{where}: declare one input 'LOGITS' of TYPE_FP32, dims [ N ]")
    if len(logits.dims) != 1:
        raise ConfigError(
            f"{where}: input 'LOGITS' must have one dim [ N ], got {list(logits.dims)}"
        )
    expected = {LABELS: mc.TYPE_STRING, PROBABILITIES: mc.TYPE_FP32}
    if set(outputs) != set(expected):
        raise ConfigError(f"{where}: outputs must be {sorted(expected)}, got {sorted(outputs)}")
    for name, data_type in expected.items():
        tensor = outputs[name]
        if tensor.data_type != data_type or list(tensor.dims) not in ([top_k], [-1]):
            raise ConfigError(
                f"{where}: output '{name}' must be {mc.DataType.Name(data_type)} with dims "
                f"[ {top_k} ] (top_k) or [ -1 ]"
            )
    return int(logits.dims[0])


class ClassifyInstance:
    """Softmax and top-k over one model's labels."""

    loop_safe = True
    """numpy on arrays already in memory, no callback into the loop: a batch runs
    on the loop once measured cheap (shared/inline_budget.py), without the hop to
    the instance's thread that costs a request more than the top-k itself."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self.spec = spec
        try:
            self.top_k: int = parameter(spec, "top_k", 5, int)
        except InvalidArgument as exc:
            raise ConfigError(str(exc)) from exc
        if self.top_k < 1:
            raise ConfigError(f"model '{spec.name}': parameter 'top_k' must be >= 1")
        classes = _check_tensors(spec, self.top_k)
        labels = read_labels(spec)
        if classes != -1 and len(labels) != classes:
            raise ConfigError(
                f"model '{spec.name}': LOGITS has {classes} classes, but the labels file "
                f"has {len(labels)} lines"
            )
        if self.top_k > len(labels):
            raise ConfigError(
                f"model '{spec.name}': top_k = {self.top_k} exceeds the {len(labels)} classes"
            )
        self.labels = np.empty(len(labels), dtype=object)
        self.labels[:] = [label.encode() for label in labels]

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Concatenate requests of equal width, classify each group at once, split back."""
        groups: dict[int, list[int]] = {}
        for slot, request in enumerate(requests):
            groups.setdefault(request.inputs[LOGITS].shape[-1], []).append(slot)
        results: dict[int, InferResponse | Exception] = {}
        for width, slots in groups.items():
            if width != len(self.labels):
                error = InvalidArgument(
                    f"model '{self.spec.name}': LOGITS has {width} classes, "
                    f"the labels file has {len(self.labels)}"
                )
                results.update((slot, error) for slot in slots)
                continue
            results.update(self._classify([(slot, requests[slot]) for slot in slots]))
        return [results[slot] for slot in range(len(requests))]

    def _classify(
        self, members: list[tuple[int, InferRequest]]
    ) -> dict[int, InferResponse | Exception]:
        arrays = [request.inputs[LOGITS] for _, request in members]
        flat = [array.reshape(-1, array.shape[-1]) for array in arrays]
        indices, probabilities = softmax_top_k(np.concatenate(flat), self.top_k)
        bounds = np.cumsum([len(rows) for rows in flat])[:-1]
        results: dict[int, InferResponse | Exception] = {}
        for (slot, request), array, top, probs in zip(
            members, arrays, np.split(indices, bounds), np.split(probabilities, bounds), strict=True
        ):
            shape = (*array.shape[:-1], self.top_k)
            outputs = {LABELS: self.labels[top].reshape(shape), PROBABILITIES: probs.reshape(shape)}
            wanted = request.requested_outputs or list(outputs)
            results[slot] = InferResponse(outputs={k: v for k, v in outputs.items() if k in wanted})
        return results

    def close(self) -> None:
        """Nothing to release."""


class ClassifyBackend:
    """Creates ClassifyInstance objects."""

    name = "classify"

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> ClassifyInstance:
        """Read the labels and check the config (in the instance's own thread)."""
        return ClassifyInstance(model, instance)
