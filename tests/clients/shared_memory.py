"""Tensors through system shared memory, the way Triton's simple_*_shm_client examples
pass them: tritonclient's shared_memory utilities, over gRPC or HTTP."""

import json
import os
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

protocol, url, model = (json.loads(a) for a in sys.argv[1:4])
client_module = grpcclient if protocol == "grpc" else httpclient
client = client_module.InferenceServerClient(url)
tag = f"meshserve_{protocol}_{os.getpid()}"
ROW = 16  # one FP32 [1, 4] tensor


def refused(call, *args, **kwargs):
    """What the server said when ``call`` failed (None: it did not fail)."""
    try:
        call(*args, **kwargs)
    except InferenceServerException as exc:
        return exc.message()
    return None


def region_names():
    status = client.get_system_shared_memory_status()
    if protocol == "grpc":
        return sorted(status.regions)
    return sorted(region["name"] for region in status)


def shm_input(name, region, offset=0):
    tensor = client_module.InferInput(name, [1, 4], "FP32")
    tensor.set_shared_memory(region, ROW, offset=offset)
    return tensor


def shm_output(name, region, offset=0, size=ROW):
    if protocol == "grpc":
        wanted = grpcclient.InferRequestedOutput(name)
    else:
        wanted = httpclient.InferRequestedOutput(name, binary_data=True)
    wanted.set_shared_memory(region, size, offset=offset)
    return wanted


a = np.array([[1, 2, 3, 4]], dtype=np.float32)
b = np.array([[10, 20, 30, 40]], dtype=np.float32)
client.unregister_system_shared_memory()
inputs = shm.create_shared_memory_region(f"{tag}_in", f"/{tag}_in", 2 * ROW)
outputs = shm.create_shared_memory_region(f"{tag}_out", f"/{tag}_out", 2 * ROW)
try:
    shm.set_shared_memory_region(inputs, [a, b])
    client.register_system_shared_memory("in", f"/{tag}_in", 2 * ROW)
    client.register_system_shared_memory("out", f"/{tag}_out", 2 * ROW)
    registered = region_names()

    # Every tensor in shared memory: the answer carries none of them.
    result = client.infer(
        model,
        [shm_input("INPUT0", "in"), shm_input("INPUT1", "in", offset=ROW)],
        outputs=[shm_output("OUTPUT0", "out"), shm_output("OUTPUT1", "out", offset=ROW)],
    )
    # Views of the region: read them before the next request writes it again.
    summed = shm.get_contents_as_numpy(outputs, np.float32, [1, 4]).tolist()
    diff = shm.get_contents_as_numpy(outputs, np.float32, [1, 4], offset=ROW).tolist()
    if protocol == "grpc":
        carried = [len(raw) for raw in result.get_response().raw_output_contents]
    else:
        carried = [
            "data" in output or "binary_data_size" in output.get("parameters", {})
            for output in result.get_response()["outputs"]
        ]

    # Mixed: one input and one output in shared memory, the others in the message.
    second = client_module.InferInput("INPUT1", [1, 4], "FP32")
    second.set_data_from_numpy(b * 2)
    plain = (
        grpcclient.InferRequestedOutput("OUTPUT1")
        if protocol == "grpc"
        else httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)
    )
    mixed = client.infer(
        model, [shm_input("INPUT0", "in"), second], outputs=[shm_output("OUTPUT0", "out"), plain]
    )
    mixed_sum = shm.get_contents_as_numpy(outputs, np.float32, [1, 4]).tolist()

    errors = {
        "unknown_region": refused(
            client.infer, model, [shm_input("INPUT0", "ghost"), shm_input("INPUT1", "in", ROW)]
        ),
        "past_the_end": refused(
            client.infer, model, [shm_input("INPUT0", "in", offset=24), shm_input("INPUT1", "in")]
        ),
        "output_too_small": refused(
            client.infer,
            model,
            [shm_input("INPUT0", "in"), shm_input("INPUT1", "in", ROW)],
            outputs=[shm_output("OUTPUT0", "out", size=8)],
        ),
        "twice": refused(client.register_system_shared_memory, "in", f"/{tag}_in", ROW),
        "no_object": refused(
            client.register_system_shared_memory, "nothing", f"/{tag}_absent", ROW
        ),
        "bad_key": refused(client.register_system_shared_memory, "bad", "/../etc/passwd", ROW),
        "cuda": refused(client.get_cuda_shared_memory_status),
    }
    # The service stayed healthy: an ordinary request still works.
    first = client_module.InferInput("INPUT0", [1, 4], "FP32")
    first.set_data_from_numpy(a)
    second = client_module.InferInput("INPUT1", [1, 4], "FP32")
    second.set_data_from_numpy(b)
    after = client.infer(model, [first, second]).as_numpy("OUTPUT0")
    client.unregister_system_shared_memory("in")
    left = region_names()
    client.unregister_system_shared_memory()
    print(
        json.dumps(
            {
                "extensions": client.get_server_metadata(as_json=True)["extensions"]
                if protocol == "grpc"
                else client.get_server_metadata()["extensions"],
                "registered": registered,
                "sum": summed,
                "diff": diff,
                "carried": carried,
                "mixed_sum": mixed_sum,
                "mixed_diff": mixed.as_numpy("OUTPUT1").tolist(),
                "errors": errors,
                "after": after.tolist(),
                "left": left,
                "finally": region_names(),
            }
        )
    )
finally:
    shm.destroy_shared_memory_region(inputs)
    shm.destroy_shared_memory_region(outputs)
