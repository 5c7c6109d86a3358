"""The worked canary of docs/traffic-management.md, run on the real MobileNetV2 models.

    python -m loadtests.canary_mobilenet [--repository ~/.cache/meshserve/repository]

The prepared repository has MobileNetV2 twice: TorchScript (``mobilenet_v2``,
the current model) and ONNX (``mobilenet_v2_onnx``, the candidate). A route
``mobilenet`` starts on the current model with the candidate as a shadow;
then the candidate takes 10%, 50%, and is promoted. Real photos (scikit-image's
sample images, preprocessed as the image pipeline does) go in through KServe
v2 gRPC; after each phase the script prints ``meshserve route status``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from loadtests.common import DEFAULT_REPOSITORY, ROOT, load_average, missing_models, running_mesh
from services.preprocess.transform import preprocess
from shared.tensors import encode_inputs

MODELS = ["mobilenet_v2", "mobilenet_v2_onnx"]
ROUTES = """
routes:
  mobilenet:
    targets:
      - {model: mobilenet_v2, weight: 100}
      - {model: mobilenet_v2_onnx, weight: 0}
    shadow: {model: mobilenet_v2_onnx, fraction: 1.0}
    rollback: {window_s: 120, min_requests: 20, error_ratio_margin: 0.02, p99_margin_ms: 250}
"""


def photos() -> list[np.ndarray]:
    """scikit-image's colour sample photos as the classifier's input tensors."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scikit-image is not installed (its sample photos are the inputs)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    names = ["astronaut", "chelsea", "coffee", "horse", "motorcycle_left", "rocket", "color"]
    return [
        preprocess((folder / f"{name}.png").read_bytes())
        for name in names
        if (folder / f"{name}.png").is_file()
    ]


def send(
    stub: pb_grpc.GRPCInferenceServiceStub, images: list[np.ndarray], count: int
) -> Counter[str]:
    """``count`` requests on the route (images in turn); who served them."""
    served: Counter[str] = Counter()
    for index in range(count):
        request = pb.ModelInferRequest(model_name="mobilenet")
        encode_inputs(request, {"input": images[index % len(images)][np.newaxis]})
        answer = stub.ModelInfer(request, timeout=60)
        served[answer.parameters["route_target"].string_param] += 1
    return served


def route(url: str, *args: str) -> None:
    """Run ``meshserve route ARGS`` and print what it prints."""
    command = [sys.executable, "-m", "deploy.cli", "route", *args, "--url", url]
    print(f"$ meshserve route {' '.join(args)}")
    print(subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout)


def run(repository: Path, per_phase: int) -> None:
    """Shadow, 10%, 50%, promotion; the route's status after each."""
    missing = missing_models(repository, MODELS)
    if missing:
        raise SystemExit(f"missing in {repository}: {missing} (run make models)")
    images = photos()
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        for name in MODELS:
            (repo / name).symlink_to(repository / name, target_is_directory=True)
        (repo / "routes.yaml").write_text(ROUTES)
        with running_mesh(repo) as mesh, grpc.insecure_channel(mesh.orchestrator) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            url = mesh.orchestrator
            print("shadow phase:", dict(send(stub, images, per_phase)))
            route(url, "status", "mobilenet")
            route(url, "set", "mobilenet", "mobilenet_v2=90", "mobilenet_v2_onnx=10")
            print("10% phase:", dict(send(stub, images, per_phase)))
            route(url, "set", "mobilenet", "mobilenet_v2=50", "mobilenet_v2_onnx=50")
            print("50% phase:", dict(send(stub, images, per_phase)))
            route(url, "status", "mobilenet")
            route(url, "promote", "mobilenet", "mobilenet_v2_onnx")
            print("promoted:", dict(send(stub, images, per_phase // 2)))
    print(f"load average: {load_average()}")


def main() -> None:
    """Parse the flags and run the canary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY.expanduser())
    parser.add_argument("--requests", type=int, default=60, help="requests per phase")
    args = parser.parse_args()
    run(args.repository.expanduser(), args.requests)


if __name__ == "__main__":
    main()
