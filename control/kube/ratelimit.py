"""A token bucket: how a client keeps to a requests-per-second budget with bursts.

Why this module exists: a controller that reacts to a storm (a node pool of thousands scaled up
at once) must not answer it with a storm of its own against an API server other people share.
client-go gives every client a QPS and a burst; the Kubernetes adapter does the same with this
bucket, and the event recorder uses one to drop what a flood would repeat. Pure arithmetic on
the time the caller passes, so it is tested without clocks.
"""

from __future__ import annotations

import math

import attrs

__all__ = ["TokenBucket"]


@attrs.define
class TokenBucket:
    """`burst` tokens at most, refilled at `rate` per second; the bucket starts full."""

    rate: float
    burst: float
    _tokens: float = attrs.field(init=False)
    _at: float | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number, not {self.rate}")
        if not self.burst >= 1:
            raise ValueError(f"burst must be at least 1, not {self.burst}")
        self._tokens = self.burst

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        if self._at is None or now > self._at:
            self._at = now

    def try_take(self, now: float) -> bool:
        """Take a token if one is there."""
        self._refill(now)
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def reserve(self, now: float) -> float:
        """Take a token, borrowing it from the future when none is left: the seconds the
        caller waits before it may go (0 when it may go at once). Callers that reserve in
        turn are spaced by 1/rate."""
        self._refill(now)
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
