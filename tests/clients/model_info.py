"""Metadata, config, readiness, repository index and statistics via tritonclient.grpc."""

import json
import sys

import tritonclient.grpc as grpcclient

url, model = (json.loads(a) for a in sys.argv[1:3])
client = grpcclient.InferenceServerClient(url)
print(
    json.dumps(
        {
            "metadata": client.get_model_metadata(model, as_json=True),
            "config": client.get_model_config(model, as_json=True),
            "ready": client.is_model_ready(model),
            "index": client.get_model_repository_index(as_json=True).get("models", []),
            "statistics": client.get_inference_statistics(model, as_json=True),
        }
    )
)
