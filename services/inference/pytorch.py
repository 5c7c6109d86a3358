"""The ``pytorch`` backend: TorchScript files and eager ``nn.Module`` code.

A version folder holds either ``model.pt`` (TorchScript, or
``default_model_filename``) or ``model.py`` defining an ``nn.Module`` plus an
optional state dict (``model.pth``, or the ``state_dict`` parameter). Inputs
are passed positionally in config order; a tensor, tuple or dict result maps
onto the config outputs. An index out of a model's range in the request (an
embedding's IndexError) is the caller's INVALID_ARGUMENT, not an INTERNAL.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from inference import model_config_pb2 as mc
from shared.backend import InstanceSpec, ModelSpec, TensorInstance, parameter
from shared.errors import ConfigError, InvalidArgument
from shared.tensors import DATATYPES, config_datatype

if TYPE_CHECKING:
    # Imported by the first model that loads (seconds): a stage whose models
    # need no torch never pays for it.
    import torch

log = logging.getLogger(__name__)

REASON_CHARS = 300
"""torch's message is cut to this in the caller's error (the log has all of it)."""


def _load_module(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    import torch

    source = spec.path / "model.py"
    if not source.is_file():
        path = spec.model_file("model.pt")
        if not path.is_file():
            raise ConfigError(
                f"model '{spec.name}' version {spec.version}: no {path.name} "
                f"or model.py in {spec.path}"
            )
        with warnings.catch_warnings():
            # torch 2.13 marks TorchScript deprecated, yet it is the format
            # Triton's pytorch backend serves; the notice is noise per load.
            warnings.filterwarnings(
                "ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning
            )
            module: torch.nn.Module = torch.jit.load(  # type: ignore[no-untyped-call]
                str(path), map_location=device
            )
        return module
    loaded = importlib.util.spec_from_file_location(f"meshserve_user_{spec.name}", source)
    if loaded is None or loaded.loader is None:
        raise ConfigError(f"{source}: cannot be imported")
    code = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(code)
    wanted = parameter(spec, "module_class", "")
    classes = [
        cls
        for name, cls in inspect.getmembers(code, inspect.isclass)
        if issubclass(cls, torch.nn.Module)
        and cls.__module__ == code.__name__
        and (not wanted or name == wanted)
    ]
    if len(classes) != 1:
        raise ConfigError(
            f"{source}: expected one nn.Module class"
            f"{f' named {wanted}' if wanted else ''}, found {len(classes)}; "
            "set parameter 'module_class'"
        )
    module = classes[0]()
    weights = spec.path / parameter(spec, "state_dict", "model.pth")
    if weights.is_file():
        module.load_state_dict(torch.load(weights, map_location=device, weights_only=True))
    return module.to(device)


class PyTorchInstance(TensorInstance):
    """One copy of a torch model on one device."""

    loop_safe = True
    """A forward never touches the event loop: a small model's batches run on it
    once measured cheap (shared/inline_budget.py); CPU instances only."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        super().__init__(spec)
        import torch

        self._torch = torch
        # Per-instance intra-op threads: several instances on 2 cores must not each
        # spin up a full-size pool. torch keeps the count per calling thread and a
        # batch may run in the instance's thread or on the event loop's, so each
        # forward sets it where it runs (``_threads_here``).
        self._threads = instance.intra_op_threads if instance.device == "cpu" else 0
        self.loop_safe = instance.device == "cpu"
        self._threads_here()
        self.device = torch.device(instance.device)
        self.module = _load_module(spec, self.device).eval()
        self.input_names = [tensor.name for tensor in spec.config.input]
        self._self_warmup()

    def _self_warmup(self) -> None:
        """Two forwards at batch 1: TorchScript's profiling executor makes the first
        calls several times slower, which would otherwise land on real requests."""
        config = self.model.config
        if any(-1 in tensor.dims for tensor in config.input) or any(
            tensor.data_type == mc.TYPE_STRING for tensor in config.input
        ):
            return  # no shape to invent; model_warmup in the config can do it
        prefix = [1] if self.batched else []
        inputs = {
            tensor.name: np.zeros(
                prefix + list(tensor.dims), dtype=DATATYPES[config_datatype(tensor.data_type)]
            )
            for tensor in config.input
        }
        for _ in range(2):
            self.run(inputs)

    def _threads_here(self) -> None:
        """This thread's intra-op thread count set to the instance's (CPU only)."""
        torch = self._torch
        if self._threads and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Forward once; inputs positional in config order."""
        torch = self._torch
        self._threads_here()
        args = []
        for name in self.input_names:
            if name not in inputs:
                continue
            array = inputs[name]
            if array.dtype == object:
                raise InvalidArgument(f"input '{name}': BYTES tensors cannot feed a torch model")
            args.append(
                torch.from_numpy(np.require(array, requirements=["W", "C"])).to(self.device)
            )
        try:
            with torch.inference_mode():
                result = self.module(*args)
        except (IndexError, RuntimeError) as exc:
            # TorchScript may carry an IndexError as a RuntimeError with its words.
            if not isinstance(exc, IndexError) and "index out of range" not in str(exc):
                raise  # the model's fault: INTERNAL, traceback logged
            raise self._refused(exc) from None
        return self._outputs(result)

    def _refused(self, exc: Exception) -> InvalidArgument:
        """The caller's error for a forward that failed on the request's values."""
        log.info("model '%s': forward refused for the request's data: %s", self.model.name, exc)
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return InvalidArgument(
            f"model '{self.model.name}': an input value is out of this model's range: "
            f"{detail[:REASON_CHARS]}"
        )

    def _outputs(self, result: Any) -> dict[str, np.ndarray]:
        if isinstance(result, dict):
            return {name: _to_numpy(result[name]) for name in self.output_names if name in result}
        values = list(result) if isinstance(result, tuple | list) else [result]
        if len(values) != len(self.output_names):
            raise ConfigError(
                f"model '{self.model.name}' returned {len(values)} outputs, "
                f"its config declares {len(self.output_names)}"
            )
        return {
            name: _to_numpy(value) for name, value in zip(self.output_names, values, strict=True)
        }

    def close(self) -> None:
        """Drop the module (and its device memory)."""
        del self.module
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()


def _to_numpy(value: torch.Tensor) -> np.ndarray:
    return value.detach().to("cpu").contiguous().numpy()


class PyTorchBackend:
    """Creates PyTorchInstance objects."""

    name = "pytorch"
    heavy = True
    """Its models load at start after the light backends' (shared/manager.py)."""

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> PyTorchInstance:
        """Load one instance (in the instance's own thread)."""
        return PyTorchInstance(model, instance)
