"""A route through tritonclient (gRPC and HTTP): override, sticky key, metadata.

Prints, per protocol, who served each case and the first output row.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

grpc_url, http_url, route = (json.loads(a) for a in sys.argv[1:4])
x = np.arange(1, 5, dtype=np.float32).reshape(1, 4)


def grpc_cases():
    client = grpcclient.InferenceServerClient(grpc_url)
    tensor = grpcclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)

    def call(**options):
        result = client.infer(route, [tensor], **options)
        served = result.get_response().parameters["route_target"].string_param
        return {"target": served, "Y": result.as_numpy("Y")[0].tolist()}

    return {
        "metadata": client.get_model_metadata(route, as_json=True)["name"],
        "override": call(headers={"x-meshserve-route-target": "m:2"}),
        "sticky": [call(parameters={"route_key": "user-7"}) for _ in range(3)],
    }


def http_cases():
    client = httpclient.InferenceServerClient(http_url)
    tensor = httpclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)

    def call(**options):
        result = client.infer(route, [tensor], **options)
        served = result.get_response()["parameters"]["route_target"]
        return {"target": served, "Y": result.as_numpy("Y")[0].tolist()}

    return {
        "metadata": client.get_model_metadata(route)["name"],
        "override": call(headers={"x-meshserve-route-target": "m:1"}),
        "override_parameter": call(parameters={"route_target": "m:2"}),
        "sticky": [call(parameters={"route_key": "user-7"}) for _ in range(3)],
    }


print(json.dumps({"grpc": grpc_cases(), "http": http_cases()}))
