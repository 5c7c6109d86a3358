"""add_sub and echo over tritonclient.http: JSON and binary tensors, compression, errors.

Prints the outputs of each case as JSON lists, keyed by case name.
"""

import json
import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

url = json.loads(sys.argv[1])
client = httpclient.InferenceServerClient(url)
a = np.arange(8, dtype=np.float32).reshape(2, 4)
b = np.full((2, 4), 0.5, dtype=np.float32)


def add_sub(binary_in, binary_out, **options):
    inputs = []
    for name, array, binary in (("INPUT0", a, binary_in[0]), ("INPUT1", b, binary_in[1])):
        tensor = httpclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    outputs = None
    if binary_out is not None:
        outputs = [
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out[0]),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary_out[1]),
        ]
    result = client.infer("add_sub", inputs, outputs=outputs, request_id="r1", **options)
    response = result.get_response()
    return {
        "id": response.get("id"),
        "OUTPUT0": result.as_numpy("OUTPUT0").tolist(),
        "OUTPUT1": result.as_numpy("OUTPUT1").tolist(),
        "binary": [
            "binary_data_size" in (result.get_output(n).get("parameters") or {})
            for n in ("OUTPUT0", "OUTPUT1")
        ],
    }


def echo(binary):
    text = np.array([["héllo", "wörld"], ["", "x y"]], dtype=object)
    tensor = httpclient.InferInput("TEXT", [2, 2], "BYTES")
    tensor.set_data_from_numpy(text, binary_data=binary)
    outputs = [
        httpclient.InferRequestedOutput("UPPER", binary_data=binary),
        httpclient.InferRequestedOutput("LENGTH", binary_data=binary),
    ]
    result = client.infer("echo", [tensor], outputs=outputs)
    upper = result.as_numpy("UPPER")
    return {
        "UPPER": [
            [item.decode() if isinstance(item, bytes) else item for item in row] for row in upper
        ],
        "LENGTH": result.as_numpy("LENGTH").tolist(),
    }


def error(model, shape):
    tensor = httpclient.InferInput("INPUT0", shape, "FP32")
    tensor.set_data_from_numpy(np.zeros(shape, dtype=np.float32))
    other = httpclient.InferInput("INPUT1", shape, "FP32")
    other.set_data_from_numpy(np.zeros(shape, dtype=np.float32))
    try:
        client.infer(model, [tensor, other])
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return None


print(
    json.dumps(
        {
            "json": add_sub((False, False), (False, False)),
            "binary": add_sub((True, True), (True, True)),
            "default_outputs": add_sub((True, True), None),
            "mixed": add_sub((True, False), (False, True)),
            "gzip": add_sub(
                (True, False),
                (True, False),
                request_compression_algorithm="gzip",
                response_compression_algorithm="gzip",
            ),
            "deflate": add_sub(
                (False, True),
                (False, True),
                request_compression_algorithm="deflate",
                response_compression_algorithm="deflate",
            ),
            "echo_json": echo(False),
            "echo_binary": echo(True),
            "unknown_model": error("no_such_model", [1, 4]),
            "wrong_shape": error("add_sub", [1, 3]),
        }
    )
)
