"""What the whole suite shares: with LEVERS9_REQUIRE_ALL=1 (set by `.ci/run`), a test that would
be skipped fails instead, with the skip's own reason.

Why: many integration tests skip on a machine that lacks what they drive (root, /dev/fuse,
rclone, runc, sshd, the NVML stand-in, PostgreSQL). On a developer's laptop a skip saying why is
a kindness; in CI it is green, so a lost install step or a broken machine would pass unseen. CI
sets the variable, and every skip there, whether a `skipif` mark, a `pytest.skip()` in a test or
a fixture, or a module's `importorskip`, becomes a failure naming what is missing. The tests
marked `gpu` are the exception: CI's machines have no GPU, and `make gpu-check` runs them where
one is. An expected failure (`xfail`) is not a skip and stays as it is.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping

import pytest

REQUIRE_ALL_VARIABLE = "LEVERS9_REQUIRE_ALL"


def require_all(environ: Mapping[str, str]) -> bool:
    """Whether skips are failures: the variable set to 1 (or true/yes)."""
    return environ.get(REQUIRE_ALL_VARIABLE, "").strip().lower() in ("1", "true", "yes")


def _skip_reason(longrepr: object) -> str:
    # A skip's report carries (path, line, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _as_failure(report: pytest.TestReport | pytest.CollectReport) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"skipped, and {REQUIRE_ALL_VARIABLE}=1 makes a skip a failure: "
        f"{_skip_reason(report.longrepr)}. Install what is missing (make deps, make install; "
        f"root for the tests that need it) or unset {REQUIRE_ALL_VARIABLE} to let it skip."
    )


def _turns_to_failure(
    report: pytest.TestReport | pytest.CollectReport, node: pytest.Item | pytest.Collector
) -> bool:
    return (
        report.skipped
        and not hasattr(report, "wasxfail")
        and node.get_closest_marker("gpu") is None
        and require_all(os.environ)
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A skip in setup (a `skipif` mark, a fixture's `pytest.skip`) or in the test itself."""
    report = yield
    if _turns_to_failure(report, item):
        _as_failure(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A module skipped while it is imported (`importorskip`, `pytest.skip(...,
    allow_module_level=True)`): a collection error, which stops the run naming it."""
    report = yield
    if _turns_to_failure(report, collector):
        _as_failure(report)
    return report
