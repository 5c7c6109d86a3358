"""LoRA adapters as LLM pipelines: a request naming an adapter runs its base model's pipeline.

vLLM picks an adapter by the request's ``model``. In the mesh an adapter is a
stage model of its own (backend ``vllm_lora``, services/inference/vllm_lora.py)
that streams ids as its base engine does, while users name pipelines (``llm``
= tokenizer -> engine -> detokenizer). So a stream for an adapter's name runs
a pipeline derived once, when first asked for, from the pipeline whose engine
step is the adapter's ``base_model``::

    llm            smollm2_tokenizer -> smollm2       -> smollm2_detokenizer
    smollm2_hello  smollm2_tokenizer -> smollm2_hello -> smollm2_detokenizer

The derived pipeline is an ensemble plan under the adapter's name (its
statistics and traces as any ensemble's). Unloading the adapter drops it; the
base model and its pipeline never notice. No gRPC here.
"""

from __future__ import annotations

import logging

from inference import model_config_pb2 as mc
from services.orchestrator.ensemble import EnsemblePlan
from services.orchestrator.ensembles import EnsembleRegistry, FetchConfig
from shared.errors import MeshError

log = logging.getLogger(__name__)

LORA_BACKEND = "vllm_lora"
BASE_PARAMETER = "base_model"


class AdapterPipelines:
    """The pipelines derived for adapters, and which names are known not to be adapters."""

    def __init__(self, ensembles: EnsembleRegistry, fetch_config: FetchConfig) -> None:
        self._ensembles = ensembles
        self._fetch_config = fetch_config
        self.parents: dict[str, str] = {}
        """Adapter name -> the pipeline its own was derived from."""
        self._not_adapters: set[str] = set()

    def derived(self, name: str) -> bool:
        """True when ``name``'s plan is an adapter's derived pipeline."""
        return name in self.parents

    async def ensure(self, name: str) -> None:
        """Derive ``name``'s pipeline if it is an adapter without one yet; else nothing.
        Errors (an unknown name, a stage down) are left to the request itself."""
        if name in self._not_adapters or self._ensembles.plans.get(name) is not None:
            return
        try:
            config = await self._fetch_config(name)
        except MeshError:
            return  # not a stage model (or not reachable now): the request says so
        if config.backend != LORA_BACKEND:
            self._not_adapters.add(name)
            return
        base = config.parameters[BASE_PARAMETER].string_value
        parent = self._pipeline_of(base)
        if parent is None:
            log.warning("adapter '%s': no LLM pipeline has '%s' as its engine", name, base)
            return
        await self._ensembles.load(name, _derived_config(parent, name, base))
        self.parents[name] = parent.name
        log.info("adapter '%s' served as pipeline '%s' with it as the engine", name, parent.name)

    def _pipeline_of(self, engine: str) -> EnsemblePlan | None:
        """A loaded, repository pipeline whose streaming step is ``engine`` (first by name)."""
        for name in sorted(self._ensembles.plans):
            plan = self._ensembles.plans[name]
            if name not in self.parents and plan.streaming and plan.streaming.model == engine:
                return plan
        return None

    def forget(self, name: str) -> bool:
        """The adapter ``name`` was unloaded or (re)loaded: drop what was derived or
        learnt of it; True when it had a derived pipeline."""
        self._not_adapters.discard(name)
        if self.parents.pop(name, None) is None:
            return False
        self._ensembles.plans.pop(name, None)
        return True


def _derived_config(parent: EnsemblePlan, name: str, engine: str) -> mc.ModelConfig:
    """``parent``'s ensemble config named ``name``, its ``engine`` steps run by ``name``."""
    config = mc.ModelConfig()
    config.CopyFrom(parent.config)
    config.name = name
    for step in config.ensemble_scheduling.step:
        if step.model_name == engine:
            step.model_name = name
    return config
