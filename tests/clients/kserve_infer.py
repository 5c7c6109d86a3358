"""KServe's own Python clients against the mesh: InferenceRESTClient (protocol v2,
JSON and binary tensors) and InferenceGRPCClient (raw and typed tensors).

Runs under .venv-kserve (`make kserve-client`): kserve's generated gRPC code
defines the same `inference` protobuf package as ours.

argv: host:port, mlp inputs.npz (INPUT0), outputs.npz
Writes each case's OUTPUT0 of `mlp` to outputs.npz under the case's name;
prints readiness, the text_embedding answers' facts and the refused request's
status and message as JSON.
"""

import asyncio
import json
import sys

import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import RequestedOutput

address, in_path, out_path = (json.loads(a) for a in sys.argv[1:4])
base_url = f"http://{address}"
INPUT0 = np.load(in_path)["INPUT0"]
SENTENCES = np.array(
    [[b"A man is playing a guitar."], [b"Someone plays an acoustic guitar."]], dtype=object
)


def tensor(name, array, binary):
    datatype = "BYTES" if array.dtype == object else "FP32"
    infer_input = InferInput(name, list(array.shape), datatype)
    infer_input.set_data_from_numpy(array, binary_data=binary)
    return infer_input


def rest_request(model, name, array, binary):
    """Binary in and out, or JSON in and out (the client's two REST forms)."""
    outputs = None
    if binary:
        outputs = [
            RequestedOutput("OUTPUT0" if model == "mlp" else "EMBEDDING", {"binary_data": True})
        ]
    return InferRequest(model, [tensor(name, array, binary)], request_outputs=outputs)


def output(response, name):
    return next(o for o in response.outputs if o.name == name).as_numpy()


async def rest_cases(results, facts):
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=120))
    facts["rest_ready"] = [
        await client.is_server_ready(base_url),
        await client.is_model_ready(base_url, "mlp"),
    ]
    for binary in (False, True):
        kind = "binary" if binary else "json"
        answer = await client.infer(base_url, rest_request("mlp", "INPUT0", INPUT0, binary), "mlp")
        results[f"rest_{kind}"] = output(answer, "OUTPUT0")
        request = rest_request("text_embedding", "TEXT", SENTENCES, binary)
        answer = await client.infer(base_url, request, "text_embedding")
        embedding = output(answer, "EMBEDDING")
        facts[f"embedding_{kind}"] = {
            "shape": list(embedding.shape),
            "cosine": float(embedding[0] @ embedding[1]),
        }
    # The body as a dict, naming the model and its version as KServe's servers accept.
    body = {
        "model_name": "mlp",
        "model_version": "1",
        "inputs": [
            {
                "name": "INPUT0",
                "shape": list(INPUT0.shape),
                "datatype": "FP32",
                "data": INPUT0.flatten().tolist(),
            }
        ],
    }
    results["rest_dict_with_version"] = output(await client.infer(base_url, body, "mlp"), "OUTPUT0")
    # A body naming another model than the URL.
    try:
        await client.infer(base_url, rest_request("text_embedding", "INPUT0", INPUT0, False), "mlp")
        facts["contradiction"] = None
    except httpx.HTTPStatusError as exc:
        facts["contradiction"] = {
            "status": exc.response.status_code,
            "error": exc.response.json().get("error"),
        }
    await client.close()


async def grpc_cases(results, facts):
    client = InferenceGRPCClient(address, timeout=120)
    facts["grpc_ready"] = [await client.is_server_ready(), await client.is_model_ready("mlp")]
    raw = InferRequest("mlp", [InferInput("INPUT0", list(INPUT0.shape), "FP32", data=INPUT0)])
    results["grpc_raw"] = output(await client.infer(raw), "OUTPUT0")
    typed_input = InferInput("INPUT0", list(INPUT0.shape), "FP32", data=INPUT0.flatten().tolist())
    results["grpc_typed"] = output(
        await client.infer(InferRequest("mlp", [typed_input])), "OUTPUT0"
    )
    answer = await client.infer(
        InferRequest("text_embedding", [InferInput("TEXT", [2, 1], "BYTES", data=SENTENCES)])
    )
    embedding = output(answer, "EMBEDDING")
    facts["embedding_grpc"] = {
        "shape": list(embedding.shape),
        "cosine": float(embedding[0] @ embedding[1]),
    }
    await client.close()


async def main():
    results, facts = {}, {}
    await rest_cases(results, facts)
    await grpc_cases(results, facts)
    np.savez(out_path, **results)
    print(json.dumps(facts))


asyncio.run(main())
