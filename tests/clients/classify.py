"""Triton's classification extension through tritonclient (grpc or http): class_count.

argv: protocol ("grpc" | "http"), url, model, first output, second output.
Sends INPUT0 = [[1, 4, 2, 3], [0, 0, 5, 5]], INPUT1 = 0; asks 2 classes of the
first output and 10 of the second. Prints JSON: output name -> rows of strings.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

protocol, url, model, first, second = (json.loads(a) for a in sys.argv[1:6])
module = grpcclient if protocol == "grpc" else httpclient
client = module.InferenceServerClient(url)
arrays = {
    "INPUT0": np.array([[1, 4, 2, 3], [0, 0, 5, 5]], dtype=np.float32),
    "INPUT1": np.zeros((2, 4), dtype=np.float32),
}
inputs = []
for name, array in arrays.items():
    tensor = module.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    inputs.append(tensor)
outputs = [
    module.InferRequestedOutput(first, class_count=2),
    module.InferRequestedOutput(second, class_count=10),
]
result = client.infer(model, inputs, outputs=outputs)
print(
    json.dumps(
        {
            name: [[item.decode() for item in row] for row in result.as_numpy(name)]
            for name in (first, second)
        }
    )
)
