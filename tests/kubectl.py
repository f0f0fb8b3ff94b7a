"""The real `kubectl` run against the Kubernetes API stand-in, for the tests that check the
stand-in speaks to it as a cluster would: one helper, so every such test runs it the same way
(a kubeconfig, a bound, its error output in the assertion).

kubectl is required, never a reason to skip: `make deps` checks that it is on PATH, and a test
that needs it and finds none fails saying so (`kubectl_binary`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def kubectl_binary() -> str:
    """kubectl's path; fails the test, naming the fix, where it is not on PATH."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl is not on PATH: the tests drive the Kubernetes API stand-in with it "
            "(make deps checks for it; this kind of machine ships kubectl 1.32)",
            pytrace=False,
        )
    return found


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    """`kubectl --kubeconfig KUBECONFIG ARGS`'s output; a failure fails the test with its
    stderr."""
    done = subprocess.run(
        [kubectl_binary(), "--kubeconfig", str(kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
