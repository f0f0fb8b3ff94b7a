"""Clusters that refuse privileged pods: Pod Security Admission and GKE Autopilot.

A worker is a privileged pod (hostNetwork, hostPath volumes, a privileged container). The
Kubernetes stand-in refuses such a pod where its namespace's `pod-security.kubernetes.io/enforce`
level (or the cluster's default) says so, in the apiserver's words, and records the Job
controller's `FailedCreate` Event on a worker Job whose pod it refused. `levers9 cluster join`
labels the namespace it creates and stops, saying what to run, before touching a namespace or
a cluster that would refuse the workers; a pool whose workers are refused says so on the node,
in `cluster list`, `machine list` and the metrics, until a pod is made.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import trio
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from control.api.pools import machine_list
from control.cli.main import main as cli_main
from control.kube.adapter import KubeRefused, Operation, translate_api_exception
from control.kube.join import JoinError, open_cluster_side, probe_refusal
from control.kube.loop import PoolStatus
from control.kube.manifests import PoolSettings, job_manifest, token_secret_name
from control.kube.planner import JobFacts
from control.kube.podsecurity import (
    ENFORCE_LABEL,
    namespace_refusal,
    pod_refusal,
    refused_nodes,
)
from control.metrics import pool_figures
from sim.configs import API_TOKEN
from sim.kubeapi.model import KubeError
from sim.kubeapi.podsecurity import Policy, violations
from sim.kubeapi.store import KubeStandin
from sim.pools import gpu_node
from tests.test_chart import in_cluster_pool, of_kind, public_values, render
from tests.test_kube import _api_exception
from tests.test_pool_reconcile import serve_pool, until
from wire.errors import ErrorCode

pytest_plugins = ["tests.kube_fixtures"]

NS = "levers9"
BASELINE = {ENFORCE_LABEL: "baseline"}
WORKER_REFUSED = (
    'violates PodSecurity "baseline:latest": host namespaces (hostNetwork=true), hostPath '
    'volumes (volumes "objects", "dev", "driver", "pod-resources"), privileged (container '
    '"agent" must not set securityContext.privileged=true)'
)
FIX = f"kubectl label namespace {NS} {ENFORCE_LABEL}=privileged --overwrite"


def worker_job(namespace: str = NS, node: str = "node-1") -> dict[str, Any]:
    """A worker Job exactly as the reconciler writes it."""
    settings = PoolSettings(name="gpu", namespace=namespace, image="worker:1")
    name = f"levers9-gpu-{node}-0"
    manifests = job_manifest(
        settings, node, 2, name, token_secret_name(name), "https://cp.test", token="t"
    )
    return manifests.job


def worker_pod(namespace: str = NS, name: str = "levers9-gpu-node-1-0-abcde") -> dict[str, Any]:
    spec = worker_job(namespace)["spec"]["template"]["spec"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def forbidden(call: Any) -> dict[str, Any]:
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status == 403
    body: dict[str, Any] = json.loads(refused.value.body)
    return body


# --- the stand-in enforces Pod Security as the apiserver does --------------------------------


def test_a_privileged_pod_is_refused_in_a_baseline_namespace_in_the_apiservers_words(
    kube: KubeStandin,
) -> None:
    kube.add_namespace(NS, labels=BASELINE)
    kube.add_namespace("open", labels={ENFORCE_LABEL: "privileged"})
    kube.add_namespace(
        "strict", labels={ENFORCE_LABEL: "restricted", f"{ENFORCE_LABEL}-version": "v1.30"}
    )
    with kube.api_client() as api:
        core = k8s.CoreV1Api(api)
        body = forbidden(lambda: core.create_namespaced_pod(NS, worker_pod()))
        assert body["reason"] == "Forbidden"
        assert body["details"] == {"name": "levers9-gpu-node-1-0-abcde", "kind": "pods"}
        assert (
            body["message"] == f'pods "levers9-gpu-node-1-0-abcde" is forbidden: {WORKER_REFUSED}'
        )
        assert kube.pods(NS) == []

        # restricted asks for more, and restricted volume types replace hostPath volumes.
        said = forbidden(lambda: core.create_namespaced_pod("strict", worker_pod("strict")))
        assert 'violates PodSecurity "restricted:v1.30": host namespaces' in said["message"]
        assert 'use restricted volume type "hostPath"' in said["message"]
        assert "runAsNonRoot != true" in said["message"]
        assert "hostPath volumes (" not in said["message"]

        # privileged allows everything; so does a namespace with no label, by default.
        core.create_namespaced_pod("open", worker_pod("open"))
        core.create_namespaced_pod("default", worker_pod("default"))
        # A plain pod passes baseline.
        plain = {
            "metadata": {"name": "plain"},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }
        core.create_namespaced_pod(NS, plain)
    assert [p["metadata"]["name"] for p in kube.pods(NS)] == ["plain"]


def test_the_cluster_default_applies_where_a_namespace_has_no_label(kube: KubeStandin) -> None:
    kube.add_namespace("unlabelled")
    kube.add_namespace("open", labels={ENFORCE_LABEL: "privileged"})
    kube.set_pod_security_default("baseline")
    with pytest.raises(KubeError) as refused:
        kube.create("pods", {**worker_pod(), "metadata": {"name": "w", "namespace": "unlabelled"}})
    assert refused.value.code == 403
    assert refused.value.message == f'pods "w" is forbidden: {WORKER_REFUSED}'
    kube.create("pods", {**worker_pod(), "metadata": {"name": "w", "namespace": "open"}})
    with pytest.raises(ValueError, match="privileged, baseline, restricted"):
        kube.set_pod_security_default("strict")


def test_a_refused_job_pod_is_one_failed_create_event_on_the_job_counted_again(
    kube: KubeStandin,
) -> None:
    kube.add_namespace(NS, labels=BASELINE)
    job = kube.create("jobs", worker_job())
    for _ in range(3):  # the Job controller tries again, and again
        with pytest.raises(KubeError):
            kube.run_job_pod(job)
    assert kube.pods(NS) == []
    with kube.api_client() as api:
        listed = k8s.CoreV1Api(api).list_namespaced_event(
            NS,
            field_selector="involvedObject.kind=Job,reason=FailedCreate",
            _preload_content=False,
        )
    (event,) = json.loads(listed.data)["items"]
    assert event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == job["metadata"]["uid"]
    assert event["source"] == {"component": "job-controller"}
    assert event["count"] == 3
    assert event["message"].startswith('Error creating: pods "levers9-gpu-node-1-0-')
    assert event["message"].endswith(f'" is forbidden: {WORKER_REFUSED}')

    # Once the namespace lets it in, the pod is made and the Job counts it.
    kube.add_namespace(NS, labels={ENFORCE_LABEL: "privileged"})
    kube.run_job_pod(job)
    (current,) = kube.jobs(NS)
    assert current["status"]["active"] == 1


def test_an_autopilot_cluster_refuses_privileged_jobs_in_every_namespace(
    kube: KubeStandin,
) -> None:
    kube.set_autopilot()
    with pytest.raises(KubeError) as refused:
        kube.create("jobs", worker_job("default"))
    assert refused.value.code == 403
    assert 'admission webhook "warden-validating.common-webhooks.networking.gke.io"' in (
        refused.value.message
    )
    assert "container agent is privileged; not allowed in Autopilot" in refused.value.message
    assert "enabling hostNetwork is not allowed in Autopilot." in refused.value.message
    assert kube.jobs() == []


def test_the_plugins_order_and_wording_for_the_obvious_offenders() -> None:
    spec = {
        "hostPID": True,
        "hostIPC": True,
        "containers": [
            {
                "name": "a",
                "ports": [{"containerPort": 80, "hostPort": 80}],
                "securityContext": {"capabilities": {"add": ["SYS_ADMIN", "CHOWN"]}},
            },
            {"name": "b", "securityContext": {"privileged": True}},
        ],
        "volumes": [{"name": "host", "hostPath": {"path": "/"}}, {"name": "tmp", "emptyDir": {}}],
    }
    assert violations("baseline", spec) == [
        (
            "non-default capabilities",
            'container "a" must not include "SYS_ADMIN" in securityContext.capabilities.add',
        ),
        ("host namespaces", "hostPID=true, hostIPC=true"),
        ("hostPath volumes", 'volume "host"'),
        ("hostPort", 'container "a" uses hostPort 80'),
        ("privileged", 'container "b" must not set securityContext.privileged=true'),
    ]
    assert violations("privileged", spec) == []
    assert str(Policy("baseline")) == "baseline:latest"


# --- what levers9 makes of it (pure) ---------------------------------------------------------


def failed_create(
    job: str, uid: str, message: str, at: str = "2024-05-01T10:00:00Z"
) -> dict[str, Any]:
    return {
        "involvedObject": {"kind": "Job", "name": job, "namespace": NS, "uid": uid},
        "reason": "FailedCreate",
        "type": "Warning",
        "message": message,
        "lastTimestamp": at,
    }


def test_a_failed_create_event_becomes_the_nodes_refusal_with_what_to_run() -> None:
    refused = f'Error creating: pods "w-1-0-abcde" is forbidden: {WORKER_REFUSED}'
    assert pod_refusal(failed_create("w-1-0", "u1", refused)) == WORKER_REFUSED
    combined = f"(combined from similar events): {refused}"
    assert pod_refusal(failed_create("w-1-0", "u1", combined)) == WORKER_REFUSED
    assert pod_refusal({**failed_create("w-1-0", "u1", refused), "type": "Normal"}) is None

    jobs = [
        JobFacts("w-1-0", "node-1", 0, None, active=True, uid="u1"),
        JobFacts("w-2-0", "node-2", 0, None, active=True, uid="u2", pods=1),  # has its pod
        JobFacts("w-3-0", "node-3", 0, None, active=True, uid="u3"),  # refused by a quota
        JobFacts("w-4-0", "node-4", 0, None, active=True, uid="u4"),  # nothing said yet
    ]
    events = [
        failed_create("w-1-0", "u1", "Error creating: an older reason", "2024-05-01T09:00:00Z"),
        failed_create("w-1-0", "u1", refused),
        failed_create("w-1-0", "old-uid", "Error creating: a Job of the same name, gone"),
        failed_create("w-2-0", "u2", refused),
        failed_create(
            "w-3-0", "u3", 'Error creating: pods "w-3-0-x" is forbidden: exceeded quota: q'
        ),
    ]
    assert refused_nodes(NS, jobs, events) == {
        "node-1": f"worker Job w-1-0: pods refused by the cluster: {WORKER_REFUSED}; run `{FIX}`",
        "node-3": "worker Job w-3-0: pods refused by the cluster: exceeded quota: q",
    }


def test_only_a_namespace_label_that_refuses_privileged_pods_stops_the_join() -> None:
    def ns(**labels: str) -> dict[str, Any]:
        return {"metadata": {"name": NS, "labels": labels}}

    assert namespace_refusal(NS, ns()) is None
    assert namespace_refusal(NS, ns(**{ENFORCE_LABEL: "privileged"})) is None
    said = namespace_refusal(NS, ns(**{ENFORCE_LABEL: "restricted"}))
    assert said is not None
    assert f"{ENFORCE_LABEL}=restricted" in said and f"`{FIX}`" in said
    # Pod Security in the namespace probed instead of a new one says nothing about it.
    assert probe_refusal(NS, "default", f"pods x is forbidden: {WORKER_REFUSED}") is None
    autopilot = probe_refusal(NS, "default", "admission webhook denied: not allowed in Autopilot")
    assert autopilot is not None and "use a GKE Standard cluster" in autopilot


def test_an_admission_refusal_is_not_worded_as_a_missing_permission() -> None:
    message = f'pods "w" is forbidden: {WORKER_REFUSED}'
    body = {"kind": "Status", "code": 403, "reason": "Forbidden", "message": message}
    op = Operation("create", "pods", "", NS, "w")
    error = translate_api_exception(_api_exception(403, body), op, pool="gpu")
    assert isinstance(error, KubeRefused)
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert error.server_message == message
    assert "may not" not in error.message and f"run `{FIX}`" in error.message


# --- cluster join ----------------------------------------------------------------------------


async def test_join_labels_the_namespace_it_creates_so_workers_are_admitted(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.set_pod_security_default("baseline")
    async with open_cluster_side(str(kubeconfig), None) as side:
        joined = await side.apply(NS, "gpus")
    assert joined.steps[0] == f"namespace {NS}: created"
    namespace = kube.get("namespaces", NS)
    assert namespace is not None
    assert namespace["metadata"]["labels"][ENFORCE_LABEL] == "privileged"
    kube.create("pods", {**worker_pod(), "metadata": {"name": "w", "namespace": NS}})


async def test_join_refuses_a_baseline_namespace_before_creating_anything(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.add_namespace(NS, labels=BASELINE)
    async with open_cluster_side(str(kubeconfig), None) as side:
        with pytest.raises(JoinError) as refused:
            await side.apply(NS, "gpus")
    said = str(refused.value)
    assert said.startswith(f"namespace {NS} is labelled {ENFORCE_LABEL}=baseline: ")
    assert f"Run `{FIX}`" in said
    assert kube.objects("serviceaccounts", NS) == [] and kube.objects("clusterroles") == []
    assert kube.request_count("create") == 0


async def test_join_refuses_an_unlabelled_namespace_the_cluster_default_closes(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.add_namespace(NS)
    kube.set_pod_security_default("restricted")
    async with open_cluster_side(str(kubeconfig), None) as side:
        with pytest.raises(JoinError) as refused:
            await side.apply(NS, "gpus")
    said = str(refused.value)
    assert "the cluster's default level applies to it" in said
    assert 'violates PodSecurity "restricted:latest"' in said and f"Run `{FIX}`" in said
    assert kube.objects("serviceaccounts", NS) == []
    assert kube.pods() == []  # the dry run stored nothing


async def test_join_refuses_a_gke_autopilot_cluster(kube: KubeStandin, kubeconfig: Path) -> None:
    kube.set_autopilot()
    async with open_cluster_side(str(kubeconfig), None) as side:
        with pytest.raises(JoinError) as refused:
            await side.apply(NS, "gpus")
    said = str(refused.value)
    assert said.startswith("GKE Autopilot does not admit privileged pods")
    assert "use a GKE Standard cluster" in said
    assert "not allowed in Autopilot" in said  # the cluster's own words
    assert kube.get("namespaces", NS) is None and kube.pods() == []


# --- a pool in a namespace that refuses its workers ------------------------------------------


def job_controller(server: KubeStandin, job: dict[str, Any]) -> None:
    """Makes each new Job's pod; a refused one is left to the Event it leaves."""
    with contextlib.suppress(KubeError):
        server.run_job_pod(job)


async def cli(control_port: int, ca: Path, *args: str) -> None:
    argv = ["--controlplane", f"https://127.0.0.1:{control_port}", "--token", API_TOKEN]
    assert await trio.to_thread.run_sync(cli_main, [*argv, "--ca", str(ca), *args]) == 0


async def test_a_pool_whose_workers_are_refused_says_so_until_the_label_changes(
    kube: KubeStandin,
    tmp_path: Path,
    nursery: trio.Nursery,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kube.add_namespace(NS, labels=BASELINE)
    kube.on_job_created(job_controller)
    kube.add_node(gpu_node("node-1"))
    control, r, pki = await serve_pool(kube, tmp_path, nursery)
    await until(r, lambda: "node-1" in r.status.refused)

    (job,) = kube.jobs(NS)
    name = job["metadata"]["name"]
    shown = f"worker Job {name}: pods refused by the cluster: {WORKER_REFUSED}; run `{FIX}`"
    assert r.status.refused == {"node-1": shown}
    (machine,) = machine_list([r.status]).machines
    assert machine.refused == shown and machine.error is None
    assert pool_figures(machine_list([r.status]))["gpu"].refused == 1

    await cli(control.port, pki.ca_file, "cluster", "list")
    assert f"node node-1: {shown}" in capsys.readouterr().out
    await cli(control.port, pki.ca_file, "machine", "list")
    assert f"pool gpu: node node-1: {shown}" in capsys.readouterr().err

    # The operator runs what it says; the Job controller's next try makes the pod.
    kube.add_namespace(NS, labels={ENFORCE_LABEL: "privileged"})
    kube.run_job_pod(kube.jobs(NS)[0])
    await until(r, lambda: not r.status.refused)
    assert r.status.problem() is None
    await cli(control.port, pki.ca_file, "cluster", "list")
    assert "refused" not in capsys.readouterr().out


async def test_a_namespace_the_pool_creates_is_labelled_for_its_workers(
    kube: KubeStandin, tmp_path: Path, nursery: trio.Nursery
) -> None:
    kube.set_pod_security_default("baseline")
    kube.on_job_created(lambda server, job: server.run_job_pod(job))  # raises if refused
    kube.add_node(gpu_node("node-1"))
    _, r, _ = await serve_pool(kube, tmp_path, nursery)
    await until(r, lambda: len(kube.pods(NS)) == 1)
    namespace = kube.get("namespaces", NS)
    assert namespace is not None
    assert namespace["metadata"]["labels"] == {ENFORCE_LABEL: "privileged"}
    assert r.status.refused == {}


def test_a_pool_status_names_one_refusal_and_counts_the_rest() -> None:
    status = PoolStatus(pool="gpu", refused={"node-2": "b", "node-1": "a"})
    assert status.problem() == "node node-1: a (and 1 more node(s))"
    assert PoolStatus(pool="gpu", error="down", refused={"n": "x"}).problem() == "down"


# --- the chart ------------------------------------------------------------------------------


def test_the_chart_labels_the_worker_namespaces_it_creates(tmp_path: Path) -> None:
    values = public_values(in_cluster_pool("a", namespace="gpu-workers"))
    docs = render(tmp_path, values, sets=("rbac.createWorkerNamespaces=true",))
    (namespace,) = of_kind(docs, "Namespace")
    assert namespace["metadata"]["name"] == "gpu-workers"
    assert namespace["metadata"]["labels"][ENFORCE_LABEL] == "privileged"
    (role,) = [d for d in of_kind(docs, "Role") if d["metadata"]["namespace"] == "gpu-workers"]
    events = [rule for rule in role["rules"] if rule["resources"] == ["events"]]
    assert events == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "list", "patch"]}
    ]
