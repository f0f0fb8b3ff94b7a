"""Tests for wire.backoff: the reconnect policy."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.backoff import (
    Backoff,
    BackoffState,
    next_delay,
    record_connected,
    record_disconnect,
    record_failure,
)

NO_JITTER = Backoff(initial_s=0.5, factor=2.0, cap_s=30.0, jitter=0.0)


def delays_after_failures(policy: Backoff, count: int) -> list[float]:
    state = BackoffState()
    delays = []
    for _ in range(count):
        delays.append(next_delay(policy, state, 0.0))
        record_failure(state)
    return delays


def test_delay_grows_exponentially_up_to_the_cap() -> None:
    assert delays_after_failures(NO_JITTER, 9) == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]


def test_many_failures_stay_at_the_cap() -> None:
    state = BackoffState(failures=100_000)
    assert next_delay(NO_JITTER, state, 0.0) == 30.0


policies = st.builds(
    Backoff,
    initial_s=st.floats(min_value=1e-3, max_value=100),
    factor=st.floats(min_value=1, max_value=10),
    cap_s=st.floats(min_value=1e-3, max_value=3600),
    stable_s=st.floats(min_value=0, max_value=3600),
    jitter=st.floats(min_value=0, max_value=1),
)


@given(
    policy=policies,
    failures=st.integers(min_value=0, max_value=10_000),
    rand=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_jitter_stays_within_bounds(policy: Backoff, failures: int, rand: float) -> None:
    delay = next_delay(policy, BackoffState(failures=failures), rand)
    assert delay <= policy.cap_s
    assert delay >= 0
    base = next_delay(
        Backoff(
            initial_s=policy.initial_s,
            factor=policy.factor,
            cap_s=policy.cap_s,
            jitter=0.0,
        ),
        BackoffState(failures=failures),
        0.0,
    )
    assert base * (1 - policy.jitter) * (1 - 1e-12) <= delay <= base * (1 + 1e-12)


@given(rand=st.floats(min_value=0, max_value=1, exclude_max=True))
def test_jitter_spreads_agents_apart(rand: float) -> None:
    policy = Backoff(initial_s=1.0, jitter=0.5)
    state = BackoffState(failures=3)
    assert 4.0 <= next_delay(policy, state, rand) <= 8.0


def test_stable_connection_resets_the_backoff() -> None:
    policy = Backoff(stable_s=60.0, jitter=0.0)
    state = BackoffState()
    for _ in range(5):
        record_failure(state)
    record_connected(state, connected_at=1000.0)
    record_disconnect(policy, state, now=1060.0)
    assert state.failures == 0
    assert next_delay(policy, state, 0.0) == policy.initial_s


def test_short_connection_keeps_backing_off() -> None:
    policy = Backoff(stable_s=60.0, jitter=0.0)
    state = BackoffState()
    for _ in range(5):
        record_failure(state)
    before = next_delay(policy, state, 0.0)
    record_connected(state, connected_at=1000.0)
    record_disconnect(policy, state, now=1059.0)
    assert state.failures == 6
    assert next_delay(policy, state, 0.0) > before


def test_flapping_connection_slows_down_like_failed_dials() -> None:
    policy = Backoff(stable_s=60.0, jitter=0.0)
    state = BackoffState()
    delays = []
    now = 0.0
    for _ in range(4):
        record_connected(state, connected_at=now)
        now += 1.0
        record_disconnect(policy, state, now=now)
        delays.append(next_delay(policy, state, 0.0))
    assert delays == [1.0, 2.0, 4.0, 8.0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("initial_s", 0.0),
        ("initial_s", -1.0),
        ("cap_s", 0.0),
        ("factor", 0.5),
        ("stable_s", -1.0),
        ("jitter", 1.5),
        ("jitter", -0.1),
        ("cap_s", float("inf")),
        ("initial_s", float("nan")),
    ],
)
def test_invalid_policy_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Backoff.{field}")):
        Backoff(**{field: value})


def test_policy_must_be_numbers() -> None:
    with pytest.raises(TypeError, match=re.escape("Backoff.cap_s")):
        Backoff(cap_s="30")  # type: ignore[arg-type]


def test_rand_outside_unit_interval_is_rejected() -> None:
    with pytest.raises(ValueError, match="rand"):
        next_delay(Backoff(), BackoffState(), 1.0)
