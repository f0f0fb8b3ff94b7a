"""The reconcile planner over API-shaped nodes, pods and Jobs (pure: no cluster needed)."""

from __future__ import annotations

import datetime
import re
from typing import Any

import pytest

from control.kube.manifests import (
    PoolSettings,
    job_manifest,
    job_name,
    token_secret_name,
    with_job_uid,
)
from control.kube.planner import (
    CreateJob,
    CreateSecret,
    DeleteJob,
    Machine,
    NotAMachine,
    Resources,
    WorkerRecord,
    node_facts,
    pod_facts,
    pod_request,
)
from control.kube.planner import machine_of as machine_of_facts
from control.kube.quantities import cpu_millis, memory_bytes
from control.kube.selectors import Selector, label_selector_text, selector_matches
from control.models import WorkerState
from tests.planning import plan_objects
from wire.errors import ApiError

NOW = 1_700_000_000.0
plan_pool = plan_objects


def machine_of(node: dict[str, Any], pods: list[dict[str, Any]], *args: Any, **kw: Any) -> Any:
    """`machine_of` over the API's objects, through the facts a cache keeps of them."""
    facts = [f for f in map(pod_facts, pods) if f is not None]
    return machine_of_facts(node_facts(node), facts, *args, **kw)


SETTINGS = PoolSettings(name="gke-a100", namespace="levers9", image="worker:latest")
GKE_LABEL = "cloud.google.com/gke-accelerator"


def node(
    name: str = "n1",
    *,
    gpus: int = 4,
    ready: bool = True,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {GKE_LABEL: "nvidia-tesla-a100", **(labels or {})},
        },
        "spec": {"unschedulable": unschedulable, "taints": taints or []},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "8", "memory": "32Gi"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pod(
    node_name: str | None = "n1",
    *,
    gpus: int = 0,
    cpu: str = "0",
    memory: str = "0",
    phase: str = "Running",
    ours: bool = False,
    job: str | None = None,
) -> dict[str, Any]:
    labels = (
        {"app.kubernetes.io/name": "levers9-worker", "app.kubernetes.io/managed-by": "levers9"}
        if ours
        else {}
    )
    if job is not None:
        labels["batch.kubernetes.io/job-name"] = labels["job-name"] = job
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "resources": {
                    "limits": {"nvidia.com/gpu": str(gpus)},
                    "requests": {"cpu": cpu, "memory": memory},
                },
            }
        ]
    }
    if node_name is not None:
        spec["nodeName"] = node_name
    return {"metadata": {"labels": labels}, "spec": spec, "status": {"phase": phase}}


def job_for(node_name: str, generation: int, **status: Any) -> dict[str, Any]:
    manifests = job_manifest(
        SETTINGS,
        node_name,
        1,
        job_name(SETTINGS.name, node_name, generation),
        "secret",
        "https://cp.example",
        token="t0ken",
        generation=generation,
    )
    job = manifests.job
    job["metadata"]["creationTimestamp"] = "2023-11-14T22:10:00Z"
    job["status"] = status
    return job


# --- quantities -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "millis"),
    [("500m", 500), ("2", 2000), ("1.5", 1500), ("0.1", 100), ("100u", 1), ("1k", 1_000_000)],
)
def test_cpu_quantities(text: str, millis: int) -> None:
    assert cpu_millis(text) == millis


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1Gi", 1 << 30),
        ("512Mi", 512 << 20),
        ("1G", 10**9),
        ("100M", 10**8),
        ("1e3", 1000),
        ("1E3", 1000),
        ("1E", 10**18),
        ("12345", 12345),
        ("1.5Ki", 1536),
        ("1k", 1000),
        ("+2Ti", 2 << 40),
        ("500m", 1),
    ],
)
def test_memory_quantities(text: str, size: int) -> None:
    assert memory_bytes(text) == size


@pytest.mark.parametrize("text", ["", "1K", "Gi", "1.2.3", "1Gb", "1e", "abc", "1 Gi x"])
def test_bad_quantities_name_the_value(text: str) -> None:
    with pytest.raises(ApiError) as raised:
        memory_bytes(text)
    assert repr(text) in raised.value.message


# --- pod requests ---------------------------------------------------------------------------


def _container(cpu: str, memory: str, gpus: int = 0, **extra: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    return {"name": "c", "resources": resources, **extra}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # App containers add up.
        (
            {"containers": [_container("1", "1Gi", 1), _container("500m", "1Gi", 1)]},
            Resources(2, 1500, 2 << 30),
        ),
        # A big init container sets the floor.
        (
            {
                "initContainers": [_container("4", "1Gi")],
                "containers": [_container("1", "2Gi"), _container("1", "1Gi")],
            },
            Resources(0, 4000, 3 << 30),
        ),
        # Overhead comes on top.
        (
            {
                "containers": [_container("1", "1Gi")],
                "overhead": {"cpu": "250m", "memory": "120Mi"},
            },
            Resources(0, 1250, (1 << 30) + (120 << 20)),
        ),
        # A sidecar runs beside the app containers and under later init containers.
        (
            {
                "initContainers": [
                    _container("1", "1Gi", restartPolicy="Always"),
                    _container("3", "1Gi"),
                ],
                "containers": [_container("1", "1Gi")],
            },
            Resources(0, 4000, 2 << 30),
        ),
        # GPUs from requests when no limit is given.
        (
            {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "2"}}}]},
            Resources(2, 0, 0),
        ),
    ],
)
def test_pod_request(spec: dict[str, Any], expected: Resources) -> None:
    assert pod_request({"spec": spec}) == expected


# --- machines -------------------------------------------------------------------------------


def test_neighbour_holding_two_of_four_leaves_a_two_card_machine() -> None:
    machine = machine_of(node(), [pod(gpus=2, cpu="2", memory="4Gi")], None, pool="p")
    assert isinstance(machine, Machine)
    assert (machine.cards.total, machine.cards.others, machine.cards.free) == (4, 2, 2)
    assert machine.cpu_free_millis == 6000
    assert machine.memory_free_bytes == 28 << 30
    assert machine.to_json()["gpuModel"] == "nvidia-tesla-a100"


def test_finished_and_foreign_pods_do_not_count() -> None:
    pods = [
        pod(gpus=2, phase="Succeeded"),
        pod(gpus=2, phase="Failed"),
        pod("other-node", gpus=4),
        pod(gpus=1, phase="Pending"),
    ]
    machine = machine_of(node(), pods, None)
    assert isinstance(machine, Machine)
    assert machine.cards.free == 3


def test_neighbour_scaling_down_grows_the_machine() -> None:
    before = machine_of(node(), [pod(gpus=3)], None)
    after = machine_of(node(), [pod(gpus=1)], None)
    assert isinstance(before, Machine) and isinstance(after, Machine)
    assert (before.cards.free, after.cards.free) == (1, 3)


def test_our_worker_counts_as_ours() -> None:
    machine = machine_of(node(), [pod(gpus=3, ours=True), pod(gpus=1)], None)
    assert isinstance(machine, Machine)
    assert (machine.cards.ours, machine.cards.others, machine.cards.free) == (3, 1, 0)


@pytest.mark.parametrize(
    ("the_node", "pods", "reason"),
    [
        (node(), [pod(gpus=4)], "full"),
        (node(ready=False), [], "not Ready"),
        (node(unschedulable=True), [], "cordoned"),
        (node(taints=[{"key": "dedicated", "effect": "NoSchedule"}]), [], "dedicated"),
        (node(gpus=0), [], "no allocatable"),
    ],
)
def test_not_a_machine(the_node: dict[str, Any], pods: list[Any], reason: str) -> None:
    result = machine_of(the_node, pods, None)
    assert isinstance(result, NotAMachine)
    assert reason in result.reason


def test_gpu_taint_is_tolerated_by_default() -> None:
    tainted = node(taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    assert isinstance(machine_of(tainted, [], None), Machine)


# --- selectors ------------------------------------------------------------------------------


def test_selector_by_gpu_label_and_by_node_pool() -> None:
    a100 = {GKE_LABEL: "nvidia-tesla-a100", "cloud.google.com/gke-nodepool": "gpu-a"}
    l4 = {GKE_LABEL: "nvidia-l4", "cloud.google.com/gke-nodepool": "gpu-b"}
    by_gpu = Selector(labels={GKE_LABEL: "nvidia-tesla-a100"})
    by_pool = Selector(
        expressions=(
            {"key": "cloud.google.com/gke-nodepool", "operator": "In", "values": ["gpu-b"]},
        )
    )
    assert selector_matches(a100, by_gpu) and not selector_matches(l4, by_gpu)
    assert selector_matches(l4, by_pool) and not selector_matches(a100, by_pool)


@pytest.mark.parametrize(
    ("expression", "matches"),
    [
        ({"key": "zone", "operator": "NotIn", "values": ["b"]}, True),
        ({"key": "zone", "operator": "NotIn", "values": ["a"]}, False),
        ({"key": "zone", "operator": "Exists"}, True),
        ({"key": "spot", "operator": "Exists"}, False),
        ({"key": "spot", "operator": "DoesNotExist"}, True),
    ],
)
def test_selector_expressions(expression: dict[str, Any], matches: bool) -> None:
    assert selector_matches({"zone": "a"}, Selector(expressions=(expression,))) is matches


def test_label_selector_text() -> None:
    selector = Selector(
        labels={"b": "2", "a": "1"},
        expressions=(
            {"key": "zone", "operator": "In", "values": ["y", "x"]},
            {"key": "tier", "operator": "NotIn", "values": ["spot"]},
            {"key": "gpu", "operator": "Exists"},
            {"key": "old", "operator": "DoesNotExist"},
        ),
    )
    assert label_selector_text(selector) == "a=1,b=2,zone in (x,y),tier notin (spot),gpu,!old"


def test_unknown_operator_is_refused() -> None:
    with pytest.raises(ApiError, match="Gt"):
        selector_matches({}, Selector(expressions=({"key": "k", "operator": "Gt"},)))


# --- the plan -------------------------------------------------------------------------------


def _creates(actions: tuple[Any, ...]) -> list[CreateJob]:
    return [a for a in actions if isinstance(a, CreateJob)]


def _deletes(actions: tuple[Any, ...]) -> list[DeleteJob]:
    return [a for a in actions if isinstance(a, DeleteJob)]


def test_free_cards_and_no_worker_create_one_job_for_them() -> None:
    plan = plan_pool(SETTINGS, [node()], [pod(gpus=2)], [], [], NOW)
    assert _creates(plan.actions) == [CreateJob("n1", 2, job_name(SETTINGS.name, "n1", 0), 0, "n1")]
    assert plan.machines[0].worker is None


def test_full_node_gets_no_job() -> None:
    plan = plan_pool(SETTINGS, [node()], [pod(gpus=4)], [], [], NOW)
    assert plan.actions == ()
    assert plan.machines == () and "full" in plan.skipped[0].reason


def test_our_pending_worker_prevents_a_second_job() -> None:
    # The Job exists; its pod is not scheduled yet, so it holds no cards.
    plan = plan_pool(
        SETTINGS,
        [node()],
        [pod(None, gpus=4, ours=True, phase="Pending")],
        [job_for("n1", 0)],
        [],
        NOW,
    )
    assert plan.actions == ()
    worker = plan.machines[0].worker
    assert worker is not None and worker.state == "pending"


def test_worker_pod_still_terminating_prevents_a_new_job() -> None:
    plan = plan_pool(SETTINGS, [node()], [pod(gpus=2, ours=True)], [], [], NOW)
    assert _creates(plan.actions) == []


def test_selector_filters_nodes() -> None:
    settings = PoolSettings(
        name="p",
        namespace="ns",
        image="i",
        selector=Selector(labels={"cloud.google.com/gke-nodepool": "gpu-a"}),
    )
    nodes = [
        node("a", labels={"cloud.google.com/gke-nodepool": "gpu-a"}),
        node("b", labels={"cloud.google.com/gke-nodepool": "gpu-b"}),
    ]
    plan = plan_pool(settings, nodes, [], [], [], NOW)
    assert [m.node for m in plan.machines] == ["a"]
    assert [c.node for c in _creates(plan.actions)] == ["a"]


@pytest.mark.parametrize(
    "changed",
    [node(ready=False), node(unschedulable=True), None],
    ids=["not-ready", "cordoned", "deleted"],
)
def test_job_on_a_node_that_stopped_being_a_machine_is_deleted(
    changed: dict[str, Any] | None,
) -> None:
    job = job_for("n1", 0)
    nodes = [] if changed is None else [changed]
    plan = plan_pool(SETTINGS, nodes, [pod(gpus=1, ours=True)], [job], [], NOW)
    assert [d.name for d in _deletes(plan.actions)] == [job["metadata"]["name"]]
    assert _creates(plan.actions) == []


def not_ready_since(seconds_ago: float) -> dict[str, Any]:
    changed = node(ready=False)
    stamp = datetime.datetime.fromtimestamp(NOW - seconds_ago, datetime.UTC)
    changed["status"]["conditions"][0]["lastTransitionTime"] = stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
    return changed


def test_a_node_not_ready_for_less_than_the_grace_keeps_its_worker_but_is_no_machine() -> None:
    job = job_for("n1", 0)
    plan = plan_pool(SETTINGS, [not_ready_since(30)], [pod(gpus=1, ours=True)], [job], [], NOW)
    assert plan.actions == ()
    assert [(n.node, n.reason) for n in plan.skipped] == [("n1", "node is not Ready")]
    # Past the grace (as long as Kubernetes' pods tolerate not-ready), the worker goes.
    plan = plan_pool(SETTINGS, [not_ready_since(301)], [pod(gpus=1, ours=True)], [job], [], NOW)
    assert [d.name for d in _deletes(plan.actions)] == [job["metadata"]["name"]]


def test_facts_are_equal_when_the_rules_read_the_same() -> None:
    before = node()
    heartbeat = node()
    heartbeat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-12-03T10:00:00Z"
    heartbeat["metadata"]["labels"]["unrelated"] = "label"
    assert node_facts(heartbeat, keep_labels=()) == node_facts(before, keep_labels=())
    assert node_facts(node(gpus=8)) != node_facts(before)
    assert node_facts(node(ready=False)) != node_facts(before)
    running = pod(gpus=1)
    conditions = pod(gpus=1)
    conditions["status"]["conditions"] = [{"type": "ContainersReady", "status": "True"}]
    assert pod_facts(conditions) == pod_facts(running)
    assert pod_facts(pod(gpus=1, phase="Succeeded")) != pod_facts(running)
    assert pod_facts(pod(None, gpus=1)) is None  # not bound: holds nothing


def test_expired_record_deletes_its_job_then_next_generation_follows() -> None:
    name0 = job_name(SETTINGS.name, "n1", 0)
    record = WorkerRecord(
        name0, "n1", WorkerState.READY, created_at=NOW - 3600, last_heartbeat=NOW - 601
    )
    first = plan_pool(
        SETTINGS, [node()], [pod(gpus=4, ours=True)], [job_for("n1", 0)], [record], NOW
    )
    assert [d.name for d in _deletes(first.actions)] == [name0]
    assert _creates(first.actions) == []
    # Job and pod gone; the expired record is still known.
    later = plan_pool(SETTINGS, [node()], [], [], [record], NOW + 30)
    assert _creates(later.actions) == [
        CreateJob("n1", 4, job_name(SETTINGS.name, "n1", 1), 1, "n1")
    ]


def test_fresh_heartbeat_keeps_the_job() -> None:
    name0 = job_name(SETTINGS.name, "n1", 0)
    record = WorkerRecord(
        name0, "n1", WorkerState.READY, created_at=NOW - 3600, last_heartbeat=NOW - 30
    )
    plan = plan_pool(
        SETTINGS, [node()], [pod(gpus=4, ours=True)], [job_for("n1", 0)], [record], NOW
    )
    assert plan.actions == ()
    worker = plan.machines[0].worker
    assert worker is not None and (worker.state, worker.age_seconds) == ("ready", 3600)


def test_a_second_job_on_a_node_is_deleted_and_the_one_holding_cards_stays() -> None:
    older, newer = job_for("n1", 0), job_for("n1", 1)
    keeper = newer["metadata"]["name"]
    pods = [
        pod(gpus=4, ours=True, job=keeper),
        pod(gpus=4, ours=True, phase="Pending", job=older["metadata"]["name"]),
    ]
    plan = plan_pool(SETTINGS, [node()], pods, [older, newer], [], NOW)
    (delete,) = _deletes(plan.actions)
    assert delete.name == older["metadata"]["name"]
    assert delete.node == "n1"
    assert delete.reason == f"surplus worker on n1: {keeper} holds its cards"
    assert _creates(plan.actions) == []
    worker = plan.machines[0].worker
    assert worker is not None and worker.state == "pending"


def test_of_two_jobs_with_no_pod_yet_the_registered_one_stays_else_the_older() -> None:
    older, newer = job_for("n1", 0), job_for("n1", 1)
    registered = WorkerRecord(
        newer["metadata"]["name"], "n1", WorkerState.READY, NOW - 60, last_heartbeat=NOW - 5
    )
    plan = plan_pool(SETTINGS, [node()], [], [older, newer], [registered], NOW)
    assert [d.name for d in _deletes(plan.actions)] == [older["metadata"]["name"]]
    assert "has registered" in _deletes(plan.actions)[0].reason
    plan = plan_pool(SETTINGS, [node()], [], [newer, older], [], NOW)
    assert [d.name for d in _deletes(plan.actions)] == [newer["metadata"]["name"]]
    assert "is older" in _deletes(plan.actions)[0].reason


def test_a_held_node_gets_no_action_and_the_others_go_on() -> None:
    job = job_for("n2", 0)
    plan = plan_pool(
        SETTINGS, [node("n1"), node("n3")], [], [job], [], NOW, held={"n1", "n2", "n9"}
    )
    # n1 would get a worker and n2's Job would go (its node is gone): both held; n3 goes on.
    assert [c.node for c in _creates(plan.actions)] == ["n3"]
    assert _deletes(plan.actions) == []
    assert plan.held == ("n1", "n2")
    assert [m.node for m in plan.machines] == ["n1", "n3"]


def test_a_job_whose_secret_is_missing_gets_it_again_where_its_token_is_held() -> None:
    job = job_for("n1", 0)
    name = job["metadata"]["name"]
    pods = [pod(gpus=4, ours=True, job=name)]
    plan = plan_pool(SETTINGS, [node()], pods, [job], [], NOW, secrets=set(), tokens={name})
    assert plan.actions == (CreateSecret(name, "n1"),)
    # Not without the token (another replica started it), nor where the Secret is there.
    assert plan_pool(SETTINGS, [node()], pods, [job], [], NOW, secrets=set()).actions == ()
    secrets = {token_secret_name(name)}
    plan = plan_pool(SETTINGS, [node()], pods, [job], [], NOW, secrets=secrets, tokens={name})
    assert plan.actions == ()


def test_finished_job_is_followed_by_the_next_generation() -> None:
    done = job_for("n1", 3, succeeded=1)
    plan = plan_pool(SETTINGS, [node()], [], [done], [], NOW)
    assert [c.name for c in _creates(plan.actions)] == [job_name(SETTINGS.name, "n1", 4)]


@pytest.mark.parametrize(
    ("pool", "node_name"),
    [
        ("gke-a100", "gke-cluster-gpu-pool-1a2b3c4d-x7k9"),
        ("A_Very_Long_Pool_Name_Indeed_With_Caps", "ip-10-0-1-2.us-west-2.compute.internal"),
        ("p", "n" * 253),
        ("", "---"),
    ],
)
def test_names_are_deterministic_valid_and_distinct(pool: str, node_name: str) -> None:
    name = job_name(pool, node_name, 12)
    assert name == job_name(pool, node_name, 12)
    assert len(name) <= 63
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name)
    assert name != job_name(pool, node_name + "x", 12)
    assert name != job_name(pool, node_name, 13)


# --- the manifest ---------------------------------------------------------------------------


def _env(job: dict[str, Any]) -> dict[str, Any]:
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_tunnel_manifest_without_host_network() -> None:
    settings = PoolSettings(name="p", namespace="ns", image="img", tunnel=True, host_network=False)
    name = job_name("p", "n1", 0)
    manifests = job_manifest(
        settings, "n1", 2, name, token_secret_name(name), "https://cp", token="s3cret"
    )
    pod_spec = manifests.job["spec"]["template"]["spec"]
    assert pod_spec["hostNetwork"] is False and "dnsPolicy" not in pod_spec
    env = _env(manifests.job)
    assert env["LEVERS9_MODE"] == "tunnel"
    assert env["LEVERS9_WORKER_TOKEN"] == {
        "secretKeyRef": {"name": token_secret_name(name), "key": "token"}
    }
    assert "s3cret" not in str(manifests.job) and "s3cret" not in repr(manifests)


def test_direct_manifest() -> None:
    name = job_name(SETTINGS.name, "n1", 0)
    manifests = job_manifest(
        SETTINGS, "n1", 3, name, "tok", "https://cp", token="s3cret", hostname="n1-host"
    )
    job = manifests.job
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    labels = job["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "levers9-worker"
    assert labels["app.kubernetes.io/managed-by"] == "levers9"
    assert (labels["levers9.dev/pool"], labels["levers9.dev/node"]) == (SETTINGS.name, "n1")
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["hostNetwork"] is True
    assert pod_spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod_spec["nodeSelector"] == {"kubernetes.io/hostname": "n1-host"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod_spec["tolerations"]
    # Time for the agent to stop its containers (each with its own grace) before SIGKILL.
    assert pod_spec["terminationGracePeriodSeconds"] >= 30
    container = pod_spec["containers"][0]
    assert container["securityContext"]["privileged"] is True
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "3"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "3"
    paths = {v["hostPath"]["path"] for v in pod_spec["volumes"]}
    assert {
        "/var/lib/levers9",
        "/dev",
        SETTINGS.driver_path,
        "/var/lib/kubelet/pod-resources",
    } <= paths
    env = _env(job)
    assert env["LEVERS9_MODE"] == "direct"
    assert env["LEVERS9_WORKER_ID"] == name
    assert env["LEVERS9_CONTROLPLANE_URL"] == "https://cp"
    assert env["LEVERS9_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["LEVERS9_STATE_DIR"] == "/var/lib/levers9"
    assert env["LEVERS9_GPU_DRIVER_DIR"] == SETTINGS.driver_path
    secret = with_job_uid(manifests.secret, "uid-1")
    assert secret["stringData"] == {"token": "s3cret"}
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", name, "uid-1")


def test_direct_mode_without_host_network_is_refused() -> None:
    settings = PoolSettings(name="p", namespace="ns", image="i", host_network=False)
    with pytest.raises(ApiError) as raised:
        job_manifest(settings, "n1", 1, "j", "s", "https://cp", token="x")
    assert raised.value.field == "hostNetwork"


def test_planned_job_round_trips_through_its_manifest() -> None:
    # A Job built from the plan is recognised by the next pass as that node's worker.
    plan = plan_pool(SETTINGS, [node()], [], [], [], NOW)
    create = _creates(plan.actions)[0]
    job = job_manifest(
        SETTINGS,
        create.node,
        create.cards,
        create.name,
        "s",
        "https://cp",
        token="x",
        generation=create.generation,
        hostname=create.hostname,
    ).job
    again = plan_pool(SETTINGS, [node()], [], [job], [], NOW)
    assert again.actions == ()


def test_a_retired_idle_worker_is_deleted_and_its_node_waits_for_its_pod_to_go() -> None:
    # Our 2-card worker on a 4-card node whose other 2 cards are free now.
    job = job_for("n1", 0)
    name = job["metadata"]["name"]
    pods = [pod(gpus=2, ours=True, job=name)]
    kept = plan_pool(SETTINGS, [node()], pods, [job], [], NOW)
    assert kept.actions == ()
    assert kept.machines[0].worker is not None and kept.machines[0].worker.name == name

    why = "retired while idle: task t1 asks 3 cards"
    plan = plan_pool(SETTINGS, [node()], pods, [job], [], NOW, retire={name: why})
    assert plan.actions == (DeleteJob(name, why, "n1"),)
    # While its pod holds the 2 cards no next worker is made for the other 2 alone.
    worker = plan.machines[0].worker
    assert worker is not None and worker.state == "stopping"
    # Once the pod is gone, the next one takes all 4.
    record = WorkerRecord(name, "n1", WorkerState.READY, NOW - 60, last_heartbeat=NOW - 5)
    after = plan_pool(SETTINGS, [node()], [], [], [record], NOW, retire={name: why})
    assert [(c.name, c.cards) for c in _creates(after.actions)] == [
        (job_name(SETTINGS.name, "n1", 1), 4)
    ]
