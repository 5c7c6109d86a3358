"""Triton's classification extension: an output answered as its top classes.

A requested output whose ``classification`` parameter is k comes back as a
BYTES tensor instead of its numbers: per batch row (the whole tensor for a
model without batching) the k largest values, best first, ties to the lower
index, NaN last, each as ``"value:index"``, or ``"value:index:label"`` where
the output's config names a ``label_filename`` (one label per line, in the
model's folder). Floats print with six decimals, integers as integers (as
Triton prints them). A k past the number of classes gives them all.

The stages apply it to their models' outputs (``shared.servicer``), the
orchestrator to its ensembles' outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inference import grpc_service_pb2 as pb
from inference import model_config_pb2 as mc
from shared.errors import ConfigError, InvalidArgument

PARAMETER = "classification"


def requested_classes(request: pb.ModelInferRequest) -> dict[str, int]:
    """Output name -> k, for each requested output that asks for classification."""
    classes: dict[str, int] = {}
    for output in request.outputs:
        if PARAMETER not in output.parameters:
            continue
        param = output.parameters[PARAMETER]
        which = param.WhichOneof("parameter_choice")
        value = getattr(param, which) if which else None
        if which not in ("int64_param", "uint64_param") or not isinstance(value, int) or value < 1:
            raise InvalidArgument(
                f"output '{output.name}': parameter '{PARAMETER}' must be a positive "
                f"integer (the number of classes), got {value!r}"
            )
        classes[output.name] = value
    return classes


def output_labels(
    config: mc.ModelConfig, model_dir: Path, names: list[str]
) -> dict[str, list[str]]:
    """The labels of each output in ``names`` whose config has a label_filename."""
    labels: dict[str, list[str]] = {}
    for output in config.output:
        if output.name in names and output.label_filename:
            path = model_dir / output.label_filename
            try:
                labels[output.name] = path.read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise ConfigError(
                    f"model '{config.name}': output '{output.name}': label_filename "
                    f"{path} cannot be read: {exc.strerror}"
                ) from exc
    return labels


def top_classes(
    array: np.ndarray, k: int, batched: bool, labels: list[str] | None, name: str
) -> np.ndarray:
    """``array``'s top ``k`` classes per batch row, as the extension's strings."""
    if array.dtype.kind not in "biuf":
        raise InvalidArgument(
            f"output '{name}': classification needs numbers, but the output holds {array.dtype}"
        )
    rows = array.reshape(array.shape[0], -1) if batched and array.ndim else array.reshape(1, -1)
    k = min(k, rows.shape[1])
    values = rows.astype(np.float64)
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]  # NaN sorts last
    integers = array.dtype.kind in "biu"
    answer = np.empty((rows.shape[0], k), dtype=object)
    for row, indices in enumerate(order):
        for place, index in enumerate(indices):
            value = rows[row, index]
            text = f"{int(value)}" if integers else f"{float(value):f}"
            text += f":{index}"
            if labels is not None and index < len(labels):
                text += f":{labels[index]}"
            answer[row, place] = text.encode()
    return answer if batched and array.ndim else answer.reshape(k)


@dataclass(frozen=True)
class Classification:
    """The outputs one request asks to have classified, and how."""

    classes: dict[str, int]
    """Output name -> k."""
    batched: bool
    """The model batches: each row of the first dimension is classified alone."""
    labels: dict[str, list[str]]
    """Output name -> its labels, where its config names a label_filename."""

    def apply(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``outputs`` with each output asked for replaced by its top classes."""
        answered = dict(outputs)
        for name, k in self.classes.items():
            if name in answered:
                labels = self.labels.get(name)
                answered[name] = top_classes(answered[name], k, self.batched, labels, name)
        return answered


def classification(
    request: pb.ModelInferRequest, config: mc.ModelConfig, model_dir: Path | None
) -> Classification | None:
    """What ``request`` asks of the model ``config`` describes (labels read from
    ``model_dir``); None when it asks no output to be classified."""
    classes = requested_classes(request)
    if not classes:
        return None
    labels = output_labels(config, model_dir, list(classes)) if model_dir else {}
    return Classification(classes, config.max_batch_size > 0, labels)
