"""The ``onnxruntime`` backend: ``model.onnx`` run by an ONNX Runtime session."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from shared.backend import InstanceSpec, ModelSpec, TensorInstance
from shared.errors import ConfigError


class OnnxInstance(TensorInstance):
    """One ONNX Runtime session on one device."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        super().__init__(spec)
        path = spec.model_file("model.onnx")
        if not path.is_file():
            raise ConfigError(
                f"model '{spec.name}' version {spec.version}: no {path.name} in {spec.path}"
            )
        options = ort.SessionOptions()
        options.intra_op_num_threads = instance.intra_op_threads
        options.inter_op_num_threads = 1
        # Spinning threads steal the cores torch instances in the same process need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # float32 stays float32 whatever the CPU: MLAS may run float32 GEMMs in
        # bfloat16 on arm64 CPUs that have it. Off by default; pinned so that
        # no default changing under us makes answers differ by host.
        options.add_session_config_entry("mlas.enable_gemm_fastmath_arm64_bfloat16", "0")
        # Named, never "whatever is installed": an accelerated provider (oneDNN,
        # OpenVINO) picked by the host could compute in another precision.
        providers: list[str | tuple[str, dict[str, str]]] = ["CPUExecutionProvider"]
        if instance.device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise ConfigError(
                    f"model '{spec.name}': KIND_GPU needs onnxruntime-gpu "
                    "(CUDAExecutionProvider is not available)"
                )
            device_id = instance.device.split(":")[1]
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device_id}))
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        graph_inputs = {item.name for item in self.session.get_inputs()}
        missing = [t.name for t in spec.config.input if t.name not in graph_inputs]
        if missing:
            raise ConfigError(
                f"model '{spec.name}': config inputs {missing} are not inputs "
                f"of the ONNX graph {sorted(graph_inputs)}"
            )

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One session run over the declared outputs."""
        values = self.session.run(self.output_names, inputs)
        return dict(zip(self.output_names, values, strict=True))


class OnnxBackend:
    """Creates OnnxInstance objects."""

    name = "onnxruntime"

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> OnnxInstance:
        """Create one session (in the instance's own thread)."""
        return OnnxInstance(model, instance)
