"""Log and trace settings, and the shared-memory calls, via tritonclient.http."""

import json
import sys

import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

url, model = (json.loads(a) for a in sys.argv[1:3])
client = httpclient.InferenceServerClient(url)


def refused(call, *args):
    """What the server said when ``call`` failed (None: it did not fail)."""
    try:
        call(*args)
    except InferenceServerException as exc:
        return exc.message()
    return None


before = client.get_log_settings()
client.update_log_settings({"log_verbose_level": 1})
changed = client.get_log_settings()
client.update_log_settings({"log_verbose_level": before["log_verbose_level"]})
print(
    json.dumps(
        {
            "log_before": before,
            "log_changed": changed,
            "log_after": client.get_log_settings(),
            "log_unknown": refused(client.update_log_settings, {"log_colour": "blue"}),
            "log_negative": refused(client.update_log_settings, {"log_verbose_level": -1}),
            "trace": client.get_trace_settings(),
            "trace_model": client.get_trace_settings(model_name=model),
            "shm_status": refused(client.get_system_shared_memory_status),
            "shm_register": refused(
                client.register_system_shared_memory, "region", "/meshserve_shm", 64
            ),
            "cuda_status": refused(client.get_cuda_shared_memory_status),
        }
    )
)
