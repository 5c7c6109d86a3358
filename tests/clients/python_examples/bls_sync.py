"""bls_sync over HTTP: the answer of add_sub, then of pytorch; an unknown model fails."""

import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

with httpclient.InferenceServerClient(sys.argv[1]) as client:
    a = np.random.rand(4).astype(np.float32)
    b = np.random.rand(4).astype(np.float32)
    inputs = [
        httpclient.InferInput("INPUT0", a.shape, np_to_triton_dtype(a.dtype)),
        httpclient.InferInput("INPUT1", b.shape, np_to_triton_dtype(b.dtype)),
        httpclient.InferInput("MODEL_NAME", [1], np_to_triton_dtype(np.object_)),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0"),
        httpclient.InferRequestedOutput("OUTPUT1"),
    ]
    for target in ("add_sub", "pytorch"):
        inputs[2].set_data_from_numpy(np.array([target], dtype=np.object_))
        response = client.infer("bls_sync", inputs, request_id="1", outputs=outputs)
        if not np.allclose(a + b, response.as_numpy("OUTPUT0")):
            print(f"BLS sync example error ({target}): incorrect sum")
            sys.exit(1)
        if not np.allclose(a - b, response.as_numpy("OUTPUT1")):
            print(f"BLS sync example error ({target}): incorrect difference")
            sys.exit(1)
    inputs[2].set_data_from_numpy(np.array(["undefined_model"], dtype=np.object_))
    try:
        client.infer("bls_sync", inputs, request_id="1", outputs=outputs)
    except InferenceServerException as error:
        print(error.message())
    else:
        print("BLS sync example error: a request for an undefined model succeeded")
        sys.exit(1)
print("PASS: BLS Sync")
