"""TorchServe handler of the peer benchmark's MLP: JSON rows in, JSON rows out.

Each request body is ``{"data": [128 numbers]}``; TorchServe batches up to
batchSize bodies into one call; each answer is the row's 10 outputs.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler


class PeerMlp(BaseHandler):  # type: ignore[misc]
    """One row per request, batched by TorchServe."""

    def initialize(self, context: Any) -> None:
        """Load model.pt with one intra-op thread, like every other server."""
        torch.set_num_threads(1)
        super().initialize(context)

    def preprocess(self, data: list[dict[str, Any]]) -> torch.Tensor:
        """Stack the rows of the batch."""
        rows = []
        for item in data:
            body = item.get("body") or item.get("data")
            document = json.loads(body) if isinstance(body, bytes | bytearray) else body
            rows.append(document["data"])
        return torch.tensor(rows, dtype=torch.float32)

    def inference(self, data: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The model on the batch."""
        with torch.inference_mode():
            out: torch.Tensor = self.model(data)
        return out

    def postprocess(self, data: torch.Tensor) -> list[list[float]]:
        """One list of outputs per request."""
        rows: list[list[float]] = data.tolist()
        return rows
