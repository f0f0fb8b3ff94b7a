"""The real `kubectl` run against the Kubernetes API stand-in, for the tests that check the
stand-in speaks to it as a cluster would: one helper, so every such test runs it the same way
(a kubeconfig, a bound, its error output in the assertion)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    """`kubectl --kubeconfig KUBECONFIG ARGS`'s output; a failure fails the test with its
    stderr."""
    done = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
