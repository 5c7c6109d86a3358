"""One request through an ensemble: its inputs in, each step a stage call, its answer out.

The ensemble's graph (ensemble.py) decides which step runs when; this module
makes each step's request, sends it where the step's model lives (a unary
call through the router, a message on one of the generation's open streams,
or, for a nested ensemble, the core again), and turns the ensemble's outputs
into the v2 response. Tensors stay raw bytes from the caller to the stages
and back; only outputs that ask for classification are decoded.

No gRPC servicer here: the caller's deadline comes as a ``Deadline`` and its
cancellation as asyncio cancellation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import (
    FINISH_TENSOR,
    EnsemblePlan,
    Step,
    StepCall,
    StepStream,
    WireTensor,
    is_finished,
)
from services.orchestrator.ensemble_queues import EnsembleQueues
from services.orchestrator.ensembles import ENSEMBLE_VERSION, EnsembleRegistry
from services.orchestrator.handoff import HandoffPool, HandoffScope, handoff_call, in_messages
from services.orchestrator.route_headers import FINAL_ONLY_PARAMETER
from services.orchestrator.router import StageRouter
from services.orchestrator.step_wire import answer_tensors, request_bytes
from services.orchestrator.streaming import StepStreams, relay, wire_outputs
from shared.classification import classification
from shared.errors import InvalidArgument
from shared.servicer import refuse_shared_memory
from shared.stream_messages import EMPTY_FINAL_RESPONSE, FINAL_RESPONSE
from shared.tensors import decode_inputs, decode_raw, encode_raw, refuse_mixed_contents

Outputs = dict[str, WireTensor]
Classifier = Callable[[Outputs], Outputs]


@dataclass(frozen=True)
class Deadline:
    """The caller's deadline, as the time left for each call made on its behalf."""

    at: float | None

    @classmethod
    def after(cls, timeout_s: float | None) -> Deadline:
        """The deadline ``timeout_s`` from now (None: no deadline)."""
        return cls(None if timeout_s is None else time.monotonic() + timeout_s)

    def remaining(self) -> float | None:
        """Seconds left for the next call (at least a millisecond: it then fails fast)."""
        return None if self.at is None else max(0.001, self.at - time.monotonic())


NestedInfer = Callable[[pb.ModelInferRequest, Deadline], Awaitable[pb.ModelInferResponse]]
"""How a step whose model is itself an ensemble runs (the core's infer)."""


def wire_inputs(request: pb.ModelInferRequest) -> Outputs:
    """Request inputs in wire form; typed contents are re-encoded raw once."""
    refuse_shared_memory(request)
    refuse_mixed_contents(request)
    if request.raw_input_contents:
        if len(request.raw_input_contents) != len(request.inputs):
            raise InvalidArgument(
                f"raw_input_contents has {len(request.raw_input_contents)} entries for "
                f"{len(request.inputs)} inputs; send all inputs raw or none"
            )
        raws = list(request.raw_input_contents)
    else:
        arrays = decode_inputs(request)
        raws = [encode_raw(arrays[t.name]) for t in request.inputs]
    return {
        t.name: WireTensor(t.datatype, tuple(t.shape), raw)
        for t, raw in zip(request.inputs, raws, strict=True)
    }


class EnsembleRunner:
    """Runs ensemble requests over the router's stages."""

    def __init__(
        self,
        router: StageRouter,
        ensembles: EnsembleRegistry,
        nested: NestedInfer,
        tracer: trace.Tracer,
        handoff: HandoffPool | None = None,
    ) -> None:
        self.router = router
        self.ensembles = ensembles
        self.nested = nested
        self.tracer = tracer
        self.handoff = handoff
        """Shared-memory buffers for steps' large tensors (handoff.py); None: messages."""
        self.queues = EnsembleQueues(router, ensembles, tracer, handoff)

    async def infer(
        self, plan: EnsemblePlan, request: pb.ModelInferRequest, deadline: Deadline
    ) -> pb.ModelInferResponse:
        """The ensemble's one answer to ``request``."""
        classify = self._classifier(plan, request)

        async def alone() -> Outputs:
            scope = HandoffScope(self.handoff) if self.handoff is not None else None
            call = self._step_call(request, deadline, scope=scope, plan=plan)
            succeeded = False
            try:
                outputs = await self.ensembles.run(plan, wire_inputs(request), call, self.tracer)
                succeeded = True
                return outputs
            finally:
                if scope is not None:
                    scope.release(succeeded)

        # Through the ensemble's queue: with the requests waiting beside it, as one
        # batch, else alone (ensemble_queues.py).
        outputs = await self.queues.infer(plan, request, deadline.remaining(), alone)
        return _response(plan, request, classify(outputs))

    async def close(self) -> None:
        """Finish the batches the ensembles' queues hold."""
        await self.queues.close()

    async def stream(
        self, plan: EnsemblePlan, request: pb.ModelInferRequest, deadline: Deadline
    ) -> AsyncGenerator[pb.ModelInferResponse, None]:
        """Every response of a streaming ensemble, each flagged final or not."""
        classify = self._classifier(plan, request)
        streams = StepStreams(self.router)
        # Nested ensembles run through the core (unary); the other later steps stream.
        later = [s for s in plan.downstream if self.ensembles.get(s.model) is None]
        outputs_stream = self.ensembles.stream(
            plan,
            wire_inputs(request),
            self._step_call(request, deadline, streams),
            self._step_stream(request, streams, later),
            self.tracer,
        )
        # Each response goes out as soon as it is made; the one that carries a
        # finish reason is the last and says so (holding each back until the
        # next came, to flag the last, would delay every token by one step).
        last = False
        try:
            async for outputs in outputs_stream:
                response = _response(plan, request, classify(outputs))
                last = is_finished(outputs.get(FINISH_TENSOR))
                response.parameters[FINAL_RESPONSE].bool_param = last
                yield response
        finally:
            streams.close()
        asked = request.parameters.get(EMPTY_FINAL_RESPONSE)
        if not last and asked is not None and asked.bool_param:
            # Ended without a finish reason: as Triton, a flags-only final
            # response, only for a caller that asked for one.
            final = pb.ModelInferResponse(
                model_name=plan.name, model_version=ENSEMBLE_VERSION, id=request.id
            )
            final.parameters[FINAL_RESPONSE].bool_param = True
            yield final

    def _classifier(self, plan: EnsemblePlan, request: pb.ModelInferRequest) -> Classifier:
        """What answers the ensemble outputs that ask for classification as their
        top classes (labels from the ensemble's folder); the identity when none does."""
        repository = self.ensembles.repository
        folder = repository.root / plan.name if repository is not None else None
        wanted = classification(request, plan.config, folder)
        if wanted is None:
            return lambda outputs: outputs

        def classify(outputs: Outputs) -> Outputs:
            arrays = {
                name: decode_raw(name, tensor.datatype, tensor.shape, tensor.raw)
                for name, tensor in outputs.items()
                if name in wanted.classes
            }
            answered = dict(outputs)
            for name, array in wanted.apply(arrays).items():
                answered[name] = WireTensor("BYTES", array.shape, encode_raw(array))
            return answered

        return classify

    def _step_call(
        self,
        request: pb.ModelInferRequest,
        deadline: Deadline,
        streams: StepStreams | None = None,
        scope: HandoffScope | None = None,
        plan: EnsemblePlan | None = None,
    ) -> StepCall:
        """Run one step: a ModelInfer, or a message on the step's open stream (its
        large tensors in ``scope``'s buffers where it has one)."""

        parameters = {
            key: request.parameters[key]
            for key in ("priority", "timeout")
            if key in request.parameters
        }
        handed = None
        if scope is not None and plan is not None:
            handed = handoff_call(
                self.router,
                scope,
                plan.intermediate,
                request.id,
                parameters,
                deadline.remaining,
            )

        async def call(step: Step, inputs: Outputs, outputs: list[str]) -> Outputs:
            nested = self.ensembles.get(step.model) is not None
            if handed is not None and not nested and streams is None:
                return await handed(step, inputs, outputs)
            inputs = in_messages(inputs)
            data = request_bytes(step, inputs, outputs, request.id, parameters)
            if not nested and streams is None and deadline.at is None:
                # No deadline to pass on: as a forwarded request, a message on an open
                # stream with its trace context (forward_stream.py), which costs the
                # orchestrator and the stage less than a new RPC; neither message is
                # decoded here (step_wire.py).
                answer = await self.router.forward(step.model, data, None, request.id)
                return answer_tensors(step.model, answer)
            sub = pb.ModelInferRequest.FromString(data)
            if nested:
                return wire_outputs(await self.nested(sub, deadline))
            if streams is None:
                return wire_outputs(await self._unary(sub, deadline))
            return wire_outputs(await streams.infer(step.index, sub))

        return call

    async def _unary(
        self, request: pb.ModelInferRequest, deadline: Deadline
    ) -> pb.ModelInferResponse:
        timeout = deadline.remaining()
        response: pb.ModelInferResponse = await self.router.call(
            request.model_name, lambda stub: stub.ModelInfer(request, timeout=timeout)
        )
        return response

    def _step_stream(
        self, request: pb.ModelInferRequest, streams: StepStreams, later: Sequence[Step]
    ) -> StepStream:
        """Relay the decoupled step; once its request is on its way, take the
        ``later`` steps' streams, so that where no spare stream waits the stages set
        new ones up during the prefill, not when the first token waits for them."""

        async def stream(
            step: Step, inputs: Outputs, outputs: list[str]
        ) -> AsyncGenerator[Outputs, None]:
            sub = pb.ModelInferRequest.FromString(request_bytes(step, inputs, outputs, request.id))
            # The engine serves by the caller's priority and, asked for, answers once.
            for key in ("priority", FINAL_ONLY_PARAMETER):
                if key in request.parameters:
                    sub.parameters[key].CopyFrom(request.parameters[key])
            async for response in relay(self.router, sub, lambda: streams.open_soon(later)):
                yield wire_outputs(response)

        return stream


def _response(
    plan: EnsemblePlan, request: pb.ModelInferRequest, outputs: Outputs
) -> pb.ModelInferResponse:
    """The ensemble's outputs the request asked for (all when it named none)."""
    wanted = [o.name for o in request.outputs] or list(outputs)
    unknown = [name for name in wanted if name not in outputs]
    if unknown:
        raise InvalidArgument(
            f"ensemble '{plan.name}': unknown output {unknown}; expected {sorted(outputs)}"
        )
    response = pb.ModelInferResponse(
        model_name=plan.name, model_version=ENSEMBLE_VERSION, id=request.id
    )
    for name in wanted:
        tensor = outputs[name]
        response.outputs.add(name=name, datatype=tensor.datatype, shape=list(tensor.shape))
        response.raw_output_contents.append(bytes(tensor.raw))
    return response
