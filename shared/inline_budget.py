"""When a model's batch runs on the event loop instead of its instance's thread.

Handing a batch to the instance's thread and back costs a fixed share of a
request (the executor's queue, waking the thread, the GIL passed to it and
back, the loop woken with the result): for a small model it is more than the
model itself (docs/performance.md, "The gRPC front doors"). So an instance
whose backend says its compute is safe to run on the loop (``LoopSafeInstance``:
the pytorch and onnxruntime backends, whose compute never calls back into the
loop) runs a batch right there once its batches are measured cheap:

- every batch's CPU time is measured in the thread that runs it (the instance's
  or the loop's) and learned as a running average that jumps at once to any
  slower batch and falls back slowly (``WEIGHT``). CPU time, not wall time: on
  a busy host a batch's wall time in the thread also counts its waits for the
  GIL and for a core, which would keep a cheap model in its thread exactly
  when the hand-off costs most. Only CPU instances are loop-safe (a GPU forward
  waits on the device without using the CPU);
- a batch runs on the loop when at least ``SAMPLES`` batches were measured and
  the learned time is within the bound (the ``inline_execution_us`` parameter of
  the model's config, ``DEFAULT_BOUND_US`` when absent, 0: always the thread);
- a batch that runs longer than the bound sends the next ones back to the
  thread until cheap batches (measured there) bring the average under it again.

So one slow model, or a slow batch of a cheap one, stalls the loop at most once
before its work moves off it. Times are plain integers passed in, so the rule
is tested with made-up durations.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from inference import model_config_pb2 as mc
from shared.errors import ConfigError

__all__ = [
    "DEFAULT_BOUND_US",
    "PARAMETER",
    "SAMPLES",
    "WEIGHT",
    "InlineBudget",
    "LoopSafeInstance",
    "inline_bound_us",
]

PARAMETER = "inline_execution_us"
DEFAULT_BOUND_US = 500
"""A batch learned to take at most this long runs on the loop. Half a
millisecond is about what the hand-off to the thread and back costs a request
on a small busy host, and short enough that other requests barely notice."""
MAX_BOUND_US = 100_000
SAMPLES = 8
"""Batches measured (in the thread) before any runs on the loop."""
WEIGHT = 0.125
"""Weight of a faster batch in the running average (about the last 8 count)."""


@runtime_checkable
class LoopSafeInstance(Protocol):
    """A backend instance whose ``execute`` may run on the event loop's thread:
    it neither blocks on nor calls into the loop, computes on the CPU (its CPU
    time is its cost), and its framework's threads are set per call."""

    loop_safe: bool


def inline_bound_us(config: mc.ModelConfig) -> int:
    """The model's ``inline_execution_us`` parameter, else ``DEFAULT_BOUND_US``."""
    if PARAMETER not in config.parameters:
        return DEFAULT_BOUND_US
    raw = config.parameters[PARAMETER].string_value.strip()
    if not raw.isdigit() or int(raw) > MAX_BOUND_US:
        raise ConfigError(
            f"model '{config.name}': parameter {PARAMETER} must be an integer in "
            f"0..{MAX_BOUND_US} (microseconds; 0: never on the event loop), got {raw!r}"
        )
    return int(raw)


class InlineBudget:
    """Learns one instance's batch times and says whether the next runs inline."""

    def __init__(self, bound_us: int) -> None:
        self.bound_ns = bound_us * 1000
        self._estimate_ns = 0.0
        self._seen = 0

    @property
    def estimate_ns(self) -> float:
        """The learned execution time of a batch (0 until one is measured)."""
        return self._estimate_ns

    def allows(self) -> bool:
        """True when the next batch should run on the event loop."""
        return self.bound_ns > 0 and self._seen >= SAMPLES and self._estimate_ns <= self.bound_ns

    def measured(self, elapsed_ns: int) -> None:
        """Learn one batch's execution time."""
        self._seen += 1
        if elapsed_ns >= self._estimate_ns:
            self._estimate_ns = float(elapsed_ns)
        else:
            self._estimate_ns += WEIGHT * (elapsed_ns - self._estimate_ns)
