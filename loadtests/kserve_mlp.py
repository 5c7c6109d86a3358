"""KServe's own model server with the TorchScript MLP of ``bench_forwarding.py``.

    <kserve venv>/bin/python loadtests/kserve_mlp.py MODEL.pt TORCH_SITE \
        --grpc_port P --http_port Q

Runs in KServe's venv (its ``inference`` protobuf package clashes with ours);
torch comes from the project's venv (``TORCH_SITE``: a folder linking torch and
what it imports, appended to the path so KServe's own packages win). One
intra-op thread, as the mesh's instance gets; the model runs in ``predict`` on
KServe's event loop, as KServe runs it.
"""

from __future__ import annotations

import sys
from typing import Any

MODEL, TORCH_SITE = sys.argv[1], sys.argv[2]
sys.argv[1:3] = []  # KServe parses the rest of the command line itself
sys.path.append(TORCH_SITE)

import kserve  # noqa: E402
import torch  # noqa: E402
from kserve import InferOutput, InferRequest, InferResponse  # noqa: E402


class Mlp(kserve.Model):  # type: ignore[misc]
    """The MLP on KServe's v2 protocol: INPUT [1, 128] FP32 -> OUTPUT [1, 10]."""

    def __init__(self) -> None:
        super().__init__("mlp")
        torch.set_num_threads(1)
        self.module = torch.jit.load(MODEL).eval()
        self.ready = True

    def predict(self, payload: InferRequest, headers: Any = None) -> InferResponse:
        rows = payload.inputs[0].as_numpy()
        with torch.inference_mode():
            logits = self.module(torch.from_numpy(rows)).numpy()
        output = InferOutput(name="OUTPUT", shape=list(logits.shape), datatype="FP32")
        output.set_data_from_numpy(logits, binary_data=True)
        return InferResponse(model_name="mlp", infer_outputs=[output], response_id=payload.id)


if __name__ == "__main__":
    kserve.ModelServer(enable_latency_logging=False).start([Mlp()])
