"""square_int32 over a gRPC stream: four requests in flight; IN = n gets n responses."""

import queue
import sys
from functools import partial

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

values = [4, 2, 0, 1]
completed = queue.Queue()


def callback(result, error):
    completed.put(error if error else result)


with grpcclient.InferenceServerClient(url=sys.argv[1]) as client:
    client.start_stream(callback=partial(callback))
    for index, value in enumerate(values):
        tensor = grpcclient.InferInput("IN", [1], np_to_triton_dtype(np.int32))
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        client.async_stream_infer(
            model_name="square_int32",
            inputs=[tensor],
            request_id=str(index),
            outputs=[grpcclient.InferRequestedOutput("OUT")],
        )
    by_id = {}
    for _ in range(sum(values)):
        item = completed.get(timeout=60)
        if isinstance(item, InferenceServerException):
            raise item
        by_id.setdefault(item.get_response().id, []).append(item)
    client.stop_stream()
    for index, value in enumerate(values):
        got = by_id.get(str(index), [])
        if len(got) != value:
            print(f"expected {value} responses for request id {index}, got {len(got)}")
            sys.exit(1)
        for result in got:
            if not np.array_equal(result.as_numpy("OUT"), np.array([value], np.int32)):
                print(f"incorrect data for request {index}: {result.as_numpy('OUT')}")
                sys.exit(1)
    if not completed.empty():
        print(f"unexpected extra response: {completed.get()}")
        sys.exit(1)
print("PASS: square_int32")
