"""Deployments, `kubectl scale` and Helm in the Kubernetes stand-in, through the real kubectl and
helm binaries: the product page promises "scale the model server down and the cards show up",
and deploy/deploy.sh runs `helm upgrade --install` of deploy/chart, so both must work against the
stand-in as they do against a cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from control.kube.manifests import PoolSettings
from sim.kubeapi.deployments import POD_TEMPLATE_HASH
from sim.kubeapi.objects import job_node, make_node, make_pod
from sim.kubeapi.patches import strategic_merge_patch
from sim.kubeapi.scheduler import Unschedulable, pick_node
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode
from sim.pools import gpu_node
from tests.kubectl import kubectl, kubectl_binary
from tests.planning import plan_objects
from tests.test_kubelet import needs_root, open_cluster, uuids
from tests.test_pool_reconcile import gpu_request, reconciler, until

pytest_plugins = ["tests.kube_fixtures"]

HELM = Path(sys.executable).parent / "helm"
REPO = Path(__file__).resolve().parents[1]
DEPLOY_SH = REPO / "deploy" / "deploy.sh"
NS = "models"
CONTROL_NS = "levers9-control"
RELEASE = "levers9"
FULLNAME = "levers9-levers9-controlplane"


def deployment(
    name: str = "model-server",
    replicas: int = 1,
    gpus: int = 4,
    *,
    image: str = "vllm/vllm-openai:v0.6.0",
    namespace: str = NS,
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "server",
                "image": image,
                "args": ["--model", "llama"],
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }
        ]
    }
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def apply(kubeconfig: Path, *objects: dict[str, Any]) -> str:
    return kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump_all(objects))


def pods_of(kube: KubeStandin, name: str, namespace: str = NS) -> list[dict[str, Any]]:
    return [
        p
        for p in kube.pods(namespace)
        if any(r["name"] == name for r in p["metadata"].get("ownerReferences", ()))
    ]


def stored(kube: KubeStandin, name: str = "model-server", namespace: str = NS) -> dict[str, Any]:
    found = kube.get("deployments", name, namespace)
    assert found is not None, f"Deployment {namespace}/{name} is gone"
    return found


def conditions(dep: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in dep["status"]["conditions"]}


# --- kubectl and Deployments ----------------------------------------------------------------------


def test_kubectl_creates_gets_and_scales_a_deployment(kube: KubeStandin, kubeconfig: Path) -> None:
    kube.add_node(make_node("gpu-1", gpus=4))
    kubectl(kubeconfig, "create", "namespace", NS)
    assert "deployment.apps/model-server created" in apply(kubeconfig, deployment(gpus=1))

    (first,) = pods_of(kube, "model-server")
    pod_hash = first["metadata"]["labels"][POD_TEMPLATE_HASH]
    assert re.fullmatch(rf"model-server-{pod_hash}-[a-z0-9]{{5}}", first["metadata"]["name"])
    assert first["metadata"]["labels"]["app"] == "model-server"
    assert first["spec"]["nodeName"] == "gpu-1"
    assert first["status"]["phase"] == "Running"
    owner = first["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "Deployment",
        stored(kube)["metadata"]["uid"],
        True,
    )

    out = kubectl(kubeconfig, "scale", "deployment", "model-server", "--replicas=3", "-n", NS)
    assert "deployment.apps/model-server scaled" in out
    listed = json.loads(
        kubectl(kubeconfig, "get", "deploy", "model-server", "-n", NS, "-o", "json")
    )
    assert listed["spec"]["replicas"] == 3
    status = listed["status"]
    assert (status["observedGeneration"], listed["metadata"]["generation"]) == (2, 2)
    assert (status["replicas"], status["readyReplicas"]) == (3, 3)
    assert (status["availableReplicas"], status["updatedReplicas"]) == (3, 3)
    assert conditions(listed) == {
        "Available": ("True", "MinimumReplicasAvailable"),
        "Progressing": ("True", "NewReplicaSetAvailable"),
    }
    header, row = kubectl(kubeconfig, "get", "deploy", "-n", NS).splitlines()
    assert header.split() == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert row.split()[:4] == ["model-server", "3/3", "3", "3"]
    assert "successfully rolled out" in kubectl(
        kubeconfig, "rollout", "status", "deployment/model-server", "-n", NS, "--timeout=20s"
    )
    _, *rows = kubectl(kubeconfig, "get", "pods", "-n", NS, "-l", "app=model-server").splitlines()
    assert [row.split()[1:3] for row in rows] == [["1/1", "Running"]] * 3

    # Scaling down deletes the newest pods first.
    kubectl(kubeconfig, "scale", "deployment/model-server", "--replicas=1", "-n", NS)
    assert [p["metadata"]["name"] for p in pods_of(kube, "model-server")] == [
        first["metadata"]["name"]
    ]
    assert stored(kube)["status"]["replicas"] == 1


def test_the_scale_subresource_through_the_official_client(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    kube.add_node(make_node("gpu-1", gpus=8))
    with kube.api_client() as api:
        apps = client.AppsV1Api(api)
        apps.create_namespaced_deployment(NS, deployment(gpus=1))
        scale = apps.read_namespaced_deployment_scale("model-server", NS)
        assert (scale.spec.replicas, scale.status.replicas) == (1, 1)
        assert scale.status.selector == "app=model-server"

        stale = scale.metadata.resource_version
        scale.spec.replicas = 2
        assert (
            apps.replace_namespaced_deployment_scale("model-server", NS, scale).spec.replicas == 2
        )
        scale.metadata.resource_version = stale
        with pytest.raises(ApiException) as conflict:
            apps.replace_namespaced_deployment_scale("model-server", NS, scale)
        assert conflict.value.status == 409

        patched = apps.patch_namespaced_deployment_scale(
            "model-server", NS, {"spec": {"replicas": 4}}
        )
        assert (patched.spec.replicas, patched.status.replicas) == (4, 4)
        with pytest.raises(ApiException) as invalid:
            apps.patch_namespaced_deployment_scale("model-server", NS, {"spec": {"replicas": -1}})
        assert invalid.value.status == 422
        assert "spec.replicas" in json.loads(invalid.value.body)["message"]
    assert len(pods_of(kube, "model-server")) == 4


def test_a_deployment_whose_selector_misses_its_template_is_refused(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    wrong = deployment()
    wrong["spec"]["selector"] = {"matchLabels": {"app": "other"}}
    with kube.api_client() as api, pytest.raises(ApiException) as refused:
        client.AppsV1Api(api).create_namespaced_deployment(NS, wrong)
    assert refused.value.status == 422
    assert (
        "`selector` does not match template `labels`" in json.loads(refused.value.body)["message"]
    )
    assert kube.objects("deployments") == []


def test_deleting_a_deployment_deletes_its_pods_and_a_deleted_pod_is_replaced(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.add_node(make_node("gpu-1", gpus=4))
    kube.add_namespace(NS)
    created = kubectl(
        kubeconfig, "create", "deployment", "model-server", "--image=nginx", "--replicas=2"
    )
    assert "deployment.apps/model-server created" in created
    assert len(pods_of(kube, "model-server", "default")) == 2
    kubectl(kubeconfig, "delete", "deployment", "model-server")
    assert kube.pods("default") == []

    apply(kubeconfig, deployment(replicas=2, gpus=1))
    one, two = (p["metadata"]["name"] for p in pods_of(kube, "model-server"))

    kubectl(kubeconfig, "delete", "pod", one, "-n", NS)
    names = {p["metadata"]["name"] for p in pods_of(kube, "model-server")}
    assert two in names and one not in names and len(names) == 2

    kubectl(kubeconfig, "delete", "deployment", "model-server", "-n", NS)
    assert kube.pods(NS) == []


def test_a_changed_template_replaces_the_pods(kube: KubeStandin, kubeconfig: Path) -> None:
    kube.add_node(make_node("gpu-1", gpus=4))
    kube.add_namespace(NS)
    apply(kubeconfig, deployment(replicas=2, gpus=2))
    old = {p["metadata"]["name"] for p in pods_of(kube, "model-server")}

    # A second apply is a strategic merge patch of the one container that changed.
    apply(kubeconfig, deployment(replicas=2, gpus=2, image="vllm/vllm-openai:v0.7.0"))
    dep = stored(kube)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "vllm/vllm-openai:v0.7.0"
    assert container["args"] == ["--model", "llama"]
    assert dep["metadata"]["generation"] == 2
    new = pods_of(kube, "model-server")
    assert len(new) == 2 and not old & {p["metadata"]["name"] for p in new}
    assert {p["spec"]["containers"][0]["image"] for p in new} == {"vllm/vllm-openai:v0.7.0"}
    assert {p["spec"]["nodeName"] for p in new} == {"gpu-1"}
    assert dep["status"]["updatedReplicas"] == 2


# --- binding pods to nodes ------------------------------------------------------------------------


def test_a_pod_that_fits_nowhere_stays_pending_until_a_node_has_room(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.add_node(make_node("gpu-1", gpus=4))
    kube.add_namespace(NS)
    apply(kubeconfig, deployment(replicas=2, gpus=4))

    pending, running = sorted(pods_of(kube, "model-server"), key=lambda p: p["status"]["phase"])
    assert (running["status"]["phase"], running["spec"]["nodeName"]) == ("Running", "gpu-1")
    assert pending["status"]["phase"] == "Pending"
    assert "nodeName" not in pending["spec"]
    (scheduled,) = pending["status"]["conditions"]
    assert (scheduled["type"], scheduled["status"], scheduled["reason"]) == (
        "PodScheduled",
        "False",
        "Unschedulable",
    )
    assert scheduled["message"] == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    dep = stored(kube)
    assert (dep["status"]["readyReplicas"], dep["status"]["unavailableReplicas"]) == (1, 1)
    assert conditions(dep)["Available"] == ("False", "MinimumReplicasUnavailable")
    assert "1/2" in kubectl(kubeconfig, "get", "deploy", "-n", NS)

    # A new node makes room: the waiting pod is bound there.
    kube.add_node(make_node("gpu-2", gpus=4))
    assert {p["spec"].get("nodeName") for p in pods_of(kube, "model-server")} == {
        "gpu-1",
        "gpu-2",
    }
    assert conditions(stored(kube))["Available"] == ("True", "MinimumReplicasAvailable")


NODES = [
    make_node("a-not-ready", ready=False),
    make_node("b-cordoned", unschedulable=True),
    make_node("c-tainted", taints=[{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]),
    make_node("d-other-pool", labels={"pool": "other"}),
    make_node("e-small", gpus=1),
    make_node("f-fits", gpus=4, labels={"pool": "gpu"}),
    make_node("g-also-fits", gpus=4, labels={"pool": "gpu"}),
]


def test_the_first_node_by_name_that_is_ready_schedulable_and_has_room_is_picked() -> None:
    pod = make_pod("p", None, gpu_limit=2)
    pod["spec"]["nodeSelector"] = {"pool": "gpu"}
    assert pick_node(pod, list(reversed(NODES)), {}) == "f-fits"
    # Cards held by pods bound there count, those of finished pods do not.
    bound = {"f-fits": [make_pod("hog", "f-fits", gpu_limit=3)]}
    assert pick_node(pod, NODES, bound) == "g-also-fits"
    bound["f-fits"].append(make_pod("done", "f-fits", gpu_limit=1, phase="Succeeded"))
    assert pick_node(pod, NODES, bound) == "g-also-fits"
    bound["g-also-fits"] = [make_pod("hog2", "g-also-fits", gpu_limit=3)]
    why = pick_node(pod, NODES, bound)
    assert why == Unschedulable(
        "0/7 nodes are available: 1 node(s) had untolerated taint {dedicated: x}, "
        "1 node(s) had untolerated taint {node.kubernetes.io/not-ready: }, "
        "1 node(s) were unschedulable, 2 Insufficient nvidia.com/gpu, "
        "2 node(s) didn't match Pod's node affinity/selector."
    )
    # Without a nodeSelector any node with room does; a toleration opens the tainted one.
    assert pick_node(make_pod("any", None, gpu_limit=1), NODES, {}) == "d-other-pool"
    tolerant = make_pod("t", None, gpu_limit=1)
    tolerant["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    assert pick_node(tolerant, NODES, {}) == "c-tainted"
    # cpu counts too: a sidecar runs beside the app containers.
    hungry = make_pod("h", None, cpu="5", init_containers=[{"cpu": "4"}])
    hungry["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    assert pick_node(hungry, [make_node("n", cpu="8")], {}) == Unschedulable(
        "0/1 nodes are available: 1 Insufficient cpu."
    )


def test_a_pod_security_refusal_is_a_replica_failure(kube: KubeStandin) -> None:
    kube.add_namespace(NS, labels={"pod-security.kubernetes.io/enforce": "baseline"})
    kube.add_node(make_node("gpu-1", gpus=4))
    privileged = deployment(gpus=1)
    container = privileged["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"] = {"privileged": True}
    kube.create("deployments", privileged)

    assert kube.pods(NS) == []
    dep = stored(kube)
    assert conditions(dep)["ReplicaFailure"] == ("True", "FailedCreate")
    (failure,) = [c for c in dep["status"]["conditions"] if c["type"] == "ReplicaFailure"]
    assert 'violates PodSecurity "baseline:latest"' in failure["message"]


# --- the product page: scale the model server down and the cards show up --------------------------


def _plan_free_cards(kube: KubeStandin) -> list[tuple[str, int]]:
    settings = PoolSettings(name="gpu", namespace="levers9", image="worker:1")
    plan = plan_objects(settings, kube.objects("nodes"), kube.pods(), kube.jobs(), [], time.time())
    return [(m.node, m.cards.free) for m in plan.machines]


def test_scaling_the_model_server_down_frees_its_cards_for_the_planner(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.add_node(make_node("gpu-1", gpus=4))
    kube.add_namespace(NS)
    apply(kubeconfig, deployment(replicas=1, gpus=4))
    assert [p["spec"]["nodeName"] for p in kube.pods(NS)] == ["gpu-1"]
    assert _plan_free_cards(kube) == []  # the node is full: no machine

    kubectl(kubeconfig, "scale", "deployment", "model-server", "--replicas=0", "-n", NS)

    assert kube.pods(NS) == []
    assert _plan_free_cards(kube) == [("gpu-1", 4)]


async def test_a_pool_gets_a_worker_for_the_cards_the_scaled_down_model_server_frees(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.add_node(gpu_node("node-1", gpus=4))
    kube.add_namespace(NS)
    kube.create("deployments", deployment(replicas=1, gpus=4))
    async with reconciler(kube) as r:
        await until(r, lambda: bool(r.status.skipped))
        (full,) = r.status.skipped
        assert (full.node, full.reason) == ("node-1", "node is full: other pods hold every card")
        await r.reconcile_once()
        assert kube.jobs() == []

        scale = ["scale", "deployment", "model-server", "--replicas=0", "-n", NS]
        await trio.run_process([kubectl_binary(), "--kubeconfig", str(kubeconfig), *scale])
        await until(r, lambda: bool(kube.jobs()))
        (job,) = kube.jobs()
        assert gpu_request(job) == "4"
        assert job_node(job) == "node-1"


@needs_root
async def test_the_simulated_kubelet_counts_a_deployment_pod_as_a_neighbour(
    kube: KubeStandin, tmp_path: Path
) -> None:
    async with open_cluster(kube, tmp_path, SimNode("gpu-a", 3)) as cluster:
        kube.add_namespace(NS)
        kube.create("deployments", deployment(replicas=1, gpus=1))
        (pod,) = kube.pods(NS)
        assert pod["spec"]["nodeName"] == "gpu-a"

        name = await cluster.submit("gpu-a", 2)
        info = await cluster.worker_info(name)

        assert [card.uuid for card in info.cards] == uuids(1, 2)


# --- Helm: deploy/deploy.sh's command -------------------------------------------------------------


def _helm_env(kubeconfig: Path, home: Path) -> dict[str, str]:
    return {
        "PATH": f"{HELM.parent}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "KUBECONFIG": str(kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }


def helm(kubeconfig: Path, home: Path, *args: str) -> str:
    done = subprocess.run(
        [str(HELM), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_helm_env(kubeconfig, home),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def deploy(kubeconfig: Path, home: Path, *values: Path, sets: tuple[str, ...] = ()) -> str:
    """deploy/deploy.sh with these values files: `helm upgrade --install levers9 deploy/chart
    -n levers9-control --create-namespace -f ...`."""
    argv = [str(DEPLOY_SH)]
    for path in values:
        argv += ["-f", str(path)]
    for item in sets:
        argv += ["--set", item]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        env=_helm_env(kubeconfig, home),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_deploy_sh_installs_and_upgrades_the_chart_and_helm_uninstalls_it(
    kube: KubeStandin, kubeconfig: Path, tmp_path: Path
) -> None:
    kube.add_node(make_node("cpu-1", gpus=0, cpu="4", memory="16Gi"))
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "config": {
                    "publicUrl": "https://levers9.example.com",
                    "worker": {
                        "pools": [
                            {
                                "name": "local-gpus",
                                "provider": "kubernetes",
                                "kubernetes": {
                                    "inCluster": True,
                                    "flavor": "generic",
                                    "namespace": "levers9-workers",
                                    "selector": {"nvidia.com/gpu.present": "true"},
                                    "image": "registry.example.com/levers9/worker:1",
                                },
                            }
                        ]
                    },
                },
                "tls": {"secretName": "levers9-tls"},
                "rbac": {"createWorkerNamespaces": True},
            }
        )
    )
    home = tmp_path / "home"

    assert "STATUS: deployed" in deploy(kubeconfig, home, values)
    dep = stored(kube, FULLNAME, CONTROL_NS)
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    (pod,) = pods_of(kube, FULLNAME, CONTROL_NS)
    assert (pod["spec"]["nodeName"], pod["status"]["phase"]) == ("cpu-1", "Running")
    listed = kubectl(kubeconfig, "get", "cm,svc,pvc,pdb,deploy,sa,secret", "-n", CONTROL_NS)
    for shown in (
        f"configmap/{FULLNAME}-config",
        f"service/{FULLNAME}",
        f"persistentvolumeclaim/{FULLNAME}-data",
        f"deployment.apps/{FULLNAME}",
        f"serviceaccount/{FULLNAME}",
        f"secret/{FULLNAME}-secret",
        f"secret/sh.helm.release.v1.{RELEASE}.v1",
    ):
        assert shown in listed
    for namespace in (CONTROL_NS, "levers9-workers"):  # --create-namespace, the chart's own
        assert "Active" in kubectl(kubeconfig, "get", "namespace", namespace)
    assert kube.get("roles", f"{FULLNAME}-workers", "levers9-workers") is not None

    # The same values again: an upgrade with nothing to change.
    assert "REVISION: 2" in deploy(kubeconfig, home, values)
    assert [p["metadata"]["name"] for p in pods_of(kube, FULLNAME, CONTROL_NS)] == [
        pod["metadata"]["name"]
    ]

    # Two replicas on PostgreSQL, a new image: strategic merge patches of the Deployment (its
    # strategy's keys retained, the claim's volume deleted), a PodDisruptionBudget and a Role.
    ha = tmp_path / "ha.yaml"
    ha.write_text(
        yaml.safe_dump(
            {
                "replicaCount": 2,
                "config": {"database": {"url": "postgresql://levers9@pg.example:5432/levers9"}},
                "secretConfig": {"replication": {"secret": "0123456789abcdef" * 4}},
            }
        )
    )
    assert "REVISION: 3" in deploy(kubeconfig, home, values, ha, sets=("image.tag=2.0.0",))
    dep = stored(kube, FULLNAME, CONTROL_NS)
    spec = dep["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    template = spec["template"]["spec"]
    assert [v["name"] for v in template["volumes"]] == ["config", "secret", "tls", "tmp"]
    (container,) = template["containers"]
    assert container["image"] == "levers9/control:2.0.0"
    assert [m["name"] for m in container["volumeMounts"]] == ["config", "secret", "tls", "tmp"]
    assert container["args"][:2] == ["--config", "/etc/levers9/config/config.yaml"]
    pods = pods_of(kube, FULLNAME, CONTROL_NS)
    assert len(pods) == 2 and pod["metadata"]["name"] not in {p["metadata"]["name"] for p in pods}
    assert {p["spec"]["containers"][0]["image"] for p in pods} == {"levers9/control:2.0.0"}
    assert (dep["status"]["readyReplicas"], dep["status"]["observedGeneration"]) == (2, 2)
    budget = kube.get("poddisruptionbudgets", FULLNAME, CONTROL_NS)
    assert budget is not None and budget["spec"]["maxUnavailable"] == 1
    assert "poddisruptionbudget.policy/" + FULLNAME in kubectl(
        kubeconfig, "get", "pdb", "-n", CONTROL_NS, "-o", "name"
    )
    assert kube.get("roles", f"{FULLNAME}-leader-election", CONTROL_NS) is not None

    assert "uninstalled" in helm(kubeconfig, home, "uninstall", RELEASE, "-n", CONTROL_NS)
    assert kube.objects("deployments") == []
    assert pods_of(kube, FULLNAME, CONTROL_NS) == []
    assert kube.secrets(CONTROL_NS) == []  # the release's records too
    assert kube.get("poddisruptionbudgets", FULLNAME, CONTROL_NS) is None
    # Kept by their resource policy: the task database's claim and the worker namespace.
    assert kube.get("persistentvolumeclaims", f"{FULLNAME}-data", CONTROL_NS) is not None
    assert kube.get("namespaces", "levers9-workers") is not None


def test_the_gke_recipe_creates_its_namespace_and_tls_secret(
    kube: KubeStandin, kubeconfig: Path, tmp_path: Path
) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=levers9.example.com", "-keyout", str(key), "-out", str(cert)),
        ],
        capture_output=True,
        check=True,
    )
    kubectl(kubeconfig, "create", "namespace", CONTROL_NS)
    out = kubectl(
        kubeconfig,
        "create",
        "secret",
        "tls",
        "levers9-tls",
        "--cert",
        str(cert),
        "--key",
        str(key),
        "-n",
        CONTROL_NS,
    )
    assert "secret/levers9-tls created" in out
    secret = kube.get("secrets", "levers9-tls", CONTROL_NS)
    assert secret is not None and secret["type"] == "kubernetes.io/tls"
    assert sorted(secret["data"]) == ["tls.crt", "tls.key"]
    assert "Active" in kubectl(kubeconfig, "get", "namespace", CONTROL_NS)


# --- strategic merge patches ----------------------------------------------------------------------


def test_a_strategic_merge_patch_merges_lists_by_their_keys_and_obeys_its_directives() -> None:
    current: dict[str, Any] = {
        "metadata": {"finalizers": ["a"]},
        "spec": {
            "strategy": {"type": "Recreate"},
            "containers": [
                {"name": "app", "image": "app:1", "ports": [{"containerPort": 80}]},
                {"name": "sidecar", "image": "side:1"},
            ],
            "volumes": [{"name": "data", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
            "tolerations": [{"key": "x", "operator": "Exists"}],
        },
    }
    patch = {
        "metadata": {"finalizers": ["b"]},
        "spec": {
            "strategy": {
                "$retainKeys": ["rollingUpdate", "type"],
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1},
            },
            "$setElementOrder/containers": [{"name": "sidecar"}, {"name": "app"}],
            "containers": [{"name": "app", "image": "app:2"}],
            "volumes": [{"$patch": "delete", "name": "data"}],
            "tolerations": [{"key": "y", "operator": "Exists"}],
        },
    }
    patched = strategic_merge_patch(current, patch)
    assert patched == {
        "metadata": {"finalizers": ["a", "b"]},
        "spec": {
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}},
            "containers": [
                {"name": "sidecar", "image": "side:1"},
                {"name": "app", "image": "app:2", "ports": [{"containerPort": 80}]},
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            "tolerations": [{"key": "y", "operator": "Exists"}],
        },
    }
    assert current["spec"]["containers"][0]["image"] == "app:1"  # not changed in place
