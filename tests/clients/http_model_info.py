"""Health, metadata, config, readiness, index and statistics via tritonclient.http."""

import json
import sys

import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

url, model = (json.loads(a) for a in sys.argv[1:3])
client = httpclient.InferenceServerClient(url)
try:
    client.get_model_metadata("no_such_model")
    missing = None
except InferenceServerException as exc:
    missing = {"status": exc.status(), "message": exc.message()}
print(
    json.dumps(
        {
            "live": client.is_server_live(),
            "ready": client.is_server_ready(),
            "server": client.get_server_metadata(),
            "metadata": client.get_model_metadata(model),
            "metadata_v1": client.get_model_metadata(model, model_version="1"),
            "config": client.get_model_config(model),
            "model_ready": client.is_model_ready(model),
            "missing_ready": client.is_model_ready("no_such_model"),
            "missing_metadata": missing,
            "index": client.get_model_repository_index(),
        }
    )
)
