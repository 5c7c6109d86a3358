"""How long a free instance holds a partial batch back, waiting for it to fill.

The batcher asks this only when an instance is free and the queued requests make
neither a full batch nor a preferred size. Two policies:

``fixed``     Triton's semantics: wait until ``max_queue_delay_us`` after the
              oldest queued request arrived, whatever the traffic.
``adaptive``  (the default) wait only while requests are arriving together, and
              only about as long as the next one is expected to take:

              - an arrival "finds company" when other requests of the model are
                queued or executing; the share of recent arrivals that found
                company says whether requests overlap at all. Below one half
                (one request in flight, or sparse traffic) nothing would join
                the batch, so it is sent at once;
              - while they overlap, the gap between arrivals that found company
                is learned; the batch is held until ``GAP_FACTOR`` such gaps
                after the newest arrival (a lull ends the wait early), and
                never past the fixed deadline.

So batching costs nothing at low load (a lone request runs as soon as it is
queued) and still forms batches under load. Times are plain integers
(``time.monotonic_ns``) passed in, so the policy is tested with a fake clock.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

__all__ = ["GAP_FACTOR", "QUEUE_DELAY_POLICIES", "BatchDelay", "QueueDelayPolicy"]

QueueDelayPolicy: TypeAlias = Literal["adaptive", "fixed"]
QUEUE_DELAY_POLICIES: tuple[QueueDelayPolicy, ...] = ("adaptive", "fixed")

GAP_FACTOR = 2.0
"""Expected gaps a partial batch waits after its newest arrival: one is the mean,
the second absorbs the jitter of a busy host."""
WEIGHT = 0.125
"""Weight of the newest arrival in the running averages (about the last 8 count)."""
COMPANY_SHARE = 0.5
"""Share of recent arrivals that must have found company for a batch to wait."""


class BatchDelay:
    """The deadline of a partial batch under one policy, learned from arrivals."""

    def __init__(self, policy: QueueDelayPolicy, max_delay_us: int) -> None:
        self.policy = policy
        self._max_ns = max_delay_us * 1000
        self._company = 0.0
        """Running share of arrivals that found other requests in flight."""
        self._gap_ns = 0.0
        """Running mean gap between arrivals that found company (0: none seen yet)."""
        self._last_ns: int | None = None
        self._newest_ns = 0

    @property
    def company(self) -> float:
        """The running share of arrivals that found other requests in flight."""
        return self._company

    @property
    def gap_ns(self) -> float:
        """The learned gap between overlapping arrivals (0 until one is seen)."""
        return self._gap_ns

    def arrived(self, now_ns: int, company: bool) -> None:
        """Learn from one arrival: ``company`` when others were queued or executing."""
        self._company += WEIGHT * (float(company) - self._company)
        if company and self._last_ns is not None:
            gap = max(0, now_ns - self._last_ns)
            learned = self._gap_ns
            self._gap_ns = float(gap) if learned == 0 else learned + WEIGHT * (gap - learned)
        self._last_ns = self._newest_ns = now_ns

    def waits_for_company(self) -> bool:
        """Whether a lone request would be held for others to join it (``deadline_ns``
        past its arrival); if not, it may as well run the moment it arrives."""
        if self._max_ns == 0:
            return False
        if self.policy == "fixed":
            return True
        return self._company >= COMPANY_SHARE and self._gap_ns != 0

    def deadline_ns(self, oldest_ns: int) -> int:
        """When a partial batch whose oldest request arrived at ``oldest_ns`` goes."""
        limit = oldest_ns + self._max_ns
        if self.policy == "fixed" or self._max_ns == 0:
            return limit
        if self._company < COMPANY_SHARE or self._gap_ns == 0:
            return oldest_ns  # requests come alone: nothing would join
        return min(limit, self._newest_ns + round(GAP_FACTOR * self._gap_ns))
