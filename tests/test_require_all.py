"""LEVERS9_REQUIRE_ALL=1 (CI) turns every skip into a failure naming what is missing, except for
the GPU-only tests; without it a skip is a skip. Checked on a small generated suite run by a
pytest of its own, with the suite's hooks (`tests/conftest.py`) loaded as a plugin."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REQUIRE_ALL_VARIABLE, require_all

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]

SUITE = """
import pytest

@pytest.mark.skipif(True, reason="needs the frobnicator")
def test_marked():
    pass

def test_called():
    pytest.skip("no /dev/frob on this machine")

@pytest.fixture
def frob():
    pytest.skip("the frob fixture found no frob")

def test_fixture(frob):
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="no GPU here")
def test_gpu():
    pass

@pytest.mark.xfail(reason="known to fail")
def test_expected_failure():
    assert False

def test_runs():
    pass
"""

MODULE_SKIP = """
import pytest

pytest.importorskip("levers9_no_such_module")

def test_never():
    pass
"""


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str | None) -> str:
    if value is None:
        monkeypatch.delenv(REQUIRE_ALL_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_ALL_VARIABLE, value)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeini("[pytest]\nmarkers =\n    gpu: a GPU-only test\n")
    result = pytester.runpytest_subprocess("-p", "tests.conftest", "-p", "no:randomly", "-rA")
    return str(result.stdout)


def test_without_the_variable_a_skip_is_a_skip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_suite=SUITE, test_module_skip=MODULE_SKIP)
    out = run(pytester, monkeypatch, None)
    assert "1 passed, 5 skipped, 1 xfailed" in out, out


def test_with_the_variable_every_skip_but_a_gpu_one_fails_naming_why(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_suite=SUITE)
    out = run(pytester, monkeypatch, "1")
    # A skipif mark and a fixture's skip fail in setup (errors), a test's own skip in the call.
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 2 errors" in out, out
    for outcome, test, reason in (
        ("ERROR", "test_marked", "needs the frobnicator"),
        ("FAILED", "test_called", "no /dev/frob on this machine"),
        ("ERROR", "test_fixture", "the frob fixture found no frob"),
    ):
        assert f"{outcome} test_suite.py::{test} - skipped" in out, out
        assert f"{REQUIRE_ALL_VARIABLE}=1 makes a skip a failure: {reason}." in out, out
    assert "SKIPPED [1] test_suite.py:17: no GPU here" in out, out


def test_with_the_variable_a_module_skipped_on_import_stops_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_module_skip=MODULE_SKIP)
    out = run(pytester, monkeypatch, "1")
    assert "1 error" in out, out
    assert "could not import 'levers9_no_such_module'" in out, out
    assert f"{REQUIRE_ALL_VARIABLE}=1 makes a skip a failure" in out, out


def test_only_a_clear_yes_turns_it_on() -> None:
    assert require_all({REQUIRE_ALL_VARIABLE: "1"})
    assert require_all({REQUIRE_ALL_VARIABLE: "yes"})
    assert not require_all({REQUIRE_ALL_VARIABLE: "0"})
    assert not require_all({REQUIRE_ALL_VARIABLE: ""})
    assert not require_all({})
