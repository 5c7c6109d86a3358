"""tritonclient.http infer with JSON or binary tensors; inputs/outputs as .npz.

argv: host:port, model, inputs.npz, outputs.npz, binary (true/false)
"""

import json
import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

url, model, in_path, out_path, binary = (json.loads(a) for a in sys.argv[1:6])
arrays = dict(np.load(in_path))
client = httpclient.InferenceServerClient(url)
inputs = []
for name, array in arrays.items():
    tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array, binary_data=binary)
    inputs.append(tensor)
metadata = client.get_model_metadata(model)
outputs = [
    httpclient.InferRequestedOutput(o["name"], binary_data=binary) for o in metadata["outputs"]
]
result = client.infer(model, inputs, outputs=outputs)
names = [o["name"] for o in metadata["outputs"]]
np.savez(out_path, **{name: result.as_numpy(name) for name in names})
print(json.dumps({"outputs": names, "live": client.is_server_live()}))
