"""ServiceAccounts, their tokens and RBAC in the Kubernetes stand-in, through the official client
and kubectl: `levers9 cluster join` hands the controlplane a ServiceAccount token, so the
stand-in must grant that token exactly what the Roles bind to it and refuse the rest as a real
apiserver does."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from sim.kubeapi.model import RBAC
from sim.kubeapi.objects import make_node, make_pod
from sim.kubeapi.store import KubeStandin
from tests.kubectl import kubectl_binary

pytest_plugins = ["tests.kube_fixtures"]

SA_USER = "system:serviceaccount:levers9:controlplane"


def _rule(resources: Sequence[str], verbs: Sequence[str], groups: Sequence[str] = ("",)) -> Any:
    return {"apiGroups": list(groups), "resources": list(resources), "verbs": list(verbs)}


def _role(name: str, *rules: Any, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app": "levers9"}}
    if namespace is not None:
        meta["namespace"] = namespace
    return {"metadata": meta, "rules": list(rules)}


def _binding(name: str, kind: str, role: str, sa: str = "controlplane") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": "levers9"}},
        "roleRef": {"apiGroup": RBAC, "kind": kind, "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": "levers9"}],
    }


def _job(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "worker", "image": "worker:latest"}],
                }
            }
        },
    }


def _token_secret(name: str, sa: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": {"kubernetes.io/service-account.name": sa}},
        "type": "kubernetes.io/service-account-token",
    }


def _join(kube: KubeStandin) -> str:
    """What `cluster join` does first: namespace, ServiceAccount and its token; no grants yet."""
    kube.add_namespace("levers9")
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_service_account("levers9", {"metadata": {"name": "controlplane"}})
        core.create_namespaced_secret(
            "levers9", _token_secret("controlplane-token", "controlplane")
        )
    token = kube.service_account_token("controlplane-token", "levers9")
    assert token is not None
    return token


def _log(core: Any, name: str, namespace: str) -> str:
    # kubernetes 36's client hands back a str response as the repr of its bytes
    # (kubernetes-client/python#2596); the raw response is what a caller should read.
    response = core.read_namespaced_pod_log(name, namespace, _preload_content=False)
    return str(response.data.decode())


def _refusal(exc: pytest.ExceptionInfo[ApiException]) -> str:
    assert exc.value.status == 403
    body = json.loads(exc.value.body)
    assert body["reason"] == "Forbidden"
    return str(body["message"])


def test_rbac_kinds_and_serviceaccounts_crud(kube: KubeStandin) -> None:
    kube.add_namespace("levers9")
    with kube.api_client() as api:
        core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
        sa = core.create_namespaced_service_account(
            "levers9", {"metadata": {"name": "controlplane", "labels": {"app": "levers9"}}}
        )
        assert sa.metadata.uid and sa.kind == "ServiceAccount"
        core.create_namespaced_service_account("levers9", {"metadata": {"name": "other"}})
        picked = core.list_namespaced_service_account("levers9", label_selector="app=levers9")
        assert [s.metadata.name for s in picked.items] == ["controlplane"]
        with pytest.raises(ApiException) as taken:
            core.create_namespaced_service_account("levers9", {"metadata": {"name": "other"}})
        assert taken.value.status == 409

        role = rbac.create_cluster_role(_role("levers9-nodes", _rule(["nodes"], ["list"])))
        assert role.rules[0].resources == ["nodes"]
        rbac.create_cluster_role_binding(_binding("levers9-nodes", "ClusterRole", "levers9-nodes"))
        rbac.create_namespaced_role(
            "levers9", _role("levers9-jobs", _rule(["jobs"], ["create"], ["batch"]))
        )
        rbac.create_namespaced_role_binding(
            "levers9", _binding("levers9-jobs", "Role", "levers9-jobs")
        )
        assert [r.metadata.name for r in rbac.list_cluster_role(label_selector="app").items] == [
            "levers9-nodes"
        ]
        assert rbac.read_namespaced_role_binding("levers9-jobs", "levers9").role_ref.kind == "Role"
        assert rbac.read_cluster_role_binding("levers9-nodes").subjects[0].namespace == "levers9"
        assert [b.metadata.name for b in rbac.list_namespaced_role_binding("levers9").items] == [
            "levers9-jobs"
        ]

        patched = rbac.patch_namespaced_role(
            "levers9-jobs", "levers9", {"rules": [_rule(["jobs"], ["create", "get"], ["batch"])]}
        )
        assert patched.rules[0].verbs == ["create", "get"]
        current = rbac.read_cluster_role("levers9-nodes")
        current.rules[0].verbs = ["list", "get"]
        assert rbac.replace_cluster_role("levers9-nodes", current).rules[0].verbs == ["list", "get"]
        # A binding's roleRef cannot change; join must delete and re-create it.
        with pytest.raises(ApiException) as immutable:
            rbac.patch_cluster_role_binding(
                "levers9-nodes", {"roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": "x"}}
            )
        assert immutable.value.status == 422
        assert "cannot change roleRef" in json.loads(immutable.value.body)["message"]

        rbac.delete_namespaced_role_binding("levers9-jobs", "levers9")
        rbac.delete_cluster_role_binding("levers9-nodes")
        rbac.delete_namespaced_role("levers9-jobs", "levers9")
        rbac.delete_cluster_role("levers9-nodes")
        core.delete_namespaced_service_account("controlplane", "levers9")
        with pytest.raises(ApiException) as gone:
            rbac.read_cluster_role("levers9-nodes")
        assert gone.value.status == 404
        body = json.loads(gone.value.body)
        assert body["message"] == f'clusterroles.{RBAC} "levers9-nodes" not found'
        assert rbac.list_namespaced_role("levers9").items == []
        assert [s.metadata.name for s in core.list_namespaced_service_account("levers9").items] == [
            "other"
        ]


def test_token_secret_is_filled_in_and_needs_its_serviceaccount(kube: KubeStandin) -> None:
    kube.add_namespace("levers9")
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        sa = core.create_namespaced_service_account("levers9", {"metadata": {"name": "cp"}})
        core.create_namespaced_secret("levers9", _token_secret("cp-token", "cp"))
        secret = core.read_namespaced_secret("cp-token", "levers9")
        assert secret.type == "kubernetes.io/service-account-token"
        assert secret.metadata.annotations["kubernetes.io/service-account.uid"] == sa.metadata.uid
        assert base64.b64decode(secret.data["ca.crt"]) == kube.ca_pem
        assert base64.b64decode(secret.data["namespace"]) == b"levers9"
        token = base64.b64decode(secret.data["token"]).decode()
        assert len(token) >= 32
        assert kube.who_am_i(token) == "system:serviceaccount:levers9:cp"

        # A second token for the same account is another, equally valid token.
        core.create_namespaced_secret("levers9", _token_secret("cp-token-2", "cp"))
        second = kube.service_account_token("cp-token-2", "levers9")
        assert second is not None and second != token
        assert kube.who_am_i(second) == "system:serviceaccount:levers9:cp"

        # The token controller deletes a token Secret whose ServiceAccount does not exist.
        core.create_namespaced_secret("levers9", _token_secret("orphan-token", "nobody"))
        with pytest.raises(ApiException) as orphan:
            core.read_namespaced_secret("orphan-token", "levers9")
        assert orphan.value.status == 404
        assert sorted(s["metadata"]["name"] for s in kube.secrets("levers9")) == [
            "cp-token",
            "cp-token-2",
        ]


def test_token_is_forbidden_until_a_cluster_role_grants_listing_nodes(kube: KubeStandin) -> None:
    kube.add_node(make_node("gpu-1"))
    kube.add_namespace("other")
    token = _join(kube)
    with kube.api_client(token=token) as api:
        core = client.CoreV1Api(api)
        with pytest.raises(ApiException) as nodes:
            core.list_node()
        assert _refusal(nodes) == (
            f'nodes is forbidden: User "{SA_USER}" cannot list resource "nodes" in API group "" '
            "at the cluster scope"
        )
        with pytest.raises(ApiException) as node:
            core.read_node("gpu-1")
        assert _refusal(node).startswith(f'nodes "gpu-1" is forbidden: User "{SA_USER}"')
        with pytest.raises(ApiException) as own:
            core.list_namespaced_secret("levers9")
        assert 'in the namespace "levers9"' in _refusal(own)
        assert kube.authorized(token, "list", "nodes") is False

        with kube.api_client() as admin:
            rbac = client.RbacAuthorizationV1Api(admin)
            rbac.create_cluster_role(_role("levers9-nodes", _rule(["nodes"], ["list"])))
            rbac.create_cluster_role_binding(
                _binding("levers9-nodes", "ClusterRole", "levers9-nodes")
            )

        assert [n.metadata.name for n in core.list_node().items] == ["gpu-1"]
        assert kube.authorized(token, "list", "nodes") is True
        # Only the verb granted: reading one node is still refused.
        with pytest.raises(ApiException) as read:
            core.read_node("gpu-1")
        assert _refusal(read)
        with pytest.raises(ApiException) as elsewhere:
            core.list_namespaced_secret("other")
        assert _refusal(elsewhere) == (
            f'secrets is forbidden: User "{SA_USER}" cannot list resource "secrets" in API group '
            '"" in the namespace "other"'
        )
        assert json.loads(elsewhere.value.body)["details"] == {"kind": "secrets"}
    # Discovery is open to any authenticated token.
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(verify=kube.ssl_context(), headers=headers) as http:
        for path in ("/api", "/apis", "/version", f"/apis/{RBAC}/v1"):
            assert http.get(f"{kube.url}{path}").status_code == 200


def test_role_binding_grants_jobs_create_in_its_namespace_only(kube: KubeStandin) -> None:
    token = _join(kube)
    kube.add_namespace("elsewhere")
    with kube.api_client() as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_namespaced_role(
            "levers9", _role("jobs", _rule(["jobs"], ["create", "get"], ["batch"]))
        )
        rbac.create_namespaced_role_binding("levers9", _binding("jobs", "Role", "jobs"))
        # A RoleBinding names a Role of its own namespace: this one's rules never apply.
        rbac.create_namespaced_role("elsewhere", _role("jobs", _rule(["pods"], ["list"])))
    with kube.api_client(token=token) as api:
        batch = client.BatchV1Api(api)
        created = batch.create_namespaced_job("levers9", _job("w-1"))
        assert created.metadata.namespace == "levers9"
        assert batch.read_namespaced_job("w-1", "levers9").metadata.uid == created.metadata.uid
        with pytest.raises(ApiException) as other_ns:
            batch.create_namespaced_job("elsewhere", _job("w-1"))
        assert _refusal(other_ns) == (
            f'jobs.batch is forbidden: User "{SA_USER}" cannot create resource "jobs" in API '
            'group "batch" in the namespace "elsewhere"'
        )
        with pytest.raises(ApiException) as delete:
            batch.delete_namespaced_job("w-1", "levers9")
        assert _refusal(delete).startswith('jobs.batch "w-1" is forbidden')
        with pytest.raises(ApiException) as cluster_wide:
            batch.list_job_for_all_namespaces()
        assert "at the cluster scope" in _refusal(cluster_wide)
        for namespace in ("levers9", "elsewhere"):
            with pytest.raises(ApiException) as pods:
                client.CoreV1Api(api).list_namespaced_pod(namespace)
            assert _refusal(pods)
    assert [j["metadata"]["name"] for j in kube.jobs()] == ["w-1"]


def test_pod_log_through_a_role_on_the_subresource(kube: KubeStandin) -> None:
    token = _join(kube)
    kube.add_pod(make_pod("w-1-abcde", "gpu-1", namespace="levers9"))
    kube.add_pod(make_pod("quiet", "gpu-1", namespace="levers9"))
    kube.set_pod_log("w-1-abcde", "levers9", "agent started\nready\n")
    with kube.api_client() as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_namespaced_role("levers9", _role("pods", _rule(["pods"], ["get", "list"])))
        rbac.create_namespaced_role_binding("levers9", _binding("pods", "Role", "pods"))
        assert _log(client.CoreV1Api(admin), "quiet", "levers9") == ""
    with kube.api_client(token=token) as api:
        core = client.CoreV1Api(api)
        assert core.read_namespaced_pod("w-1-abcde", "levers9").metadata.name == "w-1-abcde"
        # "pods" does not cover the log subresource.
        with pytest.raises(ApiException) as no_log:
            _log(core, "w-1-abcde", "levers9")
        assert _refusal(no_log) == (
            f'pods "w-1-abcde" is forbidden: User "{SA_USER}" cannot get resource "pods/log" in '
            'API group "" in the namespace "levers9"'
        )
        with kube.api_client() as admin:
            client.RbacAuthorizationV1Api(admin).create_namespaced_role(
                "levers9", _role("logs", _rule(["pods/log"], ["get"]))
            )
            client.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(
                "levers9", _binding("logs", "Role", "logs")
            )
        assert _log(core, "w-1-abcde", "levers9") == "agent started\nready\n"
        with pytest.raises(ApiException) as missing:
            _log(core, "gone", "levers9")
        assert missing.value.status == 404
    assert kube.authorized(token, "get", "pods", "levers9", subresource="log") is True
    assert kube.authorized(token, "get", "pods", "default", subresource="log") is False


def test_wildcards_and_resource_names(kube: KubeStandin) -> None:
    token = _join(kube)
    kube.add_node(make_node("gpu-1"))
    kube.add_node(make_node("gpu-2"))
    with kube.api_client() as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_cluster_role(
            _role(
                "all-batch",
                _rule(["*"], ["*"], ["batch"]),
                {
                    "apiGroups": [""],
                    "resources": ["nodes"],
                    "verbs": ["get"],
                    "resourceNames": ["gpu-1"],
                },
                _rule(["*/log"], ["get"]),
            )
        )
        # A RoleBinding to a ClusterRole grants its rules in the binding's namespace only.
        rbac.create_namespaced_role_binding(
            "levers9", _binding("all-batch", "ClusterRole", "all-batch")
        )
        rbac.create_cluster_role(_role("nodes-by-name", _rule(["nodes"], ["get"])))
    with kube.api_client(token=token) as api:
        batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
        batch.create_namespaced_job("levers9", _job("w-1"))
        assert [j.metadata.name for j in batch.list_namespaced_job("levers9").items] == ["w-1"]
        batch.patch_namespaced_job("w-1", "levers9", {"metadata": {"labels": {"x": "y"}}})
        batch.delete_namespaced_job("w-1", "levers9")
        with pytest.raises(ApiException) as other_ns:
            batch.list_namespaced_job("default")
        assert _refusal(other_ns)
        # Cluster-scoped nodes are not granted through a namespaced RoleBinding.
        with pytest.raises(ApiException) as named:
            core.read_node("gpu-1")
        assert _refusal(named)
    assert kube.authorized(token, "get", "pods", "levers9", subresource="log") is True
    assert kube.authorized(token, "get", "pods", "levers9") is False
    assert kube.authorized(token, "deletecollection", "jobs", "levers9", "batch") is True

    with kube.api_client() as admin:
        client.RbacAuthorizationV1Api(admin).create_cluster_role_binding(
            _binding("all-batch", "ClusterRole", "all-batch")
        )
    with kube.api_client(token=token) as api:
        core = client.CoreV1Api(api)
        assert core.read_node("gpu-1").metadata.name == "gpu-1"
        with pytest.raises(ApiException) as unnamed:
            core.read_node("gpu-2")
        assert _refusal(unnamed).startswith('nodes "gpu-2" is forbidden')
        # resourceNames never grant a list.
        with pytest.raises(ApiException) as listing:
            core.list_node()
        assert _refusal(listing)
        assert [
            j.metadata.name for j in client.BatchV1Api(api).list_job_for_all_namespaces().items
        ] == []


def test_deleting_the_serviceaccount_revokes_its_token(kube: KubeStandin) -> None:
    token = _join(kube)
    with kube.api_client() as admin:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_cluster_role(_role("everything", _rule(["*"], ["*"], ["*"])))
        rbac.create_cluster_role_binding(_binding("everything", "ClusterRole", "everything"))
    with kube.api_client(token=token) as api:
        client.CoreV1Api(api).list_namespace()
    with kube.api_client() as admin:
        client.CoreV1Api(admin).delete_namespaced_service_account("controlplane", "levers9")
    assert kube.secrets("levers9") == []
    assert kube.who_am_i(token) is None
    with kube.api_client(token=token) as api, pytest.raises(ApiException) as revoked:
        client.CoreV1Api(api).list_namespace()
    assert revoked.value.status == 401
    assert json.loads(revoked.value.body)["reason"] == "Unauthorized"

    # A new ServiceAccount of the same name does not bring the old token back.
    with kube.api_client() as admin:
        client.CoreV1Api(admin).create_namespaced_service_account(
            "levers9", {"metadata": {"name": "controlplane"}}
        )
    assert kube.who_am_i(token) is None


def _kubectl(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [kubectl_binary(), "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_kubectl_with_the_serviceaccount_token(kube: KubeStandin, tmp_path: Path) -> None:
    kube.add_node(make_node("gpu-1"))
    token = _join(kube)
    kubeconfig = kube.write_kubeconfig(tmp_path / "sa-kubeconfig", token=token)

    refused = _kubectl(kubeconfig, "get", "nodes")
    assert refused.returncode == 1
    assert (
        f'Error from server (Forbidden): nodes is forbidden: User "{SA_USER}" cannot list '
        'resource "nodes" in API group "" at the cluster scope'
    ) in refused.stderr
    cannot = _kubectl(kubeconfig, "auth", "can-i", "list", "nodes")
    assert (cannot.returncode, cannot.stdout.strip()) == (1, "no")
    whoami = _kubectl(kubeconfig, "auth", "whoami", "-o", "json")
    assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == SA_USER

    admin = kube.write_kubeconfig(tmp_path / "admin-kubeconfig")
    for args in (
        ("create", "clusterrole", "levers9-nodes", "--verb=list", "--resource=nodes"),
        (
            "create",
            "clusterrolebinding",
            "levers9-nodes",
            "--clusterrole=levers9-nodes",
            "--serviceaccount=levers9:controlplane",
        ),
    ):
        made = _kubectl(admin, *args)
        assert made.returncode == 0, made.stderr
    listed = _kubectl(admin, "get", "clusterrolebindings,serviceaccounts", "-A")
    assert "ClusterRole/levers9-nodes" in listed.stdout and "controlplane" in listed.stdout

    allowed = _kubectl(kubeconfig, "get", "nodes")
    assert allowed.returncode == 0, allowed.stderr
    assert "gpu-1" in allowed.stdout
    can = _kubectl(kubeconfig, "auth", "can-i", "list", "nodes")
    assert (can.returncode, can.stdout.strip()) == (0, "yes")
    still = _kubectl(kubeconfig, "get", "secrets", "-n", "default")
    assert still.returncode == 1
    assert 'cannot list resource "secrets" in API group "" in the namespace "default"' in (
        still.stderr
    )
