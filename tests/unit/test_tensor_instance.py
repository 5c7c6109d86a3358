"""TensorInstance: one request's bad data in a merged batch fails only that request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from google.protobuf import text_format

from inference import model_config_pb2 as mc
from shared.backend import ModelSpec, TensorInstance
from shared.errors import InvalidArgument
from shared.request import InferRequest, InferResponse

CONFIG = """
name: "lookup" backend: "python" max_batch_size: 8
input [ { name: "IDS" data_type: TYPE_INT64 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


class Lookup(TensorInstance):
    """An embedding lookup over a table of 10 rows: ids outside it are the caller's error."""

    table = np.arange(10, dtype=np.float32)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = inputs["IDS"]
        if ids.min() < 0 or ids.max() >= len(self.table):
            raise InvalidArgument("model 'lookup': input 'IDS' holds an id outside 0..9")
        return {"OUT": self.table[ids]}


def request(*ids: int) -> InferRequest:
    return InferRequest("lookup", "1", {"IDS": np.array([ids], np.int64)})


def test_a_bad_request_in_a_merged_batch_fails_alone() -> None:
    config = text_format.Parse(CONFIG, mc.ModelConfig())
    instance = Lookup(ModelSpec("lookup", 1, Path("."), config))
    good, bad, other = instance.execute([request(1, 2), request(3, 1000), request(4, 5)])
    assert isinstance(good, InferResponse) and good.outputs["OUT"].tolist() == [[1.0, 2.0]]
    assert isinstance(other, InferResponse) and other.outputs["OUT"].tolist() == [[4.0, 5.0]]
    assert isinstance(bad, InvalidArgument)
    assert "outside 0..9" in bad.message
