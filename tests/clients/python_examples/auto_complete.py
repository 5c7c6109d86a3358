"""The configs auto_complete_config made, read back over HTTP, then an inference each."""

import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

expected_batch = {"nobatch_auto_complete": 0, "batch_auto_complete": 4}
expected = {
    "input": [{"name": f"INPUT{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in (0, 1)],
    "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in (0, 1)],
}
with httpclient.InferenceServerClient(sys.argv[1]) as client:
    for model, batch in expected_batch.items():
        config = client.get_model_config(model)
        if config["max_batch_size"] != batch:
            print(f"model '{model}' has unexpected max_batch_size {config['max_batch_size']}")
            sys.exit(1)
        for kind, tensors in expected.items():
            got = {t["name"]: (t["data_type"], t["dims"]) for t in config[kind]}
            for tensor in tensors:
                if got.get(tensor["name"]) != (tensor["data_type"], tensor["dims"]):
                    print(f"model '{model}' {kind} {tensor['name']}: {got.get(tensor['name'])}")
                    sys.exit(1)
        shape = [1, 4] if batch else [4]
        a = np.random.rand(*shape).astype(np.float32)
        b = np.random.rand(*shape).astype(np.float32)
        inputs = [
            httpclient.InferInput("INPUT0", shape, np_to_triton_dtype(a.dtype)),
            httpclient.InferInput("INPUT1", shape, np_to_triton_dtype(b.dtype)),
        ]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        response = client.infer(model, inputs)
        if not np.allclose(a + b, response.as_numpy("OUTPUT0")):
            print(f"model '{model}': incorrect sum")
            sys.exit(1)
        print(f"'{model}' configuration matches the expected auto complete configuration")
print("PASS: auto_complete")
