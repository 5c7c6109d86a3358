"""Infer each model of the hand-written repository of test_cli.py via tritonclient.grpc."""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient

url, names = (json.loads(a) for a in sys.argv[1:3])
client = grpcclient.InferenceServerClient(url)
x = np.array([[0.0, 1.0, 2.0, -3.0], [0.5, 4.0, 10.0, -1.0]], dtype=np.float32)
answers = {}
for name in names:
    tensor = grpcclient.InferInput("X", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(name, [tensor], outputs=[grpcclient.InferRequestedOutput("Y")])
    answers[name] = result.as_numpy("Y").tolist()
print(json.dumps({"x": x.tolist(), "answers": answers}))
