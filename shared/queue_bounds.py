"""How much a model may queue, and for how long, when its config does not say.

Every model's queue is bounded by default: a request beyond the bound is
refused RESOURCE_EXHAUSTED (HTTP 429) at once instead of waiting without end,
and one that waited too long fails UNAVAILABLE. A model's config decides
first (Triton's ``dynamic_batching`` queue policies, or the ``max_queue_size``
and ``queue_timeout_us`` parameters); the stage's ``QueueDefaults`` (mesh YAML,
per stage) decide for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference import model_config_pb2 as mc
from shared.batch_delay import QUEUE_DELAY_POLICIES, QueueDelayPolicy
from shared.batcher import BatchPolicy, QueuePolicy
from shared.errors import ConfigError

QUEUED_BATCHES_PER_INSTANCE = 8
"""A model whose config bounds no queue may hold this many full batches per
instance queued (per priority level), e.g. 8 x max_batch_size 8 x 2 instances =
128 requests; one more is refused RESOURCE_EXHAUSTED (HTTP 429) at once instead
of waiting without end. The ``max_queue_size`` parameter (0: unbounded) or
Triton's ``default_queue_policy.max_queue_size`` replace it."""

DEFAULT_QUEUE_TIMEOUT_US = 30_000_000
"""A request that waited this long in a queue (30 s) fails UNAVAILABLE, unless
the config sets Triton's ``default_timeout_microseconds`` or the
``queue_timeout_us`` parameter (0: no timeout)."""

STREAMS_PER_INSTANCE = 256
"""A decoupled model (no batcher) runs at most this many streams per instance at
once unless its ``max_queue_size`` parameter says otherwise (0: unbounded)."""


@dataclass(frozen=True)
class QueueDefaults:
    """A stage's bounds for the models whose config sets none (0: unbounded / none)."""

    queued_batches_per_instance: int = QUEUED_BATCHES_PER_INSTANCE
    """Full batches (requests, for an unbatched model) queued per instance and level."""
    queue_timeout_us: int = DEFAULT_QUEUE_TIMEOUT_US
    """Longest wait in a queue."""
    streams_per_instance: int = STREAMS_PER_INSTANCE
    """Streams a decoupled model runs at once per instance."""
    queue_delay_policy: QueueDelayPolicy = "adaptive"
    """How a partial batch waits: ``adaptive`` (only while requests arrive together)
    or ``fixed`` (Triton's: the whole ``max_queue_delay_microseconds``)."""


DEFAULTS = QueueDefaults()
"""What a stage uses unless its config says otherwise."""


def _count_parameter(config: mc.ModelConfig, key: str) -> int | None:
    """A non-negative integer parameter; None when the config does not set it."""
    if key not in config.parameters:
        return None
    value = config.parameters[key].string_value.strip()
    if not value.isdigit():
        raise ConfigError(
            f"model '{config.name}': parameter {key} must be an integer >= 0, got {value!r}"
        )
    return int(value)


def default_queue_size(
    config: mc.ModelConfig, instances: int, defaults: QueueDefaults = DEFAULTS
) -> int:
    """The per-level queue bound of a config that sets none (0: unbounded)."""
    configured = _count_parameter(config, "max_queue_size")
    if configured is not None:
        return configured
    per_instance = defaults.queued_batches_per_instance * max(1, config.max_batch_size)
    return per_instance * max(1, instances)


def default_queue_timeout_us(config: mc.ModelConfig, defaults: QueueDefaults = DEFAULTS) -> int:
    """The queue timeout of a config that sets none (0: no timeout)."""
    configured = _count_parameter(config, "queue_timeout_us")
    return defaults.queue_timeout_us if configured is None else configured


def queue_delay_policy(
    config: mc.ModelConfig, defaults: QueueDefaults = DEFAULTS
) -> QueueDelayPolicy:
    """The ``queue_delay_policy`` parameter, else the stage's default."""
    if "queue_delay_policy" not in config.parameters:
        return defaults.queue_delay_policy
    value = config.parameters["queue_delay_policy"].string_value.strip()
    if value not in QUEUE_DELAY_POLICIES:
        raise ConfigError(
            f"model '{config.name}': parameter queue_delay_policy must be one of "
            f"{', '.join(QUEUE_DELAY_POLICIES)}, got {value!r}"
        )
    return value


def stream_limit(config: mc.ModelConfig, instances: int, defaults: QueueDefaults = DEFAULTS) -> int:
    """How many streams a decoupled model runs at once (0: unbounded)."""
    configured = _count_parameter(config, "max_queue_size")
    if configured is not None:
        return configured
    return defaults.streams_per_instance * max(1, instances)


def batch_policy(
    config: mc.ModelConfig, instances: int = 1, defaults: QueueDefaults = DEFAULTS
) -> BatchPolicy:
    """Triton's dynamic_batching settings as a BatchPolicy; a queue policy that
    sets no size or timeout gets the bounded defaults."""
    dyn = config.dynamic_batching
    size = default_queue_size(config, instances, defaults)
    timeout_us = default_queue_timeout_us(config, defaults)

    def queue_policy(policy: mc.ModelQueuePolicy) -> QueuePolicy:
        return QueuePolicy(
            timeout_action="DELAY"
            if policy.timeout_action == mc.ModelQueuePolicy.DELAY
            else "REJECT",
            default_timeout_us=policy.default_timeout_microseconds or timeout_us,
            allow_timeout_override=policy.allow_timeout_override,
            max_queue_size=policy.max_queue_size or size,
        )

    return BatchPolicy(
        max_batch_size=config.max_batch_size,
        dynamic_batching=config.HasField("dynamic_batching"),
        preferred_batch_sizes=tuple(dyn.preferred_batch_size),
        max_queue_delay_us=dyn.max_queue_delay_microseconds,
        queue_delay_policy=queue_delay_policy(config, defaults),
        preserve_ordering=dyn.preserve_ordering,
        priority_levels=dyn.priority_levels,
        default_priority_level=dyn.default_priority_level,
        default_queue_policy=queue_policy(dyn.default_queue_policy),
        priority_queue_policy={
            level: queue_policy(policy) for level, policy in dyn.priority_queue_policy.items()
        },
    )
