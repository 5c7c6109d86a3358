"""An input sent both raw and in typed ``contents`` is refused in Triton's words,
by a stage, by the orchestrator forwarding to it, and by an ensemble.

Triton's example clients match on "contents field must not be specified when
using raw_input_contents for 'INPUT0' for model 'simple'".
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs
from tests.conftest import DATA
from tests.in_process import MeshThread

# An ensemble over "simple", so the orchestrator's own decoding is exercised.
PAIR = """
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "simple" model_version: -1
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "SUM" } }
] }
"""

ROW = [1.0, 2.0, 3.0, 4.0]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixed-contents")
    shutil.copytree(DATA / "models" / "add_sub", root / "simple")
    config = root / "simple" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "add_sub"', 'name: "simple"'))
    (root / "pair" / "1").mkdir(parents=True)
    (root / "pair" / "config.pbtxt").write_text(f'platform: "ensemble"\nmax_batch_size: 8\n{PAIR}')
    return root


@pytest.fixture(scope="module")
def mesh(repo: Path) -> Iterator[MeshThread]:
    """A stage and the orchestrator, served in this process (tests/in_process.py)."""
    served = MeshThread(repo)
    yield served
    served.close()


def _address(mesh: MeshThread, target: str) -> str:
    return mesh.mesh.stages[0].address if target == "stage" else mesh.address


def _call(address: str, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    with grpc.insecure_channel(address) as channel:
        answer: pb.ModelInferResponse = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=30
        )
        return answer


def _typed_request(model: str, names: tuple[str, str]) -> pb.ModelInferRequest:
    """Both inputs in typed contents (valid on its own)."""
    request = pb.ModelInferRequest(model_name=model)
    for name in names:
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        tensor.contents.fp32_contents.extend(ROW)
    return request


def _mixed(model: str, names: tuple[str, str], raw_entries: int) -> pb.ModelInferRequest:
    """Typed contents on every input plus ``raw_entries`` raw buffers, as Triton's
    test builds it (one raw buffer beside two typed inputs) or one per input."""
    request = _typed_request(model, names)
    request.raw_input_contents.extend(
        [np.asarray(ROW, dtype=np.float32).reshape(1, 4).tobytes()] * raw_entries
    )
    return request


CASES = [("simple", ("INPUT0", "INPUT1")), ("pair", ("A", "B"))]
# A stage's model, straight and forwarded; the ensemble only the orchestrator has.
TARGETS = [("stage", *CASES[0]), ("orchestrator", *CASES[0]), ("orchestrator", *CASES[1])]


@pytest.mark.parametrize(("target", "model", "names"), TARGETS)
@pytest.mark.parametrize("raw_entries", [1, 2])
def test_raw_beside_typed_contents_is_invalid_argument_in_tritons_words(
    mesh: MeshThread,
    model: str,
    names: tuple[str, str],
    raw_entries: int,
    target: str,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _call(_address(mesh, target), _mixed(model, names, raw_entries))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "contents field must not be specified when using raw_input_contents for "
        f"'{names[0]}' for model '{model}'"
    )


@pytest.mark.parametrize(("model", "names"), CASES)
def test_typed_contents_alone_still_answer(
    mesh: MeshThread, model: str, names: tuple[str, str]
) -> None:
    outputs = decode_outputs(_call(mesh.address, _typed_request(model, names)))
    total = outputs["OUTPUT0" if model == "simple" else "SUM"]
    np.testing.assert_allclose(total, [[2.0, 4.0, 6.0, 8.0]])
