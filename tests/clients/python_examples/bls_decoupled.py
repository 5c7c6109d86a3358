"""bls_decoupled_sync / bls_decoupled_async over HTTP: SUM = factor * IN * IN."""

import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

model, factor = sys.argv[2], int(sys.argv[3])
with httpclient.InferenceServerClient(sys.argv[1]) as client:
    for value in (4, 2, 0, 1):
        data = np.array([value], dtype=np.int32)
        tensor = httpclient.InferInput("IN", data.shape, np_to_triton_dtype(data.dtype))
        tensor.set_data_from_numpy(data)
        response = client.infer(
            model, [tensor], request_id="1", outputs=[httpclient.InferRequestedOutput("SUM")]
        )
        if not np.allclose(factor * data * data, response.as_numpy("SUM")):
            print(f"{model} error: expected {factor * data * data}, got {response.as_numpy('SUM')}")
            sys.exit(1)
print(f"PASS: {model}")
