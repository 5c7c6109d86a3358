"""vLLM's LoRA management paths, over the orchestrator's v2 repository API.

::

    POST /v1/load_lora_adapter   {"lora_name": "smollm2_hello"} -> RepositoryModelLoad
    POST /v1/unload_lora_adapter {"lora_name": "smollm2_hello"} -> RepositoryModelUnload

An adapter is a model of the repository (backend ``vllm_lora``; see
services/inference/vllm_lora.py), so loading it by this path or by
``POST /v2/repository/models/<name>/load`` is the same call: the running
engine of its base model takes it, without a restart. Where vLLM loads an
adapter from any ``lora_path`` on its host, the mesh loads it from the
repository every replica reads: a ``lora_path`` in the body is refused,
naming the field, rather than ignored. Success answers vLLM's plain-text
lines; errors take OpenAI's shape (the app's middleware). Envoy gives both
paths the admin role, as the repository API (gateway/envoy/access.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.http.openai_protocol import InvalidParam
from gateway.http.upstream import Upstream
from inference import grpc_service_pb2 as pb
from shared import jsontext

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"

BodyReader = Callable[[web.Request], Awaitable[bytes]]


def adapter_name(raw: bytes) -> str:
    """``lora_name`` of a load or unload body; InvalidParam names a bad field."""
    body = jsontext.parse_object(raw)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise InvalidParam("lora_name", "the adapter's model name (a string) is required")
    if body.get("lora_path") not in (None, ""):
        raise InvalidParam(
            "lora_path",
            "adapters load from the model repository, not from a path: place the adapter "
            f"in <repository>/{name}/1 with a config.pbtxt of backend vllm_lora and send "
            "lora_name alone",
        )
    return name


class LoraApi:
    """The two routes: body -> repository call -> vLLM's answer."""

    def __init__(self, upstream: Upstream, read_body: BodyReader) -> None:
        self.upstream = upstream
        self._read_body = read_body

    async def load(self, request: web.Request) -> web.Response:
        """POST /v1/load_lora_adapter."""
        name = adapter_name(await self._read_body(request))
        await self.upstream.load(pb.RepositoryModelLoadRequest(model_name=name))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        """POST /v1/unload_lora_adapter."""
        name = adapter_name(await self._read_body(request))
        await self.upstream.unload(pb.RepositoryModelUnloadRequest(model_name=name))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Mount both paths."""
        router.add_post(LOAD_PATH, self.load)
        router.add_post(UNLOAD_PATH, self.unload)
