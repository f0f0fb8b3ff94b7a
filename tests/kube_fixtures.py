"""Pytest fixtures: a Kubernetes API stand-in (`sim.kubeapi`) over TLS on loopback.

Load them with `pytest_plugins = ["tests.kube_fixtures"]`. `kube` is a fresh, empty cluster per
test (namespaces default, kube-system, kube-public, kube-node-lease; no nodes), so tests can
count requests and arm faults without seeing each other's; it is stopped after the test, which
also fails if a `on_job_created` hook raised. `kubeconfig` is a kubeconfig file for it with the
admin token. Test modules import the builders (`make_node`, `make_pod`) from
`sim.kubeapi`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.kubeapi.http import start_kube_standin
from sim.kubeapi.store import KubeStandin


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeStandin]:
    running = start_kube_standin(tmp_path / "kube")
    try:
        yield running.kube
    finally:
        running.stop()
    assert not running.kube.hook_errors, f"job hooks raised: {running.kube.hook_errors!r}"


@pytest.fixture
def kubeconfig(kube: KubeStandin, tmp_path: Path) -> Path:
    return kube.write_kubeconfig(tmp_path / "kubeconfig")
