"""The token bucket the Kubernetes client and the event recorder keep to."""

from __future__ import annotations

import pytest

from control.kube.ratelimit import TokenBucket


def test_a_full_bucket_lets_a_burst_through_then_spaces_requests_by_the_rate() -> None:
    bucket = TokenBucket(rate=10.0, burst=3)
    assert [bucket.reserve(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve(0.0) == pytest.approx(0.1)
    assert bucket.reserve(0.0) == pytest.approx(0.2)
    # After the wait it reserved, the first borrower goes; the bucket refills no further.
    assert bucket.reserve(1.0) == 0.0


def test_try_take_drops_beyond_the_burst_and_refills_with_time() -> None:
    bucket = TokenBucket(rate=0.2, burst=2)
    assert [bucket.try_take(100.0) for _ in range(3)] == [True, True, False]
    assert not bucket.try_take(102.0)
    assert bucket.try_take(105.0)
    assert not bucket.try_take(105.0)
    # Never more than the burst, however long it waited.
    assert [bucket.try_take(10_000.0) for _ in range(3)] == [True, True, False]


def test_a_clock_going_back_takes_no_tokens_away() -> None:
    bucket = TokenBucket(rate=1.0, burst=1)
    assert bucket.try_take(50.0)
    assert not bucket.try_take(40.0)
    assert bucket.try_take(51.0)


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (-1.0, 1), (float("inf"), 1), (1.0, 0)])
def test_bad_budgets_are_refused(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match=r"rate|burst"):
        TokenBucket(rate=rate, burst=burst)
