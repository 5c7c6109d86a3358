"""Domain objects for one inference call, free of protobuf and gRPC.

The servicer decodes a ``ModelInferRequest`` into an ``InferRequest``; the
batcher queues it; a backend instance executes a list of them and returns one
``InferResponse`` (or an exception) per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class InferRequest:
    """One caller's request to one model version."""

    model_name: str
    model_version: str
    inputs: dict[str, np.ndarray]
    """Input tensors by name; for batched models dim 0 is the batch."""
    requested_outputs: list[str] | None = None
    """Output names the caller asked for; ``None`` means every output."""
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    """0 means the model's default priority level; 1 is the highest."""
    timeout_us: int = 0
    """Queue timeout asked by the caller; 0 means the model's default."""
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    """When the request arrived (monotonic), for queue statistics."""
    queue_start_ns: int = 0
    compute_start_ns: int = 0
    cancelled: bool = False
    """Set once the caller went away (a model may stop early: ``is_cancelled()``)."""
    gathered: bool = False
    """Its rows are a batch some queue upstream already gathered (an ensemble's
    batch through its steps): the model's batcher sends it without waiting for
    others to join."""

    def batch_size(self, batched: bool) -> int:
        """Rows in this request: dim 0 of the first input, or 1 if unbatched."""
        if not batched or not self.inputs:
            return 1
        first = next(iter(self.inputs.values()))
        return int(first.shape[0]) if first.ndim else 1

    def shape_key(self, batched: bool) -> tuple[Any, ...]:
        """Requests with equal keys may share one batch (same names, types, shapes)."""
        return tuple(
            (name, str(array.dtype), array.shape[1:] if batched else array.shape)
            for name, array in sorted(self.inputs.items())
        )


@dataclass
class InferResponse:
    """The outputs for one request, by name."""

    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)
    final: bool = True
    """False for every response of a decoupled stream except the last."""
