"""The simulated kubelet runs worker Jobs as real agent processes on simulated GPU nodes.

Jobs are the controlplane's own manifests (`job_manifest`), created through the Kubernetes
stand-in Job first, token Secret after, as the reconcile does. A real controlplane
(`run_controlplane`) is told the worker's token and asked for the worker's own view of itself,
so what is checked is what the agent got: its token, its env and its cards by UUID.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from control.api.server import Controlplane
from control.kube.manifests import (
    PoolSettings,
    job_manifest,
    job_name,
    token_secret_name,
    with_job_uid,
)
from control.kube.planner import CreateJob, pod_request
from nvml.standin import standin_device
from sim.configs import Pki, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.kubeapi.objects import make_pod
from sim.kubeapi.store import KubeStandin
from sim.kubelet import (
    ContainerConfigError,
    SimNode,
    SimulatedKubelet,
    exit_code,
    place_neighbours,
    pod_gpus,
    resolve_env,
)
from tests.planning import plan_objects
from workerapi.models import WorkerInfo

pytest_plugins = ["tests.kube_fixtures"]

NAMESPACE = "levers9"
POOL = "gpu"
SETTINGS = PoolSettings(name=POOL, namespace=NAMESPACE, image="registry.example.test/worker:1")
AGENT_ENV = {
    "LEVERS9_CONTAINERS": "off",
    "LEVERS9_LOG_LEVEL": "WARNING",
    "LEVERS9_REGISTER_INTERVAL_S": "0.5",
}
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the simulated kubelet creates device nodes (mknod)"
)


def uuids(*indexes: int) -> list[str]:
    return [standin_device(i).uuid for i in indexes]


@attrs.frozen
class Cluster:
    kube: KubeStandin
    kubelet: SimulatedKubelet
    control: Controlplane
    pki: Pki

    async def submit(self, node: str, cards: int, *, with_secret: bool = True) -> str:
        """Creates a worker Job for `node` as the reconcile does (Job, then its Secret);
        returns the Job's name."""
        name = job_name(POOL, node, 0)
        manifests = job_manifest(
            SETTINGS,
            node,
            cards,
            name,
            token_secret_name(name),
            f"https://127.0.0.1:{self.control.port}",
            token=self.token(name),
            hostname=node,
            extra_env={"LEVERS9_CONTROLPLANE_CA": str(self.pki.ca_file)},
        )
        await self.control.registry.add_worker(name, self.token(name))
        self.kube.create("jobs", manifests.job)
        if with_secret:
            self.add_secret(name)
        return name

    def add_secret(self, name: str) -> None:
        job = self.kube.get("jobs", name, NAMESPACE)
        assert job is not None
        secret = token_secret_name(name)
        manifests = job_manifest(
            SETTINGS, "n", 1, name, secret, "https://x.test", token=self.token(name)
        )
        self.kube.create("secrets", with_job_uid(manifests.secret, job["metadata"]["uid"]))

    @staticmethod
    def token(name: str) -> str:
        return f"token-of-{name}-0123456789"

    async def worker_info(self, name: str) -> WorkerInfo:
        """The agent's answer to GET /v1/worker, through the controlplane, once registered."""
        with trio.fail_after(30):
            client = await self.control.registry.client_for(name)
            return await client.worker()

    def pod_of(self, name: str) -> dict[str, Any]:
        (pod,) = [
            p
            for p in self.kube.pods(NAMESPACE)
            if p["metadata"]["ownerReferences"][0]["name"] == name
        ]
        return pod

    def job(self, name: str) -> dict[str, Any]:
        job = self.kube.get("jobs", name, NAMESPACE)
        assert job is not None, f"Job {name} is gone"
        return job


@asynccontextmanager
async def open_cluster(
    kube: KubeStandin, tmp_path: Path, *nodes: SimNode
) -> AsyncIterator[Cluster]:
    kube.add_namespace(NAMESPACE)
    pki = make_pki(tmp_path)
    async with trio.open_nursery() as nursery:
        control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
        kubelet = SimulatedKubelet(kube, tmp_path / "kubelet", nodes, extra_env=AGENT_ENV)
        await nursery.start(kubelet.run)
        yield Cluster(kube, kubelet, control, pki)
        nursery.cancel_scope.cancel()
    # Cancelling the kubelet has stopped every agent it started.
    assert all(agent.returncode is not None for agent in kubelet.agents())


async def wait_until(condition: Callable[[], bool]) -> None:
    """Polls the stand-in (it has no watch) until `condition` holds; the caller's deadline."""
    while True:
        if condition():
            return
        await trio.sleep(0.05)


@needs_root
async def test_a_job_runs_an_agent_with_its_token_env_and_the_cards_of_its_node(
    kube: KubeStandin, tmp_path: Path
) -> None:
    async with open_cluster(kube, tmp_path, SimNode("gpu-a", 2), SimNode("gpu-b", 3)) as cluster:
        node = kube.get("nodes", "gpu-b")
        assert node is not None
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "3"
        name = await cluster.submit("gpu-b", 3)

        info = await cluster.worker_info(name)

        # The token from the Secret let it register; its id and node came from the Job's env.
        assert info.worker_id == name
        assert info.node == "gpu-b"
        assert [card.uuid for card in info.cards] == uuids(0, 1, 2)
        assert {card.state for card in info.cards} == {"serving"}
        pod = cluster.pod_of(name)
        assert pod["spec"]["nodeName"] == "gpu-b"
        assert pod["status"]["phase"] == "Running"
        assert cluster.job(name)["status"]["active"] == 1
        (agent,) = cluster.kubelet.agents()
        assert (agent.node, agent.cards, agent.returncode) == ("gpu-b", (0, 1, 2), None)


@needs_root
async def test_a_neighbour_holding_one_of_three_cards_leaves_the_worker_the_other_two(
    kube: KubeStandin, tmp_path: Path
) -> None:
    async with open_cluster(kube, tmp_path, SimNode("gpu-a", 3)) as cluster:
        kube.add_pod(make_pod("neighbour", "gpu-a", gpu_limit=1))
        name = await cluster.submit("gpu-a", 2)

        info = await cluster.worker_info(name)

        assert [card.uuid for card in info.cards] == uuids(1, 2)
        (agent,) = cluster.kubelet.agents()
        assert agent.uuids == tuple(uuids(1, 2))


@needs_root
async def test_a_pod_waits_for_free_cards_and_for_its_token_secret(
    kube: KubeStandin, tmp_path: Path
) -> None:
    async with open_cluster(kube, tmp_path, SimNode("gpu-a", 2)) as cluster:
        kube.add_pod(make_pod("neighbour", "gpu-a", gpu_limit=1))
        name = await cluster.submit("gpu-a", 2, with_secret=False)
        with trio.fail_after(10):
            await wait_until(lambda: any(True for _ in cluster.kube.pods(NAMESPACE)))
        pod = cluster.pod_of(name)
        assert pod["status"]["phase"] == "Pending"
        assert "nodeName" not in pod["spec"]
        assert pod["status"]["conditions"][0]["reason"] == "Unschedulable"

        kube.set_pod_phase("neighbour", "Succeeded")
        with trio.fail_after(10):
            await wait_until(
                lambda: (
                    cluster.pod_of(name)["status"]
                    .get("containerStatuses", [{}])[0]
                    .get("state", {})
                    .get("waiting", {})
                    .get("reason")
                    == "CreateContainerConfigError"
                )
            )
        waiting = cluster.pod_of(name)["status"]["containerStatuses"][0]["state"]["waiting"]
        assert token_secret_name(name) in waiting["message"]
        assert cluster.pod_of(name)["spec"]["nodeName"] == "gpu-a"
        assert cluster.kubelet.agents() == []

        cluster.add_secret(name)
        info = await cluster.worker_info(name)
        assert [card.uuid for card in info.cards] == uuids(0, 1)


@needs_root
async def test_a_killed_agent_fails_its_pod_and_job_and_frees_the_node(
    kube: KubeStandin, tmp_path: Path
) -> None:
    async with open_cluster(kube, tmp_path, SimNode("gpu-a", 3)) as cluster:
        name = await cluster.submit("gpu-a", 3)
        await cluster.worker_info(name)

        cluster.kubelet.kill(name)
        with trio.fail_after(10):
            returncode = await cluster.kubelet.wait_job_finished(name)

        assert exit_code(returncode) == 137
        pod = cluster.pod_of(name)
        assert pod["status"]["phase"] == "Failed"
        assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
        status = cluster.job(name)["status"]
        assert status["failed"] == 1
        assert "active" not in status
        assert [(c["type"], c["status"]) for c in status["conditions"]] == [("Failed", "True")]
        # The controlplane's planner sees the worker gone and would start the next generation
        # on all three cards.
        plan = plan_objects(
            SETTINGS, kube.objects("nodes"), kube.pods(), kube.jobs(NAMESPACE), [], time.time()
        )
        assert plan.actions == (
            CreateJob(
                node="gpu-a",
                cards=3,
                name=job_name(POOL, "gpu-a", 1),
                generation=1,
                hostname="gpu-a",
            ),
        )


@needs_root
async def test_deleting_the_job_terminates_its_agent_and_removes_its_pod(
    kube: KubeStandin, tmp_path: Path
) -> None:
    async with open_cluster(kube, tmp_path, SimNode("gpu-a", 1)) as cluster:
        name = await cluster.submit("gpu-a", 1)
        await cluster.worker_info(name)
        (agent,) = cluster.kubelet.agents()

        def delete() -> None:
            from kubernetes import client

            api = kube.api_client()
            try:
                client.BatchV1Api(api).delete_namespaced_job(
                    name, NAMESPACE, propagation_policy="Background"
                )
            finally:
                api.close()

        await trio.to_thread.run_sync(delete)
        with trio.fail_after(20):
            returncode = await cluster.kubelet.wait_job_finished(name)

        assert returncode == 0  # SIGTERM: the agent shut down cleanly, within its grace period
        with pytest.raises(ProcessLookupError):
            os.kill(agent.pid, 0)
        assert kube.pods(NAMESPACE) == []
        assert kube.secrets(NAMESPACE) == []


# -- the decisions, without processes ------------------------------------------------------------


def test_neighbours_keep_their_cards_and_new_ones_take_the_lowest_free() -> None:
    held = {"old": (2,)}
    placed = place_neighbours(4, {0}, held, [("new", 2), ("old", 1)])
    assert placed == {"old": (2,), "new": (1, 3)}
    # An overcommitted neighbour gets what is left; one that is gone is forgotten.
    assert place_neighbours(2, {0}, placed, [("big", 3)]) == {"big": (1,)}


def test_env_is_resolved_from_values_secrets_and_the_downward_api() -> None:
    container = {
        "env": [
            {"name": "A", "value": "1"},
            {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "A", "value": "2"},
        ]
    }
    secret = {"data": {"token": "c2VjcmV0"}}
    env = resolve_env(container, "ns", {"s": secret}, {"spec.nodeName": "gpu-a"})
    assert env == {"A": "2", "T": "secret", "N": "gpu-a"}
    with pytest.raises(ContainerConfigError, match='secret "s" not found'):
        resolve_env(container, "ns", {"s": None}, {"spec.nodeName": "gpu-a"})
    with pytest.raises(ContainerConfigError, match="couldn't find key token in Secret ns/s"):
        resolve_env(container, "ns", {"s": {"data": {}}}, {"spec.nodeName": "gpu-a"})
    with pytest.raises(ContainerConfigError, match=r"spec\.nodeName"):
        resolve_env(container, "ns", {"s": secret}, {})


# -- the kubelet's own pod arithmetic against the planner's ----------------------------------


def _gpu_container(name: str, gpus: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}, **extra}


@pytest.mark.parametrize(
    ("spec", "held"),
    [
        ({"containers": [_gpu_container("a", 1), _gpu_container("b", 2)]}, 3),
        # A regular init container hands its cards on: the pod needs the larger of the two.
        ({"initContainers": [_gpu_container("i", 4)], "containers": [_gpu_container("a", 1)]}, 4),
        # A sidecar keeps its card for the pod's life, beside the app containers' and under
        # every init container started after it.
        (
            {
                "initContainers": [
                    _gpu_container("s", 1, restartPolicy="Always"),
                    _gpu_container("i", 3),
                ],
                "containers": [_gpu_container("a", 1)],
            },
            4,
        ),
        ({"containers": [{"name": "cpu", "resources": {"requests": {"cpu": "1"}}}]}, 0),
    ],
)
def test_the_kubelets_card_count_agrees_with_the_planners(spec: dict[str, Any], held: int) -> None:
    """The simulated kubelet counts cards by its own reading of Kubernetes' rules, so the
    planner's arithmetic is checked against something other than itself."""
    pod = {"spec": spec}
    assert pod_gpus(pod) == held
    assert pod_request(pod).gpus == held
