"""Controller expectations (pure): a write is remembered per node until the caches show it,
or until it lapses, and the node is held meanwhile."""

from __future__ import annotations

from control.kube.expectations import Expectation, Expectations, Expecting


def test_a_created_job_holds_its_node_until_the_cache_shows_it() -> None:
    expectations = Expectations(timeout_s=300)
    expectations.expect(Expectation("n1", Expecting.JOB_CREATED, "job-1", 10.0, generation=1))
    assert set(expectations.unsettled()) == {"n1"}
    assert [e.name for e in expectations.created_jobs()] == ["job-1"]
    assert expectations.observe(set(), set(), set()) == []
    assert set(expectations.unsettled()) == {"n1"}
    (settled,) = expectations.observe({"job-1"}, {"job-1"}, set())
    assert settled.name == "job-1"
    assert expectations.unsettled() == {}
    assert expectations.created_jobs() == []


def test_a_job_and_its_secret_both_must_be_seen() -> None:
    expectations = Expectations()
    expectations.expect(Expectation("n1", Expecting.JOB_CREATED, "job-1", 0.0))
    expectations.expect(Expectation("n1", Expecting.SECRET_CREATED, "job-1-token", 0.0))
    expectations.observe({"job-1"}, {"job-1"}, set())
    assert expectations.unsettled()["n1"].kind is Expecting.SECRET_CREATED
    expectations.observe({"job-1"}, {"job-1"}, {"job-1-token"})
    assert expectations.unsettled() == {}


def test_a_deleted_job_is_seen_once_gone_or_no_longer_active() -> None:
    expectations = Expectations()
    expectations.expect(Expectation("n1", Expecting.JOB_DELETED, "job-1", 0.0))
    expectations.expect(Expectation("n2", Expecting.JOB_DELETED, "job-2", 0.0))
    # job-1 is still active in the cache; job-2 shows with a deletionTimestamp (inactive).
    expectations.observe({"job-1"}, {"job-1", "job-2"}, set())
    assert set(expectations.unsettled()) == {"n1"}
    expectations.observe(set(), set(), set())
    assert expectations.unsettled() == {}


def test_an_expectation_never_seen_lapses_after_the_timeout() -> None:
    expectations = Expectations(timeout_s=300)
    expectations.expect(Expectation("n1", Expecting.JOB_CREATED, "job-1", 100.0))
    expectations.expect(Expectation("n2", Expecting.JOB_CREATED, "job-2", 250.0))
    assert expectations.lapse(399.0) == []
    assert [e.name for e in expectations.lapse(400.0)] == ["job-1"]
    assert set(expectations.unsettled()) == {"n2"}


def test_a_failed_write_is_forgotten() -> None:
    expectations = Expectations()
    expectations.expect(Expectation("n1", Expecting.JOB_CREATED, "job-1", 0.0))
    expectations.forget(Expecting.JOB_CREATED, "job-1")
    assert expectations.unsettled() == {}
    assert len(expectations) == 0
