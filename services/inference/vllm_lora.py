"""The ``vllm_lora`` backend: a LoRA adapter served by the running engine of its base model.

An adapter is a model of its own in the repository (as vLLM's ``--lora-modules``
names one, and as Triton loads and unloads models), hosted by the same service
as its base ``vllm`` model::

    <repo>/smollm2_hello/config.pbtxt   backend "vllm_lora", parameter base_model "smollm2"
    <repo>/smollm2_hello/1/             adapter_config.json + adapter_model.safetensors

    load     wait for the base model's engine, then AsyncLLM.add_lora (no restart)
    stream   the base engine's generate with this adapter's LoRARequest; same
             tensors, checks and metrics as the base model (labelled with the base)
    unload   AsyncLLM.remove_lora; the base model serves on untouched

The base engine must run with ``enable_lora: true`` and a ``max_lora_rank`` at
least the adapter's rank (EngineSettings). Loading the adapter by the v2
repository API (``POST /v2/repository/models/<adapter>/load``) or vLLM's
``POST /v1/load_lora_adapter`` loads it into the engine that runs now; when the
base model is reloaded (a new engine), the adapter is added again to the new
engine on its next request.

Config parameters: ``base_model`` (required: the vllm model in the same
service), ``lora_path`` (the adapter folder: absolute, or relative to the
version folder; default the version folder itself), ``load_timeout_s`` (how
long loading waits for the base engine to run; 0..3600, default 600).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.backend import InstanceSpec, ModelSpec, parameter_settings
from shared.errors import ConfigError, Unavailable
from shared.request import InferRequest, InferResponse

if TYPE_CHECKING:
    from services.inference.vllm import VllmBackend, VllmInstance

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_config.json"
_POLL_S = 0.5


@dataclass(frozen=True)
class LoraSettings:
    """An adapter model's config parameters, validated once at load."""

    base_model: str = ""
    """The ``vllm`` model (same service) whose engine serves the adapter; required."""
    lora_path: str = ""
    """The adapter folder (peft's adapter_config.json + weights): absolute, or relative
    to the version folder; empty: the version folder itself."""
    load_timeout_s: float = 600.0
    """Longest a load waits for the base model's engine to run; 0..3600."""

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> LoraSettings:
        """Read and check the parameters; errors name the model and the parameter."""
        settings = parameter_settings(cls, spec, {"load_timeout_s": (0.0, 3600.0)})
        if not settings.base_model:
            raise ConfigError(
                f"model '{spec.name}': parameter 'base_model' is required "
                "(the vllm model whose engine serves this adapter)"
            )
        return settings

    def folder(self, spec: ModelSpec) -> Path:
        """The adapter folder; a ConfigError names it when it holds no adapter."""
        folder = spec.path / self.lora_path if self.lora_path else spec.path
        if not (folder / ADAPTER_FILE).is_file():
            shown = self.lora_path or f"version {spec.version}"
            raise ConfigError(
                f"model '{spec.name}': no LoRA adapter ({ADAPTER_FILE}) in {shown!r}; "
                "save one with peft's save_pretrained"
            )
        return folder


class LoraInstance:
    """One adapter, added to its base model's running engine."""

    def __init__(self, spec: ModelSpec, engines: VllmBackend, lora_id: int) -> None:
        self.spec = spec
        self.settings = LoraSettings.from_spec(spec)
        self.where = f"model '{spec.name}'"
        self._engines = engines
        self._folder = self.settings.folder(spec)
        self._lora_id = lora_id
        self._serving_on: VllmInstance | None = None  # the engine holding the adapter

    def _request(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=self.spec.name,
            lora_int_id=self._lora_id,
            lora_path=str(self._folder),
            base_model_name=self.settings.base_model,
        )

    async def start(self) -> None:
        """Wait for the base engine (up to load_timeout_s), then add the adapter to it."""
        deadline = time.monotonic() + self.settings.load_timeout_s
        base = self._engines.running(self.settings.base_model)
        while base is None:
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"{self.where}: base model '{self.settings.base_model}' has no running "
                    f"vLLM engine in this service after {self.settings.load_timeout_s:.0f} s"
                )
            await asyncio.sleep(_POLL_S)
            base = self._engines.running(self.settings.base_model)
        await self._add_to(base)

    async def _add_to(self, base: VllmInstance) -> None:
        if not base.settings.enable_lora:
            raise ConfigError(
                f"{self.where}: base model '{self.settings.base_model}' runs without LoRA; "
                "set its parameter enable_lora to true"
            )
        engine = base.engine
        try:
            await engine.add_lora(self._request())
        except Exception as exc:  # vLLM's checks: rank, target modules, files
            raise ConfigError(f"{self.where}: vLLM refused the adapter: {exc}") from exc
        self._serving_on = base
        log.info("%s: LoRA adapter added to '%s'", self.where, self.settings.base_model)

    @property
    def ready(self) -> bool:
        """True while the base model's engine runs."""
        return self._engines.running(self.settings.base_model) is not None

    async def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """The base engine's responses, generated with this adapter."""
        base = self._engines.running(self.settings.base_model)
        if base is None:
            raise Unavailable(
                f"{self.where}: base model '{self.settings.base_model}' is not running"
            )
        if base is not self._serving_on:  # the base was reloaded: a new engine
            await self._add_to(base)
        async for response in base.stream(request, self._request()):
            yield response

    async def close(self) -> None:
        """Remove the adapter from the engine (which keeps serving its base model)."""
        base, self._serving_on = self._serving_on, None
        if base is None or not base.ready:
            return
        try:
            await base.engine.remove_lora(self._lora_id)
        except Exception:  # the engine is going away too: nothing to free
            log.warning("%s: removing the adapter failed", self.where, exc_info=True)
        else:
            log.info("%s: LoRA adapter removed from '%s'", self.where, self.settings.base_model)


class LoraBackend:
    """Creates LoraInstance objects on the engines ``engines`` (the service's vllm backend) runs."""

    name = "vllm_lora"
    heavy = True
    """Loads with its base model's engine, after the light backends' models."""

    def __init__(self, engines: VllmBackend) -> None:
        self.engines = engines
        self._ids = itertools.count(1)  # vLLM wants one id per adapter, unique in the engine

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> Any:
        """Not for adapters: they stream, as their base model does."""
        raise ConfigError(
            f"model '{model.name}': the vllm_lora backend streams; set "
            "model_transaction_policy { decoupled: true } in its config"
        )

    def create_streaming_instance(self, model: ModelSpec, instance: InstanceSpec) -> LoraInstance:
        """Check the parameters and the adapter folder; ``start`` adds it to the engine."""
        return LoraInstance(model, self.engines, next(self._ids))
