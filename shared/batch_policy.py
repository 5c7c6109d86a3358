"""A model's batching and queueing policy (Triton's ``dynamic_batching`` block),
validated once when it is made: every field bounded, a ConfigError naming the
field otherwise. ``shared.batcher`` runs it; ``shared.queue_bounds`` builds it
from a model's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from shared.batch_delay import QUEUE_DELAY_POLICIES, QueueDelayPolicy
from shared.errors import ConfigError


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_range(field_name: str, value: int, low: int, high: int | None = None) -> None:
    ok, bounds = low <= value, f">= {low}" if high is None else f"in {low}..{high}"
    _check(ok and (high is None or value <= high), f"{field_name} must be {bounds}, got {value}")


@dataclass(frozen=True)
class QueuePolicy:
    """How one priority level bounds and times out its queue (Triton ModelQueuePolicy)."""

    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    """A timed-out request fails (REJECT) or moves behind every other request (DELAY)."""
    default_timeout_us: int = 0
    """Longest wait in the queue, in microseconds, >= 0; 0 means no timeout."""
    allow_timeout_override: bool = False
    """Whether a request's own ``timeout_us`` may shorten (never lengthen) the default."""
    max_queue_size: int = 0
    """Most requests this level may hold queued, >= 0; 0 means unbounded."""

    def __post_init__(self) -> None:
        _check(
            self.timeout_action in ("REJECT", "DELAY"),
            f"QueuePolicy.timeout_action must be REJECT or DELAY, got {self.timeout_action!r}",
        )
        _check_range("QueuePolicy.default_timeout_us", self.default_timeout_us, 0)
        _check_range("QueuePolicy.max_queue_size", self.max_queue_size, 0)


@dataclass(frozen=True)
class BatchPolicy:
    """How one model's requests are queued and batched (Triton ModelDynamicBatching)."""

    max_batch_size: int = 0
    """Most rows (dim 0, summed over requests) in one batch, >= 0; 0: no batch dimension."""
    dynamic_batching: bool = False
    """Combine queued requests into batches; False runs each request alone, from one queue."""
    preferred_batch_sizes: tuple[int, ...] = ()
    """Row counts sent as soon as they can be formed; each in 1..max_batch_size."""
    max_queue_delay_us: int = 0
    """How long, >= 0, the oldest queued request waits for a batch to fill; 0: never."""
    queue_delay_policy: QueueDelayPolicy = "adaptive"
    """``fixed``: always wait out ``max_queue_delay_us`` (Triton); ``adaptive``: wait
    only while requests arrive together, at most that long (shared/batch_delay.py)."""
    preserve_ordering: bool = False
    """Deliver responses in the order the requests arrived, even across instances."""
    priority_levels: int = 0
    """Number of priority levels, >= 0 (1 is the highest); 0 means a single level."""
    default_priority_level: int = 0
    """Level of a request with priority 0: 1..priority_levels (0 when there are none)."""
    default_queue_policy: QueuePolicy = QueuePolicy()
    """Queue policy of every level that ``priority_queue_policy`` does not name."""
    priority_queue_policy: Mapping[int, QueuePolicy] = field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )
    """Queue policy by priority level; keys in 1..priority_levels."""

    def __post_init__(self) -> None:
        # Copies, so a caller's list or dict cannot change a frozen policy afterwards.
        object.__setattr__(self, "preferred_batch_sizes", tuple(self.preferred_batch_sizes))
        object.__setattr__(
            self, "priority_queue_policy", MappingProxyType(dict(self.priority_queue_policy))
        )
        self._validate_batching()
        self._validate_priorities()

    def _validate_batching(self) -> None:
        _check_range("BatchPolicy.max_batch_size", self.max_batch_size, 0)
        _check_range("BatchPolicy.max_queue_delay_us", self.max_queue_delay_us, 0)
        _check(
            self.queue_delay_policy in QUEUE_DELAY_POLICIES,
            "BatchPolicy.queue_delay_policy must be one of "
            f"{', '.join(QUEUE_DELAY_POLICIES)}, got {self.queue_delay_policy!r}",
        )
        for size in self.preferred_batch_sizes:
            _check_range("BatchPolicy.preferred_batch_sizes", size, 1, self.max_batch_size)

    def _validate_priorities(self) -> None:
        levels = self.priority_levels
        _check_range("BatchPolicy.priority_levels", levels, 0)
        low = 1 if levels else 0  # with no levels, the default level must stay 0
        _check_range("BatchPolicy.default_priority_level", self.default_priority_level, low, levels)
        for level in self.priority_queue_policy:
            _check_range("BatchPolicy.priority_queue_policy level", level, 1, levels)

    @property
    def level_count(self) -> int:
        """Number of queues: ``priority_levels``, or one when priorities are off."""
        return max(1, self.priority_levels)

    def queue_policy(self, level: int) -> QueuePolicy:
        """The queue policy of ``level`` (1-based)."""
        return self.priority_queue_policy.get(level, self.default_queue_policy)
