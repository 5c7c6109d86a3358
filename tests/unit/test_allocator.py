"""Large tensors built and freed per request stay on mapped pages (shared/allocator.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A stage's answer with a MobileNet input (600 KB), built and serialised 50 times:
# the page faults the process takes meanwhile.
_CHILD = """
import resource, sys
import numpy as np
from inference import grpc_service_pb2 as pb
from shared.allocator import keep_large_blocks
if sys.argv[1] == "tuned":
    assert keep_large_blocks()
raw = np.ones((1, 3, 224, 224), dtype=np.float32).tobytes()
def answer():
    message = pb.ModelInferResponse(model_name="m")
    message.outputs.add(name="PIXELS", datatype="FP32", shape=[1, 3, 224, 224])
    message.raw_output_contents.append(raw)
    return pb.ModelStreamInferResponse(infer_response=message).SerializeToString()
answer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    answer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_large_answers_stop_faulting_pages_in() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    # Each answer is about 150 pages of 4 KB per copy; kept mapped, they fault once.
    assert default > 50 * 100
    assert tuned < default / 10
