"""The chart's RBAC is enough, applied to a cluster that enforces it: the Kubernetes stand-in
checks every request of a ServiceAccount token against Roles and bindings as the apiserver
does. The controlplane runs with the ServiceAccount the chart renders and only the roles it
renders, reconciles a pool of its own cluster (`inCluster: true`) and keeps joined pools in its
namespace; a task runs on the worker it started."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from control.kube.adapter import open_kube_client
from control.kube.lease import LeaderElector, election_settings, lease_cluster
from control.models import TaskRequest
from sim.cluster import PoolSpec, open_cluster, pod_environment
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode
from tests.test_chart import (
    NAMESPACE,
    in_cluster_pool,
    load_rendered,
    of_kind,
    public_values,
    render,
)

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import SharedRegistry

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
        assert cluster.control is not None and cluster.control.runner.joined is not None
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


async def test_the_chart_rbac_lets_replicas_hold_a_pools_lease_and_no_more(
    tmp_path: Path, kube: KubeStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = public_values(in_cluster_pool("local", namespace="levers9"))
    values["leaderElection"] = {"enabled": True}
    docs = render(tmp_path, values)
    kube.add_namespace("levers9")
    account = apply_chart_rbac(kube, docs)
    env = pod_environment(kube, NAMESPACE, account, tmp_path / "serviceaccount")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = load_rendered(tmp_path, docs)
    own, namespace = lease_cluster(config.leader_election, pool="local")
    assert namespace == NAMESPACE
    leading = trio.Event()

    async def lead() -> None:
        leading.set()
        await trio.sleep_forever()

    async with open_kube_client(own) as api, trio.open_nursery() as nursery:
        settings = election_settings(
            config.leader_election, pool="local", identity="replica-a", namespace=namespace
        )
        elector = LeaderElector(api, settings, pool="local")
        nursery.start_soon(elector.run, lead)
        with trio.fail_after(20):
            await leading.wait()
        nursery.cancel_scope.cancel()
    lease = kube.get("leases", "levers9-pool-local", NAMESPACE)
    assert lease is not None and lease["spec"]["holderIdentity"] == ""  # taken, then released
    token = env_token(env)
    group = "coordination.k8s.io"
    assert not kube.authorized(token, "delete", "leases", NAMESPACE, group)
    assert not kube.authorized(token, "list", "leases", NAMESPACE, group)
    assert not kube.authorized(token, "create", "leases", "levers9", group)
