"""The ``python`` backend: a user's ``model.py`` with initialize / execute / finalize.

The class is ``TritonPythonModel`` (the shape Triton's Python backend and, in
spirit, TorchServe handlers use): ``initialize(args)`` once per instance,
``execute(requests) -> responses`` per batch (a list in, a list out, one
response per request), ``finalize()`` on unload. The helper API is importable
as ``triton_python_backend_utils`` (see ``python_utils``).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from google.protobuf import json_format

from services.inference import python_utils
from shared.backend import InstanceSpec, ModelSpec
from shared.errors import ConfigError, InvalidArgument
from shared.request import InferRequest, InferResponse

UTILS_MODULE = "triton_python_backend_utils"


class PythonInstance:
    """One ``TritonPythonModel`` object."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        self.spec = spec
        source = spec.model_file("model.py")
        if not source.is_file():
            raise ConfigError(
                f"model '{spec.name}' version {spec.version}: no {source.name} in {spec.path}"
            )
        sys.modules.setdefault(UTILS_MODULE, python_utils)
        module_spec = importlib.util.spec_from_file_location(
            f"meshserve_python_{spec.name}_{spec.version}_{instance.name}", source
        )
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"{source}: cannot be imported")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        model_class = getattr(module, "TritonPythonModel", None)
        if model_class is None:
            raise ConfigError(f"{source}: defines no class TritonPythonModel")
        self.model = model_class()
        if hasattr(self.model, "initialize"):
            self.model.initialize(self._args(instance))

    def _args(self, instance: InstanceSpec) -> dict[str, str]:
        device_id = instance.device.split(":")[1] if ":" in instance.device else "0"
        return {
            "model_config": json_format.MessageToJson(
                self.spec.config, preserving_proto_field_name=True
            ),
            "model_instance_kind": "GPU" if instance.kind == "KIND_GPU" else "CPU",
            "model_instance_name": instance.name,
            "model_instance_device_id": device_id,
            "model_repository": str(self.spec.model_dir),
            "model_version": str(self.spec.version),
            "model_name": self.spec.name,
        }

    def execute(self, requests: list[InferRequest]) -> list[InferResponse | Exception]:
        """Hand the batch to the user's execute and convert its responses."""
        wrapped = [
            python_utils.InferenceRequest(
                [python_utils.Tensor(name, array) for name, array in r.inputs.items()],
                list(r.requested_outputs or []),
                r.id,
                r.parameters,
            )
            for r in requests
        ]
        responses = self.model.execute(wrapped)
        if not isinstance(responses, list) or len(responses) != len(requests):
            count = len(responses) if isinstance(responses, list) else type(responses).__name__
            raise InvalidArgument(
                f"model '{self.spec.name}': execute returned {count} "
                f"responses for {len(requests)} requests"
            )
        return [
            self._convert(response, request)
            for response, request in zip(responses, requests, strict=True)
        ]

    def _convert(self, response: Any, request: InferRequest) -> InferResponse | Exception:
        if response.has_error():
            return InvalidArgument(f"model '{self.spec.name}': {response.error().message()}")
        outputs = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
        if request.requested_outputs:
            outputs = {k: v for k, v in outputs.items() if k in request.requested_outputs}
        return InferResponse(outputs=outputs)

    def close(self) -> None:
        """Call the user's finalize."""
        if hasattr(self.model, "finalize"):
            self.model.finalize()


class PythonBackend:
    """Creates PythonInstance objects."""

    name = "python"

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> PythonInstance:
        """Import and initialise one instance (in its own thread)."""
        return PythonInstance(model, instance)
