"""Ensembles as dataflow graphs: validated at load, executed step by step.

Triton's ``ensemble_scheduling`` lists steps; each maps its model's inputs
from ensemble tensors (``input_map``: model input -> ensemble tensor) and its
outputs to ensemble tensors (``output_map``: model output -> ensemble tensor).
A step runs as soon as all its inputs exist, so independent branches run
concurrently. Tensors stay in their wire form (datatype, shape, raw bytes):
the orchestrator forwards them and never decodes them.

No gRPC here: steps are executed through a ``StepCall`` the runner provides
(runner.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from opentelemetry import trace

from inference import model_config_pb2 as mc
from shared.errors import ConfigError, InvalidArgument, MeshError, error_for_status
from shared.request import InferRequest, InferResponse
from shared.tensors import config_datatype, datatype_of, decode_raw, encode_raw
from shared.tracing import iterate_in_context


@dataclass(frozen=True)
class WireTensor:
    """A tensor as it travels: v2 datatype, shape and raw little-endian bytes."""

    datatype: str
    shape: tuple[int, ...]
    raw: bytes | memoryview
    """The bytes, or a view into the stage answer that brought them (step_wire.py)."""
    handoff: str = ""
    """The key of the shared-memory buffer ``raw`` is a view of (handoff.py), if any."""

    @classmethod
    def of(cls, array: np.ndarray) -> WireTensor:
        """An array as the graph carries it; numbers as a view of the array, not a copy."""
        datatype = datatype_of(array)
        if datatype == "BYTES" or array.dtype.byteorder == ">":
            raw: bytes | memoryview = encode_raw(array)
        else:
            raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
        return cls(datatype, tuple(array.shape), raw)

    def array(self, name: str) -> np.ndarray:
        """The tensor as an array (numbers as a view of ``raw``); INVALID_ARGUMENT
        naming ``name`` when its bytes do not fit its shape."""
        return decode_raw(name, self.datatype, self.shape, self.raw)


@dataclass(frozen=True)
class TensorSpec:
    """A declared tensor: datatype and full shape (-1 = any, batch dim included)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class ModelIO:
    """A model's declared inputs and outputs."""

    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    decoupled: bool = False
    """True when the model streams several responses per request."""

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> ModelIO:
        """From a ModelConfig; batched models get a leading -1."""
        prefix = (-1,) if config.max_batch_size > 0 else ()

        def spec(tensor: mc.ModelInput | mc.ModelOutput, optional: bool) -> TensorSpec:
            return TensorSpec(
                tensor.name,
                config_datatype(tensor.data_type),
                prefix + tuple(tensor.dims),
                optional,
            )

        return cls(
            inputs={t.name: spec(t, t.optional) for t in config.input},
            outputs={t.name: spec(t, False) for t in config.output},
            decoupled=config.model_transaction_policy.decoupled,
        )


@dataclass(frozen=True)
class Step:
    """One ensemble step."""

    index: int
    model: str
    version: str
    input_map: Mapping[str, str]
    output_map: Mapping[str, str]

    def describe(self, ensemble: str) -> str:
        """``ensemble 'e' step 2 ('model')`` for messages."""
        return f"ensemble '{ensemble}' step {self.index} ('{self.model}')"


StepCall = Callable[[Step, dict[str, WireTensor], list[str]], Awaitable[dict[str, WireTensor]]]
StepStream = Callable[
    [Step, dict[str, WireTensor], list[str]], AsyncGenerator[dict[str, WireTensor], None]
]

# An ensemble output with this name, once non-empty, ends a streamed response
# (the detokenizer reports a stop string or the engine's finish reason there).
FINISH_TENSOR = "FINISH_REASON"


def _compatible(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


class EnsemblePlan:
    """A validated ensemble, ready to run."""

    def __init__(
        self,
        config: mc.ModelConfig,
        steps: list[Step],
        io: ModelIO,
        streaming: Step | None = None,
        intermediate: Mapping[str, TensorSpec] | None = None,
    ) -> None:
        self.name = config.name
        self.config = config
        self.steps = steps
        self.io = io
        self.streaming = streaming
        """The decoupled step, if any: the ensemble then streams."""
        self.downstream = _downstream(steps, streaming) if streaming else []
        self.upstream = [s for s in steps if s is not streaming and s not in self.downstream]
        self.intermediate = intermediate or {}
        """The tensors a step makes and a later step takes that are not ensemble outputs."""

    @classmethod
    def build(cls, config: mc.ModelConfig, models: Mapping[str, ModelIO]) -> EnsemblePlan:
        """Validate the graph against the step models' declared tensors."""
        name = config.name
        if not config.ensemble_scheduling.step:
            raise ConfigError(f"ensemble '{name}': ensemble_scheduling has no step")
        steps = [
            Step(
                i,
                s.model_name,
                "" if s.model_version < 0 else str(s.model_version),
                dict(s.input_map),
                dict(s.output_map),
            )
            for i, s in enumerate(config.ensemble_scheduling.step)
        ]
        io = ModelIO.from_config(config)
        producers: dict[str, TensorSpec] = dict(io.inputs)
        for step in steps:
            model = models.get(step.model)
            if model is None:
                raise ConfigError(
                    f"{step.describe(name)}: unknown model '{step.model}' (no stage hosts it)"
                )
            _check_maps(name, step, model)
            for out_name, tensor in step.output_map.items():
                if tensor in producers:
                    raise ConfigError(
                        f"{step.describe(name)}: ensemble tensor '{tensor}' is "
                        "already produced by an ensemble input or another step"
                    )
                producers[tensor] = model.outputs[out_name]
        for step in steps:
            _check_inputs(name, step, models[step.model], producers)
        for out in io.outputs.values():
            if out.name not in producers:
                raise ConfigError(
                    f"ensemble '{name}': output '{out.name}' is never produced by any step"
                )
            _check_match(f"ensemble '{name}' output '{out.name}'", producers[out.name], out)
        _check_acyclic(name, steps, set(io.inputs))
        decoupled = [s for s in steps if models[s.model].decoupled]
        if len(decoupled) > 1:
            raise ConfigError(
                f"{decoupled[1].describe(name)}: only one decoupled (streaming) "
                "step per ensemble is supported"
            )
        if decoupled:
            io = ModelIO(io.inputs, io.outputs, decoupled=True)
        taken = {tensor for step in steps for tensor in step.input_map.values()}
        intermediate = {
            name: spec
            for name, spec in producers.items()
            if name in taken and name not in io.inputs and name not in io.outputs
        }
        return cls(config, steps, io, decoupled[0] if decoupled else None, intermediate)

    async def run(
        self, inputs: dict[str, WireTensor], call: StepCall, tracer: trace.Tracer
    ) -> dict[str, WireTensor]:
        """Execute the graph: each step starts when its inputs exist."""
        if self.streaming is not None:
            raise InvalidArgument(
                f"ensemble '{self.name}' is decoupled (its step "
                f"'{self.streaming.model}' streams); use ModelStreamInfer"
            )
        self._check_request(inputs)
        available = await self._execute(self.steps, dict(inputs), call, tracer)
        return {name: available[name] for name in self.io.outputs}

    async def run_arrays(
        self, request: InferRequest, call: StepCall, tracer: trace.Tracer
    ) -> InferResponse:
        """``run`` for a request of arrays: the outputs it asked for (all when it
        named none), as arrays."""
        inputs = {name: WireTensor.of(array) for name, array in request.inputs.items()}
        produced = await self.run(inputs, call, tracer)
        wanted = request.requested_outputs or list(produced)
        return InferResponse(outputs={name: produced[name].array(name) for name in wanted})

    async def stream(
        self,
        inputs: dict[str, WireTensor],
        call: StepCall,
        stream_call: StepStream,
        tracer: trace.Tracer,
    ) -> AsyncIterator[dict[str, WireTensor]]:
        """Run the steps before the decoupled one once, then the steps after it for
        every response it streams; ends early when FINISH_REASON turns non-empty."""
        step = self.streaming
        if step is None:
            yield await self.run(inputs, call, tracer)
            return
        self._check_request(inputs)
        before = await self._execute(self.upstream, dict(inputs), call, tracer)
        responses = stream_call(step, _inputs_of(step, before), list(step.output_map))
        # The streaming step's span covers the whole stream (current while the
        # stream produces, so the stage call made for it is its child).
        span = tracer.start_span(self._step_span_name(step), attributes=self._step_attributes(step))
        try:
            async for produced in iterate_in_context(trace.set_span_in_context(span), responses):
                available = dict(before)
                for out_name, tensor in step.output_map.items():
                    if out_name in produced:
                        available[tensor] = produced[out_name]
                available = await self._execute(self.downstream, available, call, tracer)
                outputs = {name: available[name] for name in self.io.outputs if name in available}
                yield outputs
                if is_finished(outputs.get(FINISH_TENSOR)):
                    return  # closing the stream below cancels the generation upstream
        except Exception as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            raise
        finally:
            await responses.aclose()
            span.end()

    async def _execute(
        self,
        steps: Sequence[Step],
        available: dict[str, WireTensor],
        call: StepCall,
        tracer: trace.Tracer,
    ) -> dict[str, WireTensor]:
        """Dataflow over ``steps``; optional ensemble inputs not sent are skipped."""
        absent = {n for n, spec in self.io.inputs.items() if spec.optional} - set(available)
        pending = list(steps)
        running: dict[asyncio.Task[dict[str, WireTensor]], Step] = {}
        try:
            while pending or running:
                ready = [s for s in pending if set(s.input_map.values()) - absent <= set(available)]
                if len(ready) == 1 and not running:
                    # A chain (tokenizer -> model -> detokenizer): run the step
                    # here; a task and a wait per step cost more than the step's
                    # own bookkeeping.
                    step = ready[0]
                    pending.remove(step)
                    outputs = await self._run_step(step, _inputs_of(step, available), call, tracer)
                    for out_name, tensor in step.output_map.items():
                        available[tensor] = outputs[out_name]
                    continue
                for step in ready:
                    pending.remove(step)
                    task = asyncio.create_task(
                        self._run_step(step, _inputs_of(step, available), call, tracer)
                    )
                    running[task] = step
                if not running:
                    missing = sorted(
                        {t for s in pending for t in s.input_map.values()} - set(available)
                    )
                    raise InvalidArgument(
                        f"ensemble '{self.name}': tensors {missing} "
                        "were never produced (optional input missing?)"
                    )
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    outputs = task.result()
                    for out_name, tensor in step.output_map.items():
                        available[tensor] = outputs[out_name]
        finally:
            for task in running:
                task.cancel()
        return available

    async def _run_step(
        self, step: Step, inputs: dict[str, WireTensor], call: StepCall, tracer: trace.Tracer
    ) -> dict[str, WireTensor]:
        if not _records(tracer):
            return await self._call_step(step, inputs, call)
        # The step's span is the client span of its stage call (one span, not two).
        with tracer.start_as_current_span(
            self._step_span_name(step),
            kind=trace.SpanKind.CLIENT,
            attributes=self._step_attributes(step),
        ):
            return await self._call_step(step, inputs, call)

    async def _call_step(
        self, step: Step, inputs: dict[str, WireTensor], call: StepCall
    ) -> dict[str, WireTensor]:
        try:
            return await call(step, inputs, list(step.output_map))
        except MeshError as exc:
            raise error_for_status(exc.code, f"{step.describe(self.name)}: {exc.message}") from exc

    @staticmethod
    def _step_span_name(step: Step) -> str:
        return f"ensemble step {step.index} {step.model}"

    def _step_attributes(self, step: Step) -> dict[str, str | int]:
        return {
            "meshserve.ensemble": self.name,
            "meshserve.step": step.index,
            "meshserve.model": step.model,
        }

    def _check_request(self, inputs: Mapping[str, WireTensor]) -> None:
        for name in inputs:
            if name not in self.io.inputs:
                raise InvalidArgument(
                    f"ensemble '{self.name}': unknown input '{name}'; "
                    f"expected {sorted(self.io.inputs)}"
                )
        for spec in self.io.inputs.values():
            tensor = inputs.get(spec.name)
            if tensor is None:
                if spec.optional:
                    continue
                raise InvalidArgument(f"ensemble '{self.name}': missing input '{spec.name}'")
            if tensor.datatype != spec.datatype:
                raise InvalidArgument(
                    f"ensemble '{self.name}': input '{spec.name}' has "
                    f"datatype {tensor.datatype}, expected {spec.datatype}"
                )
            if not _compatible(tensor.shape, spec.shape):
                raise InvalidArgument(
                    f"ensemble '{self.name}': input '{spec.name}' has shape "
                    f"{list(tensor.shape)}, expected {list(spec.shape)}"
                )


def _records(tracer: trace.Tracer) -> bool:
    """False when a step span would not be recorded: tracing is off (a no-op
    tracer), or the request's trace was sampled out (its spans all are). Without
    it the caller's context stays current, as a no-op span would carry it."""
    if isinstance(tracer, trace.NoOpTracer):
        return False
    context = trace.get_current_span().get_span_context()
    return not context.is_valid or context.trace_flags.sampled


def _inputs_of(step: Step, available: Mapping[str, WireTensor]) -> dict[str, WireTensor]:
    """The step's inputs by its own names, from the tensors produced so far."""
    return {k: available[v] for k, v in step.input_map.items() if v in available}


def _check_maps(name: str, step: Step, model: ModelIO) -> None:
    where = step.describe(name)
    for key in step.input_map:
        if key not in model.inputs:
            raise ConfigError(
                f"{where}: input_map names '{key}', which is not an input of "
                f"'{step.model}' (inputs: {sorted(model.inputs)})"
            )
    for spec in model.inputs.values():
        if spec.name not in step.input_map and not spec.optional:
            raise ConfigError(f"{where}: input '{spec.name}' of '{step.model}' is not mapped")
    for key in step.output_map:
        if key not in model.outputs:
            raise ConfigError(
                f"{where}: output_map names '{key}', which is not an output "
                f"of '{step.model}' (outputs: {sorted(model.outputs)})"
            )


def _check_inputs(
    name: str, step: Step, model: ModelIO, producers: Mapping[str, TensorSpec]
) -> None:
    for key, tensor in step.input_map.items():
        producer = producers.get(tensor)
        if producer is None:
            raise ConfigError(
                f"{step.describe(name)}: input '{key}' reads ensemble tensor "
                f"'{tensor}', which no input or step produces"
            )
        _check_match(
            f"{step.describe(name)} input '{key}' (from '{tensor}')", producer, model.inputs[key]
        )


def _check_match(where: str, produced: TensorSpec, consumed: TensorSpec) -> None:
    if produced.datatype != consumed.datatype:
        raise ConfigError(
            f"{where}: datatype {produced.datatype} does not match {consumed.datatype}"
        )
    if not _compatible(produced.shape, consumed.shape):
        raise ConfigError(
            f"{where}: shape {list(produced.shape)} does not match {list(consumed.shape)}"
        )


def _check_acyclic(name: str, steps: list[Step], inputs: set[str]) -> None:
    available = set(inputs)
    remaining = list(steps)
    while remaining:
        runnable = [s for s in remaining if set(s.input_map.values()) <= available]
        if not runnable:
            cycle = ", ".join(f"step {s.index} ('{s.model}')" for s in remaining)
            raise ConfigError(f"ensemble '{name}': steps depend on each other in a cycle: {cycle}")
        for step in runnable:
            remaining.remove(step)
            available.update(step.output_map.values())


def _downstream(steps: list[Step], source: Step) -> list[Step]:
    """Steps that (transitively) read what ``source`` produces, in config order."""
    produced = set(source.output_map.values())
    found: list[Step] = []
    changed = True
    while changed:
        changed = False
        for step in steps:
            if step is source or step in found:
                continue
            if set(step.input_map.values()) & produced:
                found.append(step)
                produced |= set(step.output_map.values())
                changed = True
    return [s for s in steps if s in found]


def is_finished(tensor: WireTensor | None) -> bool:
    """True when a FINISH_REASON tensor holds a non-empty reason."""
    if tensor is None or tensor.datatype != "BYTES":
        return False
    return any(
        bool(item)
        for item in decode_raw(FINISH_TENSOR, "BYTES", tensor.shape, tensor.raw).reshape(-1)
    )
