"""How long the agent waits before dialling the controlplane again.

Why this module exists: a fleet of agents that lost the controlplane at the same moment must not
all come back at the same moment, and an agent whose connection keeps dropping right after it is
made must slow down as if the dial had failed. The policy is pure arithmetic on a small state
record, so it is tested without clocks or sockets; the caller supplies the time and the random
number and does the sleeping.

Typical use::

    state = BackoffState()
    while True:
        try:
            conn = await dial()
        except OSError:
            record_failure(state)
        else:
            record_connected(state, trio.current_time())
            await serve(conn)
            record_disconnect(policy, state, trio.current_time())
        await trio.sleep(next_delay(policy, state, random.random()))
"""

from __future__ import annotations

import math

import attrs

__all__ = [
    "Backoff",
    "BackoffState",
    "next_delay",
    "record_connected",
    "record_disconnect",
    "record_failure",
]


def _finite(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"Backoff.{attribute.name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"Backoff.{attribute.name} must be a finite number, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"Backoff.{attribute.name} must be greater than 0, got {value!r}")


def _not_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ValueError(f"Backoff.{attribute.name} must be 0 or more, got {value!r}")


def _at_least_one(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 1:
        raise ValueError(
            f"Backoff.{attribute.name} must be 1 or more (delays must not shrink), got {value!r}"
        )


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"Backoff.{attribute.name} must be between 0 and 1, got {value!r}")


@attrs.frozen
class Backoff:
    """Exponential backoff with jitter.

    After ``n`` failures the delay is ``min(cap_s, initial_s * factor**n)``, scaled by a random
    factor in ``[1 - jitter, 1]``. A connection that stayed up for ``stable_s`` resets the count.
    """

    initial_s: float = attrs.field(default=0.5, validator=[_finite, _positive])
    factor: float = attrs.field(default=2.0, validator=[_finite, _at_least_one])
    cap_s: float = attrs.field(default=30.0, validator=[_finite, _positive])
    stable_s: float = attrs.field(default=60.0, validator=[_finite, _not_negative])
    jitter: float = attrs.field(default=0.5, validator=[_finite, _fraction])


@attrs.define
class BackoffState:
    """Failures since the last stable connection, and when the current connection was made."""

    failures: int = 0
    connected_at: float | None = None


def next_delay(policy: Backoff, state: BackoffState, rand: float) -> float:
    """Seconds to wait before the next dial; ``rand`` is uniform in ``[0, 1)``."""
    if not 0 <= rand < 1:
        raise ValueError(f"rand must be in [0, 1), got {rand!r}")
    try:
        grown = policy.initial_s * policy.factor**state.failures
    except OverflowError:
        grown = math.inf
    base = min(policy.cap_s, grown)
    return base * (1 - policy.jitter + policy.jitter * rand)


def record_failure(state: BackoffState) -> None:
    """A dial failed."""
    state.failures += 1
    state.connected_at = None


def record_connected(state: BackoffState, connected_at: float) -> None:
    """A dial succeeded at ``connected_at`` (any monotonic clock, in seconds)."""
    state.connected_at = connected_at


def record_disconnect(policy: Backoff, state: BackoffState, now: float) -> None:
    """The connection ended at ``now`` (same clock as `record_connected`).

    A connection that lasted ``stable_s`` or longer starts the backoff afresh; a shorter one
    counts as one more failure, so an agent whose connections keep dropping slows down too.
    """
    connected_at, state.connected_at = state.connected_at, None
    if connected_at is not None and now - connected_at >= policy.stable_s:
        state.failures = 0
    else:
        state.failures += 1
