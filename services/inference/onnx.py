"""The ``onnxruntime`` backend: ``model.onnx`` run by an ONNX Runtime session.

A run that ONNX Runtime refuses because of the request's data (an index out of
an embedding's range, a shape the graph cannot take) is the caller's error:
INVALID_ARGUMENT naming the model, the input when ORT's message names one, and
ORT's words, bounded. Any other run failure is the server's (INTERNAL; the
traceback in the log).
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shared.backend import InstanceSpec, ModelSpec, TensorInstance, parameter
from shared.errors import ConfigError, InvalidArgument

log = logging.getLogger(__name__)

REASON_CHARS = 300
"""ORT's message is cut to this in the caller's error (the log has all of it)."""

# ORT reports data errors of some kernels with FAIL or RUNTIME_EXCEPTION; these
# words say the request's values or shapes were the cause, not the model.
_DATA_ERRORS = re.compile(
    r"out of (data )?bounds|out of range|cannot be reshaped|invalid dimensions"
    r"|invalid rank|unexpected input data type|incompatible dimensions|broadcast",
    re.IGNORECASE,
)
# What ORT puts before its own words: "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : ".
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
# An index ORT says was out of range ("idx=1000000000").
_INDEX = re.compile(r"\bidx=(-?\d+)")


class _SharedSessions:
    """The CPU sessions that the instances of one load of a model version share
    when each has one intra-op thread (or the config's parameter
    ``share_session_between_instances`` says so). ONNX Runtime runs concurrent
    calls of one session each on its caller's thread (with one intra-op thread
    it starts none of its own), so such instances compute as they would with a
    session each, but hold and read one copy of the weights. A model's weights
    are read from memory again on every run, most of a small batch's cost: two
    MiniLM instances each running one row at a time took 5.0 ms of CPU per row
    sharing a session against 7.1 with one each (batches of 4: 3.8 against 3.9).
    A session lives while an instance holds it; a reload (a new ModelSpec) gets
    its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # instances are created in their own threads
        # (id of the load's ModelSpec, file) -> session. Every instance holding a
        # session also holds its spec, so the id is not reused while the entry lives.
        self._sessions: weakref.WeakValueDictionary[tuple[int, str], Any] = (
            weakref.WeakValueDictionary()
        )

    def get(self, model: ModelSpec, path: Path, create: Callable[[], Any]) -> Any:
        """The session of ``model``'s load for ``path``, else a new one from ``create()``."""
        key = (id(model), str(path))
        with self._lock:  # a second instance waits for the first's session, then shares it
            session = self._sessions.get(key)
            if session is None:
                session = create()
                self._sessions[key] = session
            return session


_SHARED = _SharedSessions()


class OnnxInstance(TensorInstance):
    """An ONNX Runtime session on one device (shared with the model's other CPU
    instances when each has one intra-op thread: ``_SharedSessions``)."""

    loop_safe = True
    """A session's run never touches the event loop and its threads are the
    session's own: a small model's batches run on the loop once measured cheap
    (shared/inline_budget.py); CPU sessions only."""

    def __init__(self, spec: ModelSpec, instance: InstanceSpec) -> None:
        super().__init__(spec)
        path = spec.model_file("model.onnx")
        if not path.is_file():
            raise ConfigError(
                f"model '{spec.name}' version {spec.version}: no {path.name} in {spec.path}"
            )
        import onnxruntime as ort  # by the first model that loads: a stage without one skips it

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
        self.loop_safe = not instance.device.startswith("cuda")
        if instance.device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise ConfigError(
                    f"model '{spec.name}': KIND_GPU needs onnxruntime-gpu "
                    "(CUDAExecutionProvider is not available)"
                )
            device_id = instance.device.split(":")[1]
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device_id}))

        def create() -> Any:
            return ort.InferenceSession(str(path), options, providers=providers)

        # Triton's parameter, off there by default; here sharing is the default
        # where it costs nothing (one intra-op thread each), and "true" shares
        # instances with more threads too (their runs then share one thread pool).
        share = parameter(spec, "share_session_between_instances", None, bool)
        one_thread = instance.intra_op_threads == 1
        shared = instance.device == "cpu" and (one_thread if share is None else share)
        self.session = _SHARED.get(spec, path, create) if shared else create()
        # A failed run is reported once, by us: ORT would also log every refused
        # request (an out-of-range token id) at ERROR on its own.
        self._run_options = ort.RunOptions()
        self._run_options.log_severity_level = 4
        graph_inputs = {item.name for item in self.session.get_inputs()}
        missing = [t.name for t in spec.config.input if t.name not in graph_inputs]
        if missing:
            raise ConfigError(
                f"model '{spec.name}': config inputs {missing} are not inputs "
                f"of the ONNX graph {sorted(graph_inputs)}"
            )

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One session run over the declared outputs."""
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

        try:
            values = self.session.run(self.output_names, inputs, self._run_options)
        except (ort_errors.InvalidArgument, ort_errors.Fail, ort_errors.RuntimeException) as exc:
            text = str(exc)
            if not isinstance(exc, ort_errors.InvalidArgument) and not _DATA_ERRORS.search(text):
                raise  # the model's or the runtime's fault: INTERNAL, traceback logged
            raise self._refused(text, inputs) from None
        return dict(zip(self.output_names, values, strict=True))

    def _refused(self, text: str, inputs: dict[str, np.ndarray]) -> InvalidArgument:
        """The caller's error for a run ORT refused on the request's data."""
        log.info("model '%s': run refused for the request's data: %s", self.model.name, text)
        detail = _ORT_PREFIX.sub("", text.split("Status Message: ", 1)[-1]).strip()
        tensor = _named_input(text, inputs)
        where = f" input '{tensor}':" if tensor else ""
        return InvalidArgument(
            f"model '{self.model.name}':{where} the request's data is invalid for this "
            f"model: {detail[:REASON_CHARS]}"
        )


def _named_input(text: str, inputs: dict[str, np.ndarray]) -> str | None:
    """The input ORT's message is about: one it names, else the one integer
    input holding the out-of-range index it quotes (None when not one)."""
    named = [name for name in inputs if re.search(rf"\b{re.escape(name)}\b", text)]
    if len(named) == 1:
        return named[0]
    index = _INDEX.search(text)
    if index is None:
        return None
    value = int(index.group(1))
    holding = [
        name
        for name, array in inputs.items()
        if array.dtype.kind in "iu" and bool(np.any(array == value))
    ]
    return holding[0] if len(holding) == 1 else None


class OnnxBackend:
    """Creates OnnxInstance objects."""

    name = "onnxruntime"

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> OnnxInstance:
        """Create one session (in the instance's own thread)."""
        return OnnxInstance(model, instance)
