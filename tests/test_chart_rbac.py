"""The chart's RBAC is enough, applied to a cluster that enforces it: the Kubernetes stand-in
checks every request of a ServiceAccount token against Roles and bindings as the apiserver
does. The controlplane runs with the ServiceAccount the chart renders and only the roles it
renders, reconciles a pool of its own cluster (`inCluster: true`) and keeps joined pools in its
namespace; a task runs on the worker it started."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from control.models import TaskRequest
from sim.cluster import PoolSpec, open_cluster, pod_environment
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode
from tests.registry_fixtures import SharedRegistry
from tests.test_chart import NAMESPACE, in_cluster_pool, of_kind, public_values, render

pytest_plugins = ["tests.kube_fixtures", "tests.registry_fixtures"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="workers need root (CI runs as root)")

PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Role": "roles",
    "RoleBinding": "rolebindings",
}


def apply_chart_rbac(kube: KubeStandin, docs: list[Any]) -> str:
    """Create what the chart renders for access (as `helm install` would); the
    ServiceAccount's name."""
    kube.add_namespace(NAMESPACE)
    for kind, plural in PLURALS.items():
        for doc in of_kind(docs, kind):
            if kind in ("ServiceAccount", "Role", "RoleBinding"):
                doc["metadata"].setdefault("namespace", NAMESPACE)
            kube.create(plural, doc)
    (account,) = of_kind(docs, "ServiceAccount")
    return str(account["metadata"]["name"])


async def test_the_chart_rbac_runs_an_in_cluster_pool_and_keeps_joined_pools(
    tmp_path: Path,
    kube: KubeStandin,
    registry: SharedRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = render(tmp_path, public_values(in_cluster_pool("local", namespace="levers9")))
    kinds = {doc["kind"] for doc in docs}
    assert {"ClusterRole", "Role", "RoleBinding", "ClusterRoleBinding"} <= kinds
    kube.add_namespace("levers9")  # worker namespaces exist before the install
    account = apply_chart_rbac(kube, docs)
    env = pod_environment(kube, NAMESPACE, account, tmp_path / "serviceaccount")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    async with open_cluster(
        tmp_path / "cluster",
        kube,
        nodes=[(SimNode("gpu-node-1", 1), "local")],
        pools=[PoolSpec("local", in_cluster=True)],
        joined_pools={"inCluster": True},
    ) as cluster:
        with trio.fail_after(60):
            (worker,) = await cluster.wait_workers(1)
        assert [j["metadata"]["name"] for j in kube.jobs("levers9")] == [worker]
        assert cluster.control is not None and cluster.control.joined is not None
        async with cluster.client() as client:
            task = await client.create_task(
                TaskRequest(image=registry.busybox, command=("echo", "in-cluster"), cards=1)
            )
            with trio.fail_after(60):
                done = await client.wait_task(task.id)
        assert done.state == "succeeded", done
        async with cluster.client("operator") as client:
            (view,) = (await client.pools()).pools
        assert view.name == "local" and view.error is None
    # The ServiceAccount cannot do more than it needs: no secrets outside its namespaces.
    assert not kube.authorized(env_token(env), "list", "secrets", "default")
    assert kube.authorized(env_token(env), "create", "jobs", "levers9", group="batch")


def env_token(env: dict[str, str]) -> str:
    return (Path(env["LEVERS9_SERVICEACCOUNT_DIR"]) / "token").read_text()
