"""`levers9 cluster join` against the Kubernetes stand-in, which enforces RBAC for
ServiceAccount tokens: the joined pool's workers start with exactly the rights the join grants,
the pool is kept (token included) as a Secret in the controlplane's own namespace and comes back
after a restart, a rerun changes nothing it should keep, and `cluster leave` takes it all away.
"""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trustme
from kubernetes import client as k8s

from control.kube.adapter import (
    KubeAuthError,
    KubeError,
    KubeUnavailable,
    KubeUnreachable,
)
from control.kube.join import (
    CLUSTER_RULES,
    NAMESPACE_RULES,
    SERVICE_ACCOUNT,
    TOKEN_SECRET,
    ClusterSide,
    JoinError,
    manifests,
    namespace_refusal,
    open_cluster_side,
    pool_block,
)
from control.kube.manifests import POOL_LABEL as JOB_POOL
from control.kube.pools import load_pools
from sim.cluster import OWN_NAMESPACE, POOL_LABEL, Cluster, PoolSpec, controlplane_pod, open_cluster
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode
from wire.errors import ErrorCode

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.kube_fixtures", "tests.registry_fixtures"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="workers need root (CI runs as root)")

IMAGE = "registry.example.test/levers9/worker:latest"


@pytest.fixture
def in_pod(kube: KubeStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The controlplane runs as if in a pod of the stand-in cluster."""
    directory = tmp_path / "serviceaccount"
    for key, value in controlplane_pod(kube, directory).items():
        monkeypatch.setenv(key, value)
    return directory


def rules_of(obj: dict[str, Any] | None) -> list[dict[str, Any]]:
    assert obj is not None
    return [
        {k: list(v) for k, v in rule.items() if k in ("apiGroups", "resources", "verbs")}
        for rule in obj["rules"]
    ]


def files_containing(root: Path, needle: bytes) -> list[Path]:
    """The files under `root` holding `needle`. The walk runs while the nodes' agents clean up
    after tasks that just ended: a file or directory removed meanwhile holds nothing."""
    found = []
    for folder, _, names in os.walk(root):  # a directory gone under the walk is skipped
        for name in names:
            path = Path(folder, name)
            try:
                if path.is_file() and needle in path.read_bytes():
                    found.append(path)
            except FileNotFoundError:
                continue
    return found


async def join(
    cluster: Cluster,
    kubeconfig: Path,
    *extra: str,
    name: str = "gpus",
    workspace: str = "operator",
    check: bool = True,
) -> Any:
    return await cluster.cli(
        "cluster",
        "join",
        name,
        "--image",
        IMAGE,
        "--kubeconfig",
        str(kubeconfig),
        "--selector",
        f"{POOL_LABEL}=joined",
        *extra,
        workspace=workspace,
        check=check,
    )


async def test_a_joined_cluster_runs_tasks_with_least_rights_and_survives_a_restart(
    tmp_path: Path,
    kube: KubeStandin,
    kubeconfig: Path,
    in_pod: Path,
    registry: SharedRegistry,
) -> None:
    async with open_cluster(
        tmp_path / "cluster",
        kube,
        nodes=[(SimNode("gpu-node-1", 2), "joined")],
        pools=[],
        joined_pools={"inCluster": True},
    ) as cluster:
        done = await join(cluster, kubeconfig, "--json")
        view = json.loads(done.stdout)
        assert view["name"] == "gpus" and view["source"] == "joined"
        assert view["namespace"] == "levers9"
        steps = done.stderr.decode()
        assert "clusterrole levers9-controlplane-levers9: created" in steps
        assert "secret levers9/levers9-controlplane-token: created" in steps

        # Exactly the rights the issue lists, and the pool's token is the ServiceAccount's.
        assert rules_of(kube.get("clusterroles", "levers9-controlplane-levers9")) == [
            dict(r) for r in CLUSTER_RULES
        ]
        assert rules_of(kube.get("roles", "levers9-controlplane", "levers9")) == [
            dict(r) for r in NAMESPACE_RULES
        ]
        token = kube.service_account_token("levers9-controlplane-token", "levers9")
        assert token

        # The controlplane reconciles with that token (the stand-in enforces its RBAC): a
        # worker Job, its agent registered, and a task runs there.
        (worker,) = await cluster.wait_workers(1)
        assert [j["metadata"]["name"] for j in kube.jobs("levers9")] == [worker]
        async with cluster.client() as client:
            from control.models import TaskRequest

            task = await client.create_task(
                TaskRequest(image=registry.busybox, command=("echo", "joined"), cards=1)
            )
            finished = await client.wait_task(task.id)
        assert finished.state == "succeeded", finished

        # Kept as a Secret in the controlplane's namespace; never on the controlplane's disk.
        (kept,) = [
            s for s in kube.secrets(OWN_NAMESPACE) if s["metadata"]["name"] == "levers9-pool-gpus"
        ]
        block = json.dumps(kept["data"])
        assert token not in block  # base64 inside, as Kubernetes keeps Secret data
        assert files_containing(cluster.root, token.encode()) == []

        # A rerun keeps the ServiceAccount and its token and doubles nothing.
        again = await join(cluster, kubeconfig)
        assert "serviceaccount levers9/levers9-controlplane: exists, kept" in again.stderr.decode()
        assert "clusterrole levers9-controlplane-levers9: updated" in again.stderr.decode()
        assert kube.service_account_token("levers9-controlplane-token", "levers9") == token
        assert len(kube.jobs("levers9")) == 1

        # A restarted controlplane reads the pool back and adopts its worker.
        await cluster.restart_controlplane()
        listed = await cluster.cli("cluster", "list", "--json", workspace="operator")
        (pool,) = json.loads(listed.stdout)
        assert pool["name"] == "gpus" and pool["source"] == "joined"
        assert await cluster.wait_workers(1) == [worker]

        # Leaving removes the workers, then the access: the old token no longer works.
        left = await cluster.cli(
            "cluster",
            "leave",
            "gpus",
            "--kubeconfig",
            str(kubeconfig),
            "--delete-namespace",
            workspace="operator",
        )
        assert "clusterrole levers9-controlplane-levers9: deleted" in left.stderr.decode()
        assert kube.jobs("levers9") == []
        assert kube.get("clusterroles", "levers9-controlplane-levers9") is None
        assert not [
            s for s in kube.secrets(OWN_NAMESPACE) if "levers9-pool" in s["metadata"]["name"]
        ]
        listed = await cluster.cli("cluster", "list", "--json", workspace="operator")
        assert json.loads(listed.stdout) == []
        with pytest.raises(k8s.ApiException) as denied:
            k8s.CoreV1Api(kube.api_client(token=token)).list_node()
        assert denied.value.status == 401


@pytest.fixture
async def configured(tmp_path: Path, kube: KubeStandin, in_pod: Path) -> AsyncIterator[Cluster]:
    """A controlplane with one configured pool (`config-pool`, in namespace levers9) that
    keeps joined pools; no nodes."""
    async with open_cluster(
        tmp_path / "cluster",
        kube,
        nodes=[],
        pools=[PoolSpec("config-pool")],
        joined_pools={"inCluster": True},
    ) as cluster:
        yield cluster


async def test_join_refuses_before_touching_the_cluster(
    configured: Cluster, kube: KubeStandin, kubeconfig: Path
) -> None:
    # A workspace token is not an operator token.
    denied = await join(configured, kubeconfig, workspace="team-a", check=False)
    assert denied.returncode == 1
    assert "PERMISSION_DENIED" in denied.stderr.decode()
    # A configured pool's name is not taken over.
    clash = await join(configured, kubeconfig, name="config-pool", check=False)
    assert clash.returncode == 1
    assert "comes from config.worker.pools" in clash.stderr.decode()
    # hostNetwork false needs the tunnel.
    usage = await join(configured, kubeconfig, "--no-host-network", check=False)
    assert usage.returncode == 2
    assert "--no-host-network needs --tunnel" in usage.stderr.decode()
    # (the namespace is the configured pool's; the join made nothing)
    assert kube.get("serviceaccounts", "levers9-controlplane", "levers9") is None
    assert kube.get("clusterroles", "levers9-controlplane-levers9") is None


async def test_leave_keeps_a_namespace_that_configured_pools_share_and_changes_nothing(
    configured: Cluster, kube: KubeStandin, kubeconfig: Path
) -> None:
    await join(configured, kubeconfig)
    leave = ("cluster", "leave", "gpus", "--kubeconfig", str(kubeconfig))
    refused = await configured.cli(*leave, "--delete-namespace", workspace="operator", check=False)
    assert refused.returncode == 1
    said = refused.stderr.decode()
    assert "namespace levers9 is kept" in said
    assert "pools config-pool (config) are set to namespace levers9" in said
    assert "without --delete-namespace" in said
    # Nothing was changed: the pool, the namespace and the joined pool's access are there.
    listed = json.loads(
        (await configured.cli("cluster", "list", "--json", workspace="operator")).stdout
    )
    assert sorted(p["name"] for p in listed) == ["config-pool", "gpus"]
    assert kube.get("namespaces", "levers9") is not None
    assert kube.get("serviceaccounts", SERVICE_ACCOUNT, "levers9") is not None

    left = await configured.cli(*leave, workspace="operator")
    assert f"serviceaccount levers9/{SERVICE_ACCOUNT}: deleted" in left.stderr.decode()
    assert kube.get("namespaces", "levers9") is not None


async def test_join_with_an_identity_that_may_not_create_roles_says_so(
    tmp_path: Path, kube: KubeStandin, in_pod: Path
) -> None:
    # The operator's context is a ServiceAccount that may create namespaces and nothing else.
    meta = {"name": "intern", "namespace": "default"}
    kube.create("serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta})
    kube.create(
        "clusterroles",
        {
            "metadata": {"name": "ns-maker"},
            "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "create"]}],
        },
    )
    kube.create(
        "clusterrolebindings",
        {
            "metadata": {"name": "ns-maker"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "ns-maker",
            },
            "subjects": [{"kind": "ServiceAccount", **meta}],
        },
    )
    kube.create(
        "secrets",
        {
            "type": "kubernetes.io/service-account-token",
            "metadata": {
                "name": "intern-token",
                "namespace": "default",
                "annotations": {"kubernetes.io/service-account.name": "intern"},
            },
        },
    )
    token = kube.service_account_token("intern-token", "default")
    assert token
    limited = kube.write_kubeconfig(tmp_path / "limited-kubeconfig", token=token)
    async with open_cluster(
        tmp_path / "cluster", kube, nodes=[], pools=[], joined_pools={"inCluster": True}
    ) as cluster:
        done = await join(cluster, limited, check=False)
    message = done.stderr.decode()
    assert done.returncode == 1
    assert "is not allowed to (403)" in message
    assert "cluster-admin" in message
    assert token not in message


async def test_a_joined_pool_block_is_refused_with_the_field_named(
    tmp_path: Path, kube: KubeStandin, in_pod: Path
) -> None:
    async with (
        open_cluster(
            tmp_path / "cluster", kube, nodes=[], pools=[], joined_pools={"inCluster": True}
        ) as cluster,
        cluster.client("operator") as client,
    ):
        from wire.errors import ApiError

        block = pool_block(
            name="gpus",
            flavor="generic",
            endpoint="http://plain.example",
            ca_pem=kube.ca_pem,
            token="t0ken-value",
            namespace="levers9",
            selector={},
            tunnel=False,
            host_network=True,
            image=IMAGE,
        )
        with pytest.raises(ApiError) as refused:
            await client.put_pool("gpus", block)
        assert "kubernetes.endpoint" in refused.value.message
        assert "t0ken-value" not in refused.value.message
        assert (await client.pools()).pools == ()
        assert not [
            s for s in kube.secrets(OWN_NAMESPACE) if "levers9-pool" in s["metadata"]["name"]
        ]
        # A second cluster under a joined pool's name would orphan the first one's workers.
        block["kubernetes"]["endpoint"] = kube.url
        await client.put_pool("gpus", block)
        block["kubernetes"]["endpoint"] = "https://other-cluster.example:6443"
        with pytest.raises(ApiError) as taken:
            await client.put_pool("gpus", block)
        assert f"pool gpus is joined from {kube.url}" in taken.value.message
        assert "levers9 cluster leave gpus" in taken.value.message
        (view,) = (await client.pools()).pools
        assert view.endpoint == kube.url


def test_the_join_manifests_grant_only_what_the_controlplane_uses() -> None:
    kinds = [kind for kind, _ in manifests("levers9")]
    assert kinds == [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Secret",
    ]
    rules = [r for _, m in manifests("levers9") for r in m.get("rules", ())]
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    cluster_resources = {res for r in CLUSTER_RULES for res in r["resources"]}
    assert cluster_resources == {"nodes", "pods"}
    # Events on the worker Jobs: written and counted on; listed only to find the Job
    # controller's FailedCreate (pods the cluster refuses), never watched.
    events = {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "list", "patch"]}
    assert events in rules


def test_a_joined_block_loads_as_a_configured_one() -> None:
    block = pool_block(
        name="gpus",
        flavor="gke",
        endpoint="https://34.0.0.10",
        ca_pem=trustme.CA().cert_pem.bytes(),
        token="sa-token",
        namespace="levers9",
        selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        tunnel=True,
        host_network=False,
        image=IMAGE,
    )
    (pool,) = load_pools([block]).pools
    assert pool.kubernetes.tunnel and not pool.kubernetes.host_network
    assert "sa-token" not in repr(pool)
    assert base64.b64decode(block["kubernetes"]["caData"]).startswith(b"-----BEGIN")


async def test_a_file_that_is_not_a_kubeconfig_is_named(tmp_path: Path) -> None:
    for text in ("just some text\n", "- a\n- list\n", "{unclosed: [\n"):
        path = tmp_path / "not-a-kubeconfig"
        path.write_text(text)
        with pytest.raises(JoinError) as refused:
            async with open_cluster_side(str(path), None):
                pass
        assert str(refused.value) == (
            f"{path} is not a kubeconfig (clusters, users, contexts); point --kubeconfig at one"
        )
    missing = tmp_path / "missing"
    with pytest.raises(JoinError, match=f"cannot use {missing}: .*point --kubeconfig at a"):
        async with open_cluster_side(str(missing), None):
            pass
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: here, context: {cluster: c, user: u}}]\ncurrent-context: here\n"
    )
    with pytest.raises(
        JoinError, match=r"no context 'elsewhere'; pick one with --context \(here\)"
    ):
        async with open_cluster_side(str(kubeconfig), "elsewhere"):
            pass


async def test_a_rerun_keeps_what_it_should_and_leave_twice_finds_it_gone(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    async with open_cluster_side(str(kubeconfig), None) as side:
        first = await side.apply("team")
        again = await side.apply("team")
        assert first.token == kube.service_account_token(TOKEN_SECRET, "team")
        assert again.token == first.token
        assert first.endpoint == kube.url and first.ca_pem == kube.ca_pem
        assert first.token not in repr(first)
        assert again.steps == (
            "namespace team: exists, kept",
            f"serviceaccount team/{SERVICE_ACCOUNT}: exists, kept",
            "clusterrole levers9-controlplane-team: updated",
            "clusterrolebinding levers9-controlplane-team: updated",
            f"role team/{SERVICE_ACCOUNT}: updated",
            f"rolebinding team/{SERVICE_ACCOUNT}: updated",
            f"secret team/{TOKEN_SECRET}: exists, kept",
        )
        left = await side.remove("team", delete_namespace=False)
        assert left[-1] == f"serviceaccount team/{SERVICE_ACCOUNT}: deleted"
        gone = await side.remove("team", delete_namespace=False)
        assert all(step.endswith(": already gone") for step in gone), gone
    assert kube.get("namespaces", "team") is not None  # kept without --delete-namespace


async def test_only_a_namespace_the_join_made_for_the_pool_and_holding_only_its_jobs_goes(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.add_namespace("shared")
    async with open_cluster_side(str(kubeconfig), None) as side:
        assert (await side.apply("team", "a")).steps[0] == "namespace team: created"
        assert (await side.apply("team", "b")).steps[0] == "namespace team: exists, kept"
        assert (await side.apply("shared", "a")).steps[0] == "namespace shared: exists, kept"
        job = {"metadata": {"name": "w-b-1", "namespace": "team", "labels": {JOB_POOL: "b"}}}
        kube.create("jobs", {**job, "spec": {"template": {"spec": {"containers": []}}}})

        with pytest.raises(JoinError) as refused:
            await side.check_namespace_removal("team", "b", ["a (joined)"])
        assert str(refused.value) == (
            "namespace team is kept: cluster join did not create it for pool b (it was created "
            "for pool a); pools a (joined) are set to namespace team. Nothing was changed: run "
            "`levers9 cluster leave b` without --delete-namespace"
        )
        with pytest.raises(JoinError, match=r"it holds Jobs that are not pool a's: w-b-1\."):
            await side.check_namespace_removal("team", "a", [])
        with pytest.raises(JoinError, match=r"^namespace shared is kept: cluster join did not "):
            await side.check_namespace_removal("shared", "a", [])

        k8s.BatchV1Api(kube.api_client()).delete_namespaced_job("w-b-1", "team")
        await side.check_namespace_removal("team", "a", [])
        await side.check_namespace_removal("gone", "a", [])  # nothing to keep
        # While another joined pool uses the namespace's ServiceAccount, leaving keeps it.
        kept = await side.remove("team", delete_namespace=False, shared_with=["b"])
        assert kept == [
            f"serviceaccount team/{SERVICE_ACCOUNT} and its roles: kept, joined pool b uses them"
        ]
        assert kube.get("serviceaccounts", SERVICE_ACCOUNT, "team") is not None
        assert "namespace team: deleted" in await side.remove("team", delete_namespace=True)


def test_a_namespace_refusal_names_at_most_a_few_jobs() -> None:
    found = {"metadata": {"name": "ns", "annotations": {"levers9.dev/created-for-pool": "p"}}}
    jobs = [{"metadata": {"name": f"j{i}"}} for i in range(8)]
    said = namespace_refusal("ns", "p", found, [], jobs)
    assert said is not None and "j0, j1, j2, j3, j4 and 3 more." in said
    own = [{"metadata": {"name": "w", "labels": {JOB_POOL: "p"}}}]
    assert namespace_refusal("ns", "p", found, [], own) is None


async def test_an_api_that_cannot_be_reached_or_trusted_says_so(
    tmp_path: Path, kube: KubeStandin
) -> None:
    # A loopback port nobody listens on: refused at once, nothing leaves the host.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    closed = _kubeconfig(tmp_path / "closed", f"https://127.0.0.1:{port}", kube.ca_pem)
    with pytest.raises(JoinError) as refused:
        async with open_cluster_side(str(closed), None) as side:
            await side.apply("levers9")
    message = str(refused.value)
    assert message.startswith("cannot read namespace levers9: ")
    assert f"https://127.0.0.1:{port} cannot be reached" in message
    assert "check kubeconfig context 'c'" in message

    other_ca = trustme.CA().cert_pem.bytes()
    untrusted = _kubeconfig(tmp_path / "untrusted", kube.url, other_ca)
    with pytest.raises(JoinError, match="cannot be reached \\(TLS verification failed\\)"):
        async with open_cluster_side(str(untrusted), None) as side:
            await side.apply("levers9")


def _kubeconfig(path: Path, server: str, ca_pem: bytes) -> Path:
    ca = base64.b64encode(ca_pem).decode()
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}', "
        f"certificate-authority-data: {ca}}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n"
    )
    return path


class _Failing:
    """The adapter's seam, answering every read with one error."""

    def __init__(self, error: KubeError) -> None:
        self.error = error

    async def read_object(
        self, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        raise self.error

    async def create_object(
        self, manifest: Mapping[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any]:
        raise self.error

    async def replace_object(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        raise self.error

    async def delete_object(self, kind: str, name: str, namespace: str | None = None) -> bool:
        raise self.error

    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        raise self.error

    async def wait_secret_value(self, namespace: str, name: str, key: str) -> str:
        raise self.error

    async def list_jobs(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        raise self.error


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (
            KubeAuthError(ErrorCode.UNAUTHENTICATED, "x", status=401),
            "cannot read namespace levers9: the cluster did not accept the credentials of "
            "kubeconfig context 'ctx' (401); log in again",
        ),
        (
            KubeAuthError(ErrorCode.PERMISSION_DENIED, "x", status=403),
            "cannot read namespace levers9: kubeconfig context 'ctx' is not allowed to (403); "
            "cluster join needs an identity that may create namespaces, ServiceAccounts, "
            "Secrets and RBAC roles and bindings (cluster-admin)",
        ),
        (
            KubeUnavailable("x", status=503),
            "cannot read namespace levers9: the cluster answered 503 Service Unavailable",
        ),
        (
            KubeError(ErrorCode.INVALID_ARGUMENT, "x", status=422),
            "cannot read namespace levers9: the cluster answered 422 Unprocessable",
        ),
        (
            KubeUnreachable("x", failure="MaxRetryError"),
            "cannot read namespace levers9: the cluster's API at https://api.example:6443 "
            "cannot be reached (MaxRetryError); check kubeconfig context 'ctx'",
        ),
    ],
)
async def test_the_adapters_errors_are_worded_for_the_operator(error: KubeError, says: str) -> None:
    side = ClusterSide(
        _Failing(error), endpoint="https://api.example:6443", ca_pem=b"", context="ctx"
    )
    with pytest.raises(JoinError) as refused:
        await side.apply("levers9")
    assert str(refused.value).startswith(says)
    with pytest.raises(JoinError, match=r"^cannot delete clusterrolebinding "):
        await side.remove("levers9", delete_namespace=True)
