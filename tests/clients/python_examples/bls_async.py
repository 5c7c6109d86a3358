"""bls_async over HTTP: OUTPUT0 from pytorch and OUTPUT1 from add_sub."""

import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

with httpclient.InferenceServerClient(sys.argv[1]) as client:
    a = np.random.rand(4).astype(np.float32)
    b = np.random.rand(4).astype(np.float32)
    inputs = [
        httpclient.InferInput("INPUT0", a.shape, np_to_triton_dtype(a.dtype)),
        httpclient.InferInput("INPUT1", b.shape, np_to_triton_dtype(b.dtype)),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0"),
        httpclient.InferRequestedOutput("OUTPUT1"),
    ]
    response = client.infer("bls_async", inputs, request_id="1", outputs=outputs)
    if not np.allclose(a + b, response.as_numpy("OUTPUT0")):
        print("BLS async example error: incorrect sum")
        sys.exit(1)
    if not np.allclose(a - b, response.as_numpy("OUTPUT1")):
        print("BLS async example error: incorrect difference")
        sys.exit(1)
print("PASS: BLS Async")
