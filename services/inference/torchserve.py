"""The ``torchserve`` backend: a TorchServe model archive served as it is.

A model folder written from a ``.mar`` (torchserve_archive.py) holds the
unpacked archive in its version folder. Each mesh instance of the model is
one TorchServe worker, built with TorchServe's own Python side (the
``torchserve`` package): its model loader imports the handler the manifest
names (a handler file of the archive, ``file.py:function``, or a built-in
handler such as ``image_classifier`` by name), ``ts.service.Service`` builds
the ``Context`` (``manifest``, ``system_properties`` with ``model_dir`` and
``gpu_id``, ``get_request_header``, ``metrics``) and the handler's
``initialize`` runs. A batch from the mesh's dynamic batcher reaches
``handle(data, context)`` in TorchServe's shape: one ``{"body": bytes}`` per
request, request headers through ``context.get_request_header``.

What the handler returns for a request becomes its BYTES output: bytes as
they are, a string as UTF-8, anything else as JSON. Intermediate responses
(``send_intermediate_predict_response``) come before the final one in the same
answer. ``PredictionException(message, code)`` reaches the caller with the
status that code names; any other exception is "Prediction failed" (503), as
TorchServe answers, with the traceback in the stage's log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.inference.torchserve_archive import CONTENT_TYPE, HEADER_PREFIX, STATUS
from services.inference.torchserve_metrics import TorchServeMetrics
from shared.backend import InstanceSpec, ModelSpec

if TYPE_CHECKING:
    from services.inference.torchserve_worker import TorchServeInstance

__all__ = ["CONTENT_TYPE", "HEADER_PREFIX", "STATUS", "TorchServeBackend"]


class TorchServeBackend:
    """Serves model folders written from TorchServe archives."""

    name = "torchserve"
    heavy = True
    """Its models load at start after the light backends' (shared/manager.py)."""

    def __init__(self) -> None:
        self.metrics = TorchServeMetrics()

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> TorchServeInstance:
        """Load one worker of the archive (blocking; in a worker thread)."""
        # TorchServe's Python side is imported (and patched) by the first archive.
        from services.inference.torchserve_worker import TorchServeInstance

        return TorchServeInstance(model, instance, self.metrics)
