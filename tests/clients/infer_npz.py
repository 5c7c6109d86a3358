"""Run one model through tritonclient in a given mode; inputs and outputs as .npz.

argv: url, model, inputs.npz, outputs.npz, mode ("sync" | "aio" | "stream"), [version]
Prints JSON: {"outputs": [names], "model_version": str}.
"""

import asyncio
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import np_to_triton_dtype

url, model, in_path, out_path, mode = (json.loads(a) for a in sys.argv[1:6])
version = json.loads(sys.argv[6]) if len(sys.argv) > 6 else ""
arrays = dict(np.load(in_path, allow_pickle=True))


def make_inputs(module):
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def sync_infer():
    client = grpcclient.InferenceServerClient(url)
    return client.infer(model, make_inputs(grpcclient), model_version=version)


async def aio_infer():
    async with aioclient.InferenceServerClient(url) as client:
        return await client.infer(model, make_inputs(aioclient), model_version=version)


def stream_infer():
    client = grpcclient.InferenceServerClient(url)
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, make_inputs(grpcclient), model_version=version)
    try:
        result, error = results.get(timeout=120)
    except queue.Empty:
        # Cancel, do not wait: the stream's thread would wait for the server for good.
        client.stop_stream(cancel_requests=True)
        raise
    client.stop_stream()
    if error is not None:
        raise error
    return result


result = {"sync": sync_infer, "stream": stream_infer}.get(mode, lambda: asyncio.run(aio_infer()))()
response = result.get_response()
names = [output.name for output in response.outputs]
np.savez(out_path, **{name: result.as_numpy(name) for name in names})
print(json.dumps({"outputs": names, "model_version": response.model_version}))
