"""The Kubernetes stand-in against the official client and kubectl, the two clients it stands
in for: if these disagree with it, every controlplane test built on it is suspect."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from sim.kubeapi.http import start_kube_standin
from sim.kubeapi.objects import make_node, make_pod
from sim.kubeapi.store import KubeStandin
from tests.kubectl import kubectl, kubectl_binary

pytest_plugins = ["tests.kube_fixtures"]


def _job(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "levers9-worker"}},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "nodeName": node,
                    "restartPolicy": "Never",
                    "containers": [{"name": "worker", "image": "worker:latest"}],
                }
            },
        },
    }


def _names(items: Any) -> list[str]:
    return sorted(item.metadata.name for item in items.items)


def test_node_label_selectors(kube: KubeStandin) -> None:
    kube.add_node(make_node("a1", labels={"pool": "a", "gpu": "yes"}))
    kube.add_node(make_node("a2", labels={"pool": "a"}))
    kube.add_node(make_node("b1", labels={"pool": "b", "gpu": "yes"}))
    kube.add_node(make_node("c1", labels={}))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        assert _names(core.list_node()) == ["a1", "a2", "b1", "c1"]
        assert _names(core.list_node(label_selector="pool=a")) == ["a1", "a2"]
        assert _names(core.list_node(label_selector="pool==a,gpu")) == ["a1"]
        assert _names(core.list_node(label_selector="pool!=a")) == ["b1", "c1"]
        assert _names(core.list_node(label_selector="pool in (a, b),!gpu")) == ["a2"]
        assert _names(core.list_node(label_selector="pool notin (a)")) == ["b1", "c1"]
        nodes = core.list_node(label_selector="pool=b")
        assert nodes.kind == "NodeList"
        node = nodes.items[0]
        assert node.status.allocatable["nvidia.com/gpu"] == "4"
        assert node.status.conditions[0].type == "Ready"
        with pytest.raises(ApiException) as bad:
            core.list_node(label_selector="pool in a")
        assert bad.value.status == 400


def test_pod_field_selectors_and_namespaces(kube: KubeStandin) -> None:
    kube.add_namespace("other")
    kube.add_node(make_node("n1"))
    kube.add_node(make_node("n2"))
    kube.add_pods(
        [
            make_pod("p1", "n1", gpu_limit=2),
            make_pod("p2", "n1", phase="Succeeded"),
            make_pod("p3", "n2", namespace="other"),
            make_pod("p4", None, phase="Pending"),
        ]
    )
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        on_n1 = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
        assert _names(on_n1) == ["p1", "p2"]
        assert on_n1.items[0].spec.containers[0].resources.limits == {"nvidia.com/gpu": "2"}
        live = "spec.nodeName==n1,status.phase!=Succeeded"
        assert _names(core.list_pod_for_all_namespaces(field_selector=live)) == ["p1"]
        assert _names(core.list_pod_for_all_namespaces(field_selector="spec.nodeName=")) == ["p4"]
        assert _names(core.list_namespaced_pod("other")) == ["p3"]
        assert _names(core.list_pod_for_all_namespaces(field_selector="metadata.name=p3")) == ["p3"]
        # A pod moved to another node is found there and no longer on the old one.
        kube.add_pod(make_pod("p1", "n2"))
        assert _names(core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n2")) == [
            "p1",
            "p3",
        ]
        with pytest.raises(ApiException) as bad:
            core.list_pod_for_all_namespaces(field_selector="spec.schedulerName=x")
        assert bad.value.status == 400


def test_paging_returns_every_item_once(kube: KubeStandin) -> None:
    kube.add_nodes(make_node(f"n{i}") for i in range(5))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        seen: list[str] = []
        token = None
        while True:
            page = core.list_node(limit=2, _continue=token)
            seen += [n.metadata.name for n in page.items]
            token = page.metadata._continue
            if not token:
                break
    assert seen == [f"n{i}" for i in range(5)]


def test_job_create_conflict_hook_and_cascading_delete(kube: KubeStandin) -> None:
    kube.add_namespace("levers9")
    kube.add_node(make_node("n1"))
    kube.on_job_created(lambda server, job: server.run_job_pod(job))
    with kube.api_client() as api:
        batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
        job = batch.create_namespaced_job("levers9", _job("w-n1", "n1"))
        assert job.metadata.uid
        assert job.metadata.creation_timestamp is not None
        assert job.spec.backoff_limit == 0
        with pytest.raises(ApiException) as again:
            batch.create_namespaced_job("levers9", _job("w-n1", "n1"))
        assert again.value.status == 409
        assert json.loads(again.value.body)["reason"] == "AlreadyExists"
        assert kube.request_count("create", "/apis/batch/v1/namespaces/levers9/jobs") == 2
        assert len(kube.jobs("levers9")) == 1

        pods = core.list_namespaced_pod("levers9", field_selector="spec.nodeName=n1")
        assert [p.status.phase for p in pods.items] == ["Running"]
        assert pods.items[0].metadata.owner_references[0].uid == job.metadata.uid
        assert batch.read_namespaced_job("w-n1", "levers9").status.active == 1

        secret = core.create_namespaced_secret(
            "levers9",
            {
                "metadata": {
                    "name": "w-n1-token",
                    "ownerReferences": [
                        {
                            "apiVersion": "batch/v1",
                            "kind": "Job",
                            "name": "w-n1",
                            "uid": job.metadata.uid,
                        }
                    ],
                },
                "stringData": {"token": "s3cret"},
            },
        )
        assert secret.data == {"token": "czNjcmV0"}
        before = kube.resource_version

        batch.delete_namespaced_job("w-n1", "levers9", propagation_policy="Background")
        assert kube.resource_version > before
        assert kube.jobs() == []
        assert kube.secrets("levers9") == []
        assert kube.pods("levers9") == []
        with pytest.raises(ApiException) as gone:
            batch.read_namespaced_job("w-n1", "levers9")
        assert gone.value.status == 404
        assert json.loads(gone.value.body)["reason"] == "NotFound"
        with pytest.raises(ApiException) as gone_again:
            batch.delete_namespaced_job("w-n1", "levers9")
        assert gone_again.value.status == 404


def test_job_delete_without_policy_orphans_its_pods(kube: KubeStandin) -> None:
    kube.on_job_created(lambda server, job: server.run_job_pod(job))
    with kube.api_client() as api:
        batch = client.BatchV1Api(api)
        batch.create_namespaced_job("default", _job("w", "n1"))
        batch.delete_namespaced_job("w", "default")
    assert kube.jobs() == []
    assert len(kube.pods()) == 1


def test_create_in_missing_namespace_is_not_found(kube: KubeStandin) -> None:
    with kube.api_client() as api, pytest.raises(ApiException) as missing:
        client.BatchV1Api(api).create_namespaced_job("nope", _job("w", "n1"))
    assert missing.value.status == 404
    assert "namespaces" in json.loads(missing.value.body)["message"]


def test_tokens(kube: KubeStandin) -> None:
    kube.add_token("reader", denied_verbs={"create", "delete"})
    with kube.api_client(token="wrong") as api, pytest.raises(ApiException) as denied:
        client.CoreV1Api(api).list_node()
    assert denied.value.status == 401
    assert json.loads(denied.value.body)["reason"] == "Unauthorized"
    anonymous = httpx.get(f"{kube.url}/api/v1/nodes", verify=kube.ssl_context())
    assert anonymous.status_code == 401
    with kube.api_client(token="reader") as api:
        client.CoreV1Api(api).list_node()
        with pytest.raises(ApiException) as forbidden:
            client.BatchV1Api(api).create_namespaced_job("default", _job("w", "n1"))
    assert forbidden.value.status == 403
    assert json.loads(forbidden.value.body)["reason"] == "Forbidden"
    assert kube.jobs() == []
    assert "reader" not in repr(kube) and kube.token not in repr(kube)


def test_faults_answer_then_clear(kube: KubeStandin) -> None:
    kube.add_node(make_node("n1"))
    headers = {"Authorization": f"Bearer {kube.token}"}
    with httpx.Client(verify=kube.ssl_context(), headers=headers) as http:
        kube.inject_fault("429", count=1, path_prefix="/api/v1/nodes", retry_after_s=7)
        busy = http.get(f"{kube.url}/api/v1/nodes")
        assert busy.status_code == 429
        assert busy.headers["Retry-After"] == "7"
        assert busy.json()["reason"] == "TooManyRequests"
        assert busy.json()["details"]["retryAfterSeconds"] == 7
        assert http.get(f"{kube.url}/api/v1/nodes").status_code == 200
        kube.inject_fault("delay", delay_s=0.01)
        assert http.get(f"{kube.url}/api/v1/nodes/n1").json()["metadata"]["name"] == "n1"

    # The official client's urllib3 retries a 429 that carries Retry-After by itself.
    kube.inject_fault("429", count=2, path_prefix="/api/v1/nodes", verb="list", retry_after_s=0)
    kube.inject_fault("500", count=1, verb="get")
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        before = kube.request_count("list", "/api/v1/nodes")
        assert _names(core.list_node()) == ["n1"]
        assert kube.request_count("list", "/api/v1/nodes") == before + 3
        with pytest.raises(ApiException) as broken:
            core.read_node("n1")
        assert broken.value.status == 500
        assert json.loads(broken.value.body)["reason"] == "InternalError"
        assert core.read_node("n1").metadata.name == "n1"


async def test_usable_from_trio(kube: KubeStandin, kubeconfig: Path) -> None:
    kube.add_node(make_node("n1", gpus=8))

    def list_gpus() -> list[str]:
        with config.new_client_from_config(config_file=str(kubeconfig)) as api:
            nodes = client.CoreV1Api(api).list_node()
            return [n.status.allocatable["nvidia.com/gpu"] for n in nodes.items]

    with trio.fail_after(30):
        assert await trio.to_thread.run_sync(list_gpus) == ["8"]


def testkubectl(kube: KubeStandin, kubeconfig: Path, tmp_path: Path) -> None:
    kube.add_node(make_node("gpu-1"))
    kube.add_node(make_node("gpu-2", ready=False, unschedulable=True))
    kube.add_pod(make_pod("app", "gpu-1", gpu_limit=1))
    with kube.api_client() as api:
        client.BatchV1Api(api).create_namespaced_job("default", _job("w-gpu-1", "gpu-1"))
    out = kubectl(kubeconfig, "get", "nodes,pods,jobs", "-A")
    assert "node/gpu-1" in out and "pod/app" in out and "job.batch/w-gpu-1" in out
    assert "NotReady,SchedulingDisabled" in out
    nodes = json.loads(kubectl(kubeconfig, "get", "nodes", "-o", "json"))
    assert [n["metadata"]["name"] for n in nodes["items"]] == ["gpu-1", "gpu-2"]
    assert nodes["items"][0]["status"]["capacity"]["nvidia.com/gpu"] == "4"
    assert "app" in kubectl(kubeconfig, "get", "pods", "--field-selector", "spec.nodeName=gpu-1")
    bad = kube.write_kubeconfig(tmp_path / "bad-kubeconfig", token="wrong")
    refused = subprocess.run(
        [kubectl_binary(), "--kubeconfig", str(bad), "get", "nodes"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode != 0


@pytest.mark.slow
def test_large_list_timing(tmp_path: Path) -> None:
    running = start_kube_standin(tmp_path / "kube")
    try:
        kube = running.kube
        from sim.kubeapi.store import synthetic_cluster

        started = time.perf_counter()
        synthetic_cluster(kube, nodes=1000, pods_per_node=20)
        filled = time.perf_counter()
        headers = {"Authorization": f"Bearer {kube.token}"}
        with httpx.Client(verify=kube.ssl_context(), headers=headers, timeout=60) as http:
            nodes = http.get(f"{kube.url}/api/v1/nodes")
            listed_nodes = time.perf_counter()
            pods = http.get(f"{kube.url}/api/v1/pods")
            listed_pods = time.perf_counter()
        assert len(nodes.json()["items"]) == 1000
        assert len(pods.json()["items"]) == 20_000
        print(
            f"\nfill {filled - started:.2f}s; list 1,000 nodes {listed_nodes - filled:.2f}s "
            f"({len(nodes.content) / 1e6:.1f} MB); list 20,000 pods "
            f"{listed_pods - listed_nodes:.2f}s ({len(pods.content) / 1e6:.1f} MB)"
        )
    finally:
        running.stop()
