"""The orchestrator's ensemble queues: requests that arrive together cross the
steps' stages as one batch.

Step by step, each request of an ensemble makes a round trip to every step's
stage, and each stage decodes, queues, batches, splits and answers it on its
own. For an ensemble whose steps are all batched stage models (none streaming,
none an ensemble), the requests that wait together here are stacked along
dim 0 (ensemble_batches.py): each step gets one request for all of them, which
its batcher sends at once (the ``GATHERED`` parameter), and the ensemble's
outputs are split back by rows.

Lanes (batches at a time): one per instance of the widest step, over all its
replicas, and one more, so that while every instance of that step runs a
batch, another batch crosses the cheaper steps. A caller's deadline bounds
its own wait (DEADLINE_EXCEEDED); its batch runs on for the others. A request
that finds nothing else in flight runs alone, step by step (runner.py), as
every request to an ensemble whose ``ensemble_batching`` parameter is
``false`` does.

No gRPC servicer here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from inference import model_config_pb2 as mc
from services.orchestrator.ensemble import EnsemblePlan, Step, StepCall, WireTensor
from services.orchestrator.ensemble_batches import EnsembleBatches, ensemble_policy, lane_count
from services.orchestrator.ensembles import EnsembleRegistry
from services.orchestrator.handoff import HandoffPool, HandoffScope, handoff_call
from services.orchestrator.router import StageRouter
from services.orchestrator.step_wire import answer_tensors, request_bytes
from shared.batcher import BatchPolicy
from shared.errors import DeadlineExceeded, InvalidArgument
from shared.request import InferRequest, InferResponse
from shared.servicer import GATHERED, to_domain

Outputs = dict[str, WireTensor]


@dataclass(frozen=True)
class _Queue:
    """One ensemble's queue (None: it does not batch), for the plan and lane count
    it was made for."""

    plan: EnsemblePlan
    endpoints: int
    """How many stage endpoints the router knew (when that changes, so may the lanes)."""
    lanes: int
    batches: EnsembleBatches | None
    max_rows: int = 0
    """The most rows a request may bring (the narrowest step's max_batch_size)."""


class EnsembleQueues:
    """A queue per batching ensemble; each batch through the steps' stages."""

    def __init__(
        self,
        router: StageRouter,
        ensembles: EnsembleRegistry,
        tracer: trace.Tracer,
        handoff: HandoffPool | None = None,
    ) -> None:
        self._router = router
        self._ensembles = ensembles
        self._tracer = tracer
        self._handoff = handoff
        self._queues: dict[str, _Queue] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        """Replaced queues finishing what they hold."""

    async def infer(
        self,
        plan: EnsemblePlan,
        request: pb.ModelInferRequest,
        timeout_s: float | None,
        alone: Callable[[], Awaitable[Outputs]],
    ) -> Outputs:
        """The ensemble's outputs for ``request``: by way of its queue, within
        ``timeout_s``, or from ``alone`` (the request by itself, step by step, as an
        ensemble that does not batch runs each one). Alone go a request that finds
        nothing else of the ensemble in flight (the queue would only add its own
        work), one that could not share a batch (its inputs' rows disagree, or are
        none or too many) and one that names an output the ensemble lacks: each is
        answered as it always was."""
        if any(output.name not in plan.io.outputs for output in request.outputs):
            return await alone()
        queue = await self._queue(plan)
        if queue.batches is None:
            return await alone()
        if queue.batches.idle:
            with queue.batches.alone():
                return await alone()
        try:
            domain = to_domain(request)
        except InvalidArgument as exc:
            raise InvalidArgument(f"ensemble '{plan.name}': {exc.message}") from None
        if not 1 <= _rows(domain) <= queue.max_rows:
            return await alone()
        with self._ensembles.recorded(plan.name):
            answer = await _within(queue.batches.infer(domain), timeout_s, plan.name)
        return {name: WireTensor.of(array) for name, array in answer.outputs.items()}

    async def _queue(self, plan: EnsemblePlan) -> _Queue:
        """The plan's queue, made (again) when the plan or its lane count changed."""
        queue = self._queues.get(plan.name)
        endpoints = len(self._router.endpoints)
        if queue is not None and queue.plan is plan and queue.endpoints == endpoints:
            return queue
        configs = self._ensembles.step_configs.get(plan.name, {})
        lanes = self._lanes(configs)
        if queue is not None and queue.plan is plan and queue.lanes == lanes:
            made = _Queue(plan, endpoints, lanes, queue.batches, queue.max_rows)
            self._queues[plan.name] = made
            return made
        made = _Queue(plan, endpoints, lanes, None)
        policy = _policy(plan, configs, lanes)
        if policy is not None:
            batches = EnsembleBatches(plan.name, policy, lanes, self._runner(plan), self._tracer)
            await batches.start()
            made = _Queue(plan, endpoints, lanes, batches, policy.max_batch_size)
        self._retire(queue)
        self._queues[plan.name] = made
        return made

    def forget(self, name: str) -> None:
        """Drop the ensemble's queue (it was unloaded or reloaded); what it holds
        still runs."""
        self._retire(self._queues.pop(name, None))

    def _lanes(self, configs: dict[str, mc.ModelConfig]) -> int:
        """One lane per instance of the widest step, over its replicas, and one more."""
        widest = max(
            (
                _instances(config) * max(1, len(self._router.replicas(model)))
                for model, config in configs.items()
            ),
            default=1,
        )
        return lane_count(widest)

    def _runner(self, plan: EnsemblePlan) -> EnsembleBatchRun:
        return EnsembleBatchRun(plan, self._router, self._tracer, self._handoff)

    def _retire(self, queue: _Queue | None) -> None:
        """Let a replaced queue finish what it holds, in a task kept until it has."""
        if queue is None or queue.batches is None:
            return
        task = asyncio.get_running_loop().create_task(queue.batches.stop())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        """Finish what every queue holds, then end their lanes."""
        queues = [queue.batches for queue in self._queues.values() if queue.batches is not None]
        self._queues.clear()
        for batches in queues:
            await batches.stop()
        if self._retiring:
            await asyncio.wait(self._retiring)


class EnsembleBatchRun:
    """One (possibly stacked) request through the plan, each step one message to
    its stage on an open stream (router.forward), flagged as a gathered batch; its
    large tensors in shared-memory buffers with ``handoff`` (handoff.py)."""

    def __init__(
        self,
        plan: EnsemblePlan,
        router: StageRouter,
        tracer: trace.Tracer,
        handoff: HandoffPool | None = None,
    ) -> None:
        self._plan = plan
        self._router = router
        self._tracer = tracer
        self._handoff = handoff

    async def __call__(self, request: InferRequest) -> InferResponse:
        """The plan's outputs that ``request`` asked for (all when it named none)."""
        parameters = {GATHERED: pb.InferParameter(bool_param=True)}
        if request.priority:
            parameters["priority"] = pb.InferParameter(int64_param=request.priority)
        if request.timeout_us:
            parameters["timeout"] = pb.InferParameter(int64_param=request.timeout_us)
        if self._handoff is None:
            return await self._plan.run_arrays(
                request, self._step_call(request.id, parameters), self._tracer
            )
        scope = HandoffScope(self._handoff)
        call = handoff_call(self._router, scope, self._plan.intermediate, request.id, parameters)
        succeeded = False
        try:
            answer = await self._plan.run_arrays(request, call, self._tracer)
            succeeded = True
            return answer
        finally:
            scope.release(succeeded)

    def _step_call(self, request_id: str, parameters: dict[str, pb.InferParameter]) -> StepCall:
        async def call(step: Step, inputs: Outputs, outputs: list[str]) -> Outputs:
            data = request_bytes(step, inputs, outputs, request_id, parameters)
            answer = await self._router.forward(step.model, data, None, request_id)
            return answer_tensors(step.model, answer)

        return call


async def _within(
    answer: Awaitable[InferResponse], timeout_s: float | None, ensemble: str
) -> InferResponse:
    """``answer``, or DEADLINE_EXCEEDED once the caller's ``timeout_s`` has passed."""
    if timeout_s is None:
        return await answer
    try:
        return await asyncio.wait_for(answer, timeout_s)
    except TimeoutError:
        raise DeadlineExceeded(
            f"ensemble '{ensemble}': no answer within the caller's deadline ({timeout_s:.3f} s)"
        ) from None


def _rows(request: InferRequest) -> int:
    """The rows every input of ``request`` brings; 0 when they disagree (or one
    has no dims), so that its rows could not be told apart in a batch."""
    counts = {array.shape[0] if array.ndim else -1 for array in request.inputs.values()}
    return counts.pop() if len(counts) == 1 and -1 not in counts else 0


def _policy(
    plan: EnsemblePlan, configs: dict[str, mc.ModelConfig], lanes: int
) -> BatchPolicy | None:
    """How the plan's queue batches; None when a step is not a stage model (a nested
    ensemble), streams, keeps sequences, or the ensemble or a step has no batch
    dimension, or its ``ensemble_batching`` parameter is ``false``."""
    if plan.streaming is not None or {step.model for step in plan.steps} != set(configs):
        return None
    if any(config.HasField("sequence_batching") for config in configs.values()):
        return None
    return ensemble_policy(plan.config, list(configs.values()), lanes)


def _instances(config: mc.ModelConfig) -> int:
    """The model's execution instances on one replica, as its instance_group lists them
    (a GPU group without a device list counted once)."""
    groups = list(config.instance_group) or [mc.ModelInstanceGroup(count=1)]
    return sum((group.count or 1) * max(1, len(group.gpus)) for group in groups)
