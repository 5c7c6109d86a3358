"""repeat_int32 over a gRPC stream: one response per element of IN, in order."""

import queue
import sys
from functools import partial

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

values, delays, wait = [4, 2, 0, 1], [1, 2, 3, 4], 5
completed = queue.Queue()


def callback(result, error):
    completed.put(error if error else result)


inputs = [
    grpcclient.InferInput("IN", [len(values)], "INT32"),
    grpcclient.InferInput("DELAY", [len(delays)], "UINT32"),
    grpcclient.InferInput("WAIT", [1], "UINT32"),
]
inputs[0].set_data_from_numpy(np.array(values, dtype=np.int32))
inputs[1].set_data_from_numpy(np.array(delays, dtype=np.uint32))
inputs[2].set_data_from_numpy(np.array([wait], dtype=np.uint32))
outputs = [grpcclient.InferRequestedOutput("OUT"), grpcclient.InferRequestedOutput("IDX")]
with grpcclient.InferenceServerClient(url=sys.argv[1]) as client:
    client.start_stream(callback=partial(callback))
    client.async_stream_infer(
        model_name="repeat_int32", inputs=inputs, request_id="0", outputs=outputs
    )
    received = []
    while len(received) < len(values):
        item = completed.get(timeout=60)
        if isinstance(item, InferenceServerException):
            raise item
        received.append(item)
    for index, result in enumerate(received):
        if result.get_response().id != "0":
            print(f"response {index} has id {result.get_response().id!r}, expected '0'")
            sys.exit(1)
        if not np.array_equal(result.as_numpy("OUT"), np.array([values[index]], np.int32)):
            print(f"incorrect data: expected {values[index]}, got {result.as_numpy('OUT')}")
            sys.exit(1)
        if result.as_numpy("IDX")[0] != index:
            print(f"incorrect IDX: expected {index}, got {result.as_numpy('IDX')}")
            sys.exit(1)
    client.stop_stream()
print("PASS: repeat_int32")
