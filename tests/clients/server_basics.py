"""tritonclient.grpc: ServerLive, ServerReady, ServerMetadata. Prints JSON."""

import json
import sys

import tritonclient.grpc as grpcclient

url = json.loads(sys.argv[1])
client = grpcclient.InferenceServerClient(url)
metadata = client.get_server_metadata(as_json=True)
print(
    json.dumps(
        {
            "live": client.is_server_live(),
            "ready": client.is_server_ready(),
            "name": metadata["name"],
            "version": metadata["version"],
            "extensions": metadata.get("extensions", []),
        }
    )
)
