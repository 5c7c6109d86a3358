"""Statistics, unload and load of one model via tritonclient.http."""

import json
import sys

import tritonclient.http as httpclient

url, model = (json.loads(a) for a in sys.argv[1:3])
client = httpclient.InferenceServerClient(url)
stats = client.get_inference_statistics(model)
all_stats = client.get_inference_statistics()
client.unload_model(model)
after_unload = client.is_model_ready(model)
client.load_model(model)
print(
    json.dumps(
        {
            "stats": stats,
            "all_stats": all_stats,
            "ready_after_unload": after_unload,
            "ready_after_load": client.is_model_ready(model),
        }
    )
)
