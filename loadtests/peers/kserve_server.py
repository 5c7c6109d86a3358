"""KServe 0.21's model server with the peer benchmark's MLP (v2 gRPC and REST).

    python kserve_server.py --model_pt MODEL_PT --http_port P --grpc_port G
                            (in its own venv: kserve==0.21.0, torch)

A custom ``kserve.Model`` as KServe's docs write one: predict() takes the v2
InferRequest and returns an InferResponse; KServe's own server does the rest
(its flags, read by kserve.model_server at import, keep their defaults).
Outputs go back raw over gRPC (what tritonclient reads) and as JSON over REST.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer


class PeerMlp(Model):  # type: ignore[misc]
    """The TorchScript MLP, one intra-op thread."""

    def __init__(self, name: str, model_pt: str) -> None:
        super().__init__(name)
        self.model_pt = model_pt
        self.module: Any = None
        self.load()

    def load(self) -> bool:
        """Load model.pt."""
        torch.set_num_threads(1)
        self.module = torch.jit.load(self.model_pt).eval()
        self.ready = True
        return True

    def predict(
        self, payload: InferRequest, headers: dict[str, str] | None = None
    ) -> InferResponse:
        """One v2 request: its first input through the model."""
        rows = payload.inputs[0].as_numpy()
        with torch.inference_mode():
            out = self.module(torch.from_numpy(rows)).numpy()
        output = InferOutput(name="OUTPUT0", shape=list(out.shape), datatype="FP32")
        output.set_data_from_numpy(out, binary_data=bool(payload.from_grpc))
        return InferResponse(
            response_id=payload.id or "",
            model_name=self.name,
            infer_outputs=[output],
            use_binary_outputs=bool(payload.from_grpc),
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_pt", required=True)
    parser.add_argument("--name", default="peer_mlp")
    args, _ = parser.parse_known_args()
    ModelServer().start([PeerMlp(args.name, args.model_pt)])
