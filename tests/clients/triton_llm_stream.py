"""Stream requests to a decoupled model through tritonclient.grpc; collect every response.

argv: url, model, requests (list of [request_id, inputs.npz]).
Prints JSON: per request id, its responses (NEW_TOKENS, OUTPUT_IDS, ENGINE_FINISH and
the triton_final_response flag) and its error message, if any. Each response is
also logged to stderr as it comes; a client that waits too long prints every
thread's stack there and exits.
"""

import faulthandler
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

url, model, requests = (json.loads(a) for a in sys.argv[1:4])
# tritonclient's stream thread is no daemon: a hang would keep the process alive
# for good. Within the harness's limit, show where it waits and exit.
faulthandler.dump_traceback_later(180, exit=True)


def make_inputs(path):
    inputs = []
    for name, array in np.load(path, allow_pickle=True).items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


results = queue.Queue()
client = grpcclient.InferenceServerClient(url)
client.start_stream(callback=lambda result, error: results.put((result, error)))
for request_id, path in requests:
    client.async_stream_infer(model, make_inputs(path), request_id=request_id)

answers = {request_id: {"responses": [], "error": None} for request_id, _ in requests}


def collect():
    pending = set(answers)
    while pending:
        result, error = results.get()
        print(f"error: {error}" if error else result.get_response().id, file=sys.stderr)
        if error is not None:
            # tritonclient drops the response (and its id) of an error; one bad request per run.
            bad = [r for r in pending if r.startswith("bad")]
            if len(bad) != 1:
                raise RuntimeError(f"an error no bad request accounts for: {error}")
            answers[bad[0]]["error"] = str(error)
            pending.discard(bad[0])
            continue
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        answers[response.id]["responses"].append(
            {
                "new_tokens": int(result.as_numpy("NEW_TOKENS")[0]),
                "output_ids": result.as_numpy("OUTPUT_IDS").tolist(),
                "finish": result.as_numpy("ENGINE_FINISH")[0].decode(),
                "final": final,
            }
        )
        if final:
            pending.discard(response.id)


try:
    collect()
except BaseException:
    # Cancel, do not wait: the stream's thread would wait for the server for good.
    client.stop_stream(cancel_requests=True)
    raise
print("every response is in; closing the stream", file=sys.stderr)
client.stop_stream()
print(json.dumps(answers))
