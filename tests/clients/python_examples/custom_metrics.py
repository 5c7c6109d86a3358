"""custom_metrics over HTTP, then its counter on the metrics page (argv[2])."""

import sys
import urllib.request

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

with httpclient.InferenceServerClient(sys.argv[1]) as client:
    a = np.random.rand(4).astype(np.float32)
    b = np.random.rand(4).astype(np.float32)
    inputs = [
        httpclient.InferInput("INPUT0", a.shape, np_to_triton_dtype(a.dtype)),
        httpclient.InferInput("INPUT1", b.shape, np_to_triton_dtype(b.dtype)),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    response = client.infer("custom_metrics", inputs, request_id="1")
    if not np.allclose(a + b, response.as_numpy("OUTPUT0")):
        print("custom_metrics example error: incorrect sum")
        sys.exit(1)
    if not np.allclose(a - b, response.as_numpy("OUTPUT1")):
        print("custom_metrics example error: incorrect difference")
        sys.exit(1)
with urllib.request.urlopen(sys.argv[2], timeout=10) as page:
    metrics = page.read().decode()
for pattern in (
    "# HELP requests_process_latency_ns Cumulative time spent processing requests",
    "# TYPE requests_process_latency_ns counter",
    'requests_process_latency_ns{model="custom_metrics",version="1"}',
):
    if pattern not in metrics:
        print(f"custom_metrics example error: missing pattern '{pattern}' in metrics")
        sys.exit(1)
print("PASS: custom_metrics")
