"""The vllm backend's settings: engine parameters (config) and sampling (per request).

Both are validated here, before vLLM sees them, so that every error names the
parameter or the SAMPLING field at fault. No vLLM import at module level: the
conversions to vLLM's own objects import it when called.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

from services.inference.vllm_sampling import extra_params, extra_rules, other_field
from shared.backend import ModelSpec, json_object, parameter_settings
from shared.errors import ConfigError, InvalidArgument

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

log = logging.getLogger(__name__)

GIB = 1 << 30
DType = Literal["auto", "bfloat16", "float16", "float32"]
SchedulingPolicy = Literal["fcfs", "priority"]
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM's max_lora_rank takes."""


@dataclass(frozen=True)
class EngineSettings:
    """The model's engine parameters, validated once at load."""

    max_model_len: int = 2048
    """Prompt plus generated tokens per request; 2..1048576."""
    max_num_seqs: int = 16
    """Requests the engine runs at once (its batch); 1..4096."""
    max_waiting: int = 64
    """Requests admitted beyond max_num_seqs to wait; more are refused; 0..1000000."""
    dtype: DType = "auto"
    """bfloat16, float16, float32, or auto: vLLM's own choice, the checkpoint's
    torch_dtype (bfloat16 for a float32 checkpoint) on every x86-64 CPU alike;
    a CPU without AVX512-BF16 or AMX then runs bfloat16 emulated, slowly, but
    answers as one with them does. Logged at load and shown as the model's
    ``dtype_in_use`` config parameter. Name it where answers matter: a small
    model may answer differently in bfloat16 than in float32."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs: starts much faster, runs somewhat slower."""
    gpu_memory_utilization: float = 0.9
    """GPU: share of device memory vLLM may take (weights + KV cache); 0.05..1."""
    kv_cache_space_gib: float = 0.0
    """KV cache size in GiB (CPU: needed; GPU: overrides gpu_memory_utilization); 0 = vLLM's."""
    tensor_parallel_size: int = 1
    """Devices one engine shards the model over; 1..64."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (system prompts, chat history)."""
    enable_chunked_prefill: bool = True
    """Split long prefills into chunks batched with running decodes (vLLM v1's default)."""
    max_num_batched_tokens: int = 0
    """Tokens one engine step may schedule (prefill chunks + decodes); 0: vLLM's; 0..1048576."""
    enable_lora: bool = False
    """Serve LoRA adapters (vllm_lora models naming this one as base_model)."""
    max_loras: int = 1
    """LoRA adapters in one batch (and held in the engine at once); 1..64."""
    max_lora_rank: int = 16
    """Largest adapter rank the engine takes: 1, 8, 16, 32, 64, 128, 256, 320 or 512."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """fcfs (arrival order), or priority: waiting requests start by their v2
    ``priority`` (lower first; 0, a request without one, before all), so batch
    job lines (level 2) wait behind online requests for a free sequence."""
    max_tokens_cap: int = 0
    """Most tokens one request may generate: a request without max_tokens gets it,
    one asking for more is refused naming max_tokens; 0: max_model_len; 0..1048576."""
    max_generation_s: float = 300.0
    """Longest a generation may run; past it the engine aborts it and the last
    response says finish reason "length"; 0: no cap; 0..86400."""

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> EngineSettings:
        """Read the config parameters; a bad value is a ConfigError naming it."""
        bounds = {
            "max_model_len": (2, 1 << 20),
            "max_num_seqs": (1, 4096),
            "max_waiting": (0, 1_000_000),
            "gpu_memory_utilization": (0.05, 1.0),
            "kv_cache_space_gib": (0.0, 4096.0),
            "tensor_parallel_size": (1, 64),
            "max_tokens_cap": (0, 1 << 20),
            "max_generation_s": (0.0, 86400.0),
            "max_num_batched_tokens": (0, 1 << 20),
            "max_loras": (1, 64),
        }
        settings = parameter_settings(cls, spec, bounds)
        if settings.dtype not in get_args(DType):
            raise ConfigError(
                f"model '{spec.name}': parameter 'dtype' must be auto, bfloat16, float16 or float32"
            )
        if settings.scheduling_policy not in get_args(SchedulingPolicy):
            raise ConfigError(
                f"model '{spec.name}': parameter 'scheduling_policy' must be fcfs or priority"
            )
        if settings.max_lora_rank not in LORA_RANKS:
            raise ConfigError(
                f"model '{spec.name}': parameter 'max_lora_rank' must be one of {LORA_RANKS}"
            )
        return settings

    def max_tokens(self, sampling: Sampling, prompt_tokens: int, where: str) -> int:
        """The tokens a request may generate: its own max_tokens within the cap, the cap
        when it names none; both within what max_model_len leaves after the prompt."""
        cap = self.max_tokens_cap or self.max_model_len
        asked = sampling.max_tokens
        if asked is not None and asked > cap:
            raise InvalidArgument(
                f"{where}.max_tokens {asked} exceeds this model's max_tokens_cap {cap}"
            )
        return min(asked or cap, self.max_model_len - prompt_tokens)

    def engine_args(self, spec: ModelSpec) -> AsyncEngineArgs:
        """vLLM's engine arguments for the model in ``spec.path``."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(
            model=str(spec.path),
            served_model_name=[spec.name],
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            # Passed through, never picked by CPU here: a dtype chosen by the
            # CPU's instruction set would make answers differ between hosts.
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            gpu_memory_utilization=self.gpu_memory_utilization,
            # One size for CPU and GPU (on CPU, a VLLM_CPU_KVCACHE_SPACE in the
            # environment still overrides it: vLLM's legacy setting).
            kv_cache_memory_bytes=int(self.kv_cache_space_gib * GIB) or None,
            tensor_parallel_size=self.tensor_parallel_size,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_batched_tokens=self.max_num_batched_tokens or None,
            enable_lora=self.enable_lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank if self.enable_lora else 16,
            # The stats go to our metrics (a custom stat logger), not to vLLM's log lines.
            disable_log_stats=True,
        )


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` (or ``"float32"``) as the config spells it: ``float32``."""
    return str(dtype).removeprefix("torch.")


def log_dtype(where: str, requested: DType, resolved: str, on_cpu: bool) -> str:
    """Log the dtype the engine runs in, as requested and why (one INFO line); return why."""
    if requested != "auto":
        why = "as configured" if resolved == requested else "vLLM replaced the configured dtype"
    else:
        why = "auto: vLLM's choice from the checkpoint's torch_dtype, the same on every CPU"
        if on_cpu and resolved == "bfloat16":
            why += (
                "; this CPU computes bfloat16 natively (AVX512-BF16/AMX)"
                if cpu_has_native_bfloat16()
                else "; this CPU has no native bfloat16 (no AVX512-BF16/AMX): emulated, slower"
            )
    log.info("%s: dtype %s in use (requested %s): %s", where, resolved, requested, why)
    return why


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
)
_INT_FIELDS = ("top_k", "max_tokens", "seed", "min_tokens", "logprobs")
_OTHER_FIELDS = ("ignore_eos", "logit_bias", "structured")  # checked by vllm_sampling
_DETOKENIZER_FIELDS = ("stop",)  # stop strings: the detokenizer applies them


@dataclass(frozen=True)
class Sampling:
    """How to sample one request; the JSON in SAMPLING, checked field by field."""

    temperature: float = 1.0
    """0 is greedy; 0..2."""
    top_p: float = 1.0
    """Nucleus sampling mass; (0, 1]."""
    top_k: int = 0
    """Sample among the k likeliest tokens; 0 (or -1): all."""
    max_tokens: int | None = None
    """Tokens to generate at most; None: up to max_model_len."""
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end generation (beside the model's end-of-sequence)."""
    seed: int | None = None
    """Per-request random seed, for reproducible sampling."""
    repetition_penalty: float = 1.0
    """> 1 discourages repeating tokens; > 0."""
    presence_penalty: float = 0.0
    """Penalises tokens already generated at all; -2..2."""
    frequency_penalty: float = 0.0
    """Penalises tokens by how often they were generated; -2..2."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the likeliest; 0..1."""
    min_tokens: int = 0
    """Tokens generated before end-of-sequence or a stop id may end it; >= 0."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence (up to max_tokens)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in -100..100) pairs added to the logits."""
    logprobs: int | None = None
    """Set: each token's logprob and this many top alternatives (0..20) in the output."""
    structured: tuple[tuple[str, Any], ...] = ()
    """The output's constraint (json, json_object, regex, choice, grammar): one pair."""

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Sampling:
        """Parse one SAMPLING element; errors name ``where`` and the field."""
        values = json_object(raw, where)
        known = {f.name for f in fields(cls)} | set(_DETOKENIZER_FIELDS)
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidArgument(f"{where}: unknown field(s) {unknown}; expected {sorted(known)}")
        typed = {
            key: (other_field if key in _OTHER_FIELDS else _typed)(key, value, f"{where}.{key}")
            for key, value in values.items()
            if value is not None and key not in _DETOKENIZER_FIELDS
        }
        sampling = cls(**typed)
        sampling.check(where)
        return sampling

    def check(self, where: str) -> None:
        """vLLM's ranges, enforced here so that the error names the field."""
        rules = [
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be in 0..2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be 0 (all tokens) or at least 1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be greater than 0"),
            ("stop_token_ids", all(i >= 0 for i in self.stop_token_ids), "must be token ids >= 0"),
            ("seed", self.seed is None or -(1 << 63) <= self.seed < 1 << 63, "must fit in int64"),
            *extra_rules(self),
        ]
        for name, ok, rule in rules:
            if not ok:
                raise InvalidArgument(f"{where}.{name} {rule}, got {getattr(self, name)!r}")

    def params(self, where: str) -> Any:
        """vLLM SamplingParams: ids only, streamed as deltas."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_tokens=self.max_tokens,
                stop_token_ids=list(self.stop_token_ids),
                seed=self.seed,
                repetition_penalty=self.repetition_penalty,
                **extra_params(self),
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
        except (VLLMClientError, ValueError) as exc:  # a rule vLLM has and check() lacks
            raise InvalidArgument(f"{where}: {exc}") from exc


def _typed(key: str, value: Any, where: str) -> Any:
    """``value`` as the field's type; JSON booleans are not numbers here."""
    if key in _FLOAT_FIELDS:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise InvalidArgument(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if key in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{where} must be an integer, got {value!r}")
        return value
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise InvalidArgument(f"{where} must be a list of integers, got {value!r}")
    return tuple(value)
