"""Pools reconciled against an API server that misbehaves as busy ones do: watch events that
arrive seconds after the write, a write refused for one node, a second worker Job on a node.

At any watch lag a node gets one worker Job (the pass holds a node until its caches show what it
wrote: controller expectations); a surplus Job of ours is deleted, the one holding the cards
kept, with an Event that says why; one node's refused write neither stops the others nor the
pass, is shown on that node, and is retried on its own."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from control.cli.main import main as cli_main
from control.db.base import TaskStoreError
from control.kube.loop import settings_of
from control.kube.manifests import job_manifest, job_name, token_secret_name
from control.kube.pools import load_pools
from sim.configs import API_TOKEN
from sim.kubeapi.objects import job_node
from sim.kubeapi.store import KubeStandin, WatchFaults
from sim.pools import gpu_node, jobs_created, pool_block, schedule_pods_of_jobs
from tests.test_pool_reconcile import CONTROLPLANE_URL, reconciler, serve_pool, until
from wire.errors import ErrorCode

pytest_plugins = ["tests.kube_fixtures"]

NODES = ("node-1", "node-2", "node-3")


def refuse_creates(
    kube: KubeStandin,
    plural_path: str,
    message: str,
    *,
    status: int = 403,
    name_prefix: str | None = None,
) -> None:
    """Every create under `plural_path` (e.g. /apis/batch/v1/namespaces/levers9/jobs) is
    answered with `status` (Forbidden: a quota; 422: Invalid) until `clear_faults`."""
    reason = "Forbidden" if status == 403 else "Invalid"
    kube.inject_fault(
        "status",
        count=None,
        verb="create",
        path_prefix=plural_path,
        status=status,
        reason=reason,
        message=message,
        name_prefix=name_prefix,
    )


JOBS = "/apis/batch/v1/namespaces/levers9/jobs"


def jobs_per_node(kube: KubeStandin) -> Counter[str]:
    return Counter(str(job_node(job)) for job in kube.jobs())


@pytest.mark.parametrize("lag_s", [0.8, 5.0])
async def test_a_node_gets_one_worker_job_at_any_watch_lag(kube: KubeStandin, lag_s: float) -> None:
    schedule_pods_of_jobs(kube)
    kube.set_watch_faults(WatchFaults(lag_s=lag_s))
    for name in NODES:
        kube.add_node(gpu_node(name))
    async with reconciler(kube, clock=time.time, reconcileSeconds=0.2) as r:
        await until(r, lambda: len(kube.jobs()) == len(NODES))
        # Created, perhaps not yet seen through the lagging watch: each machine shows its
        # worker pending, and passes go on without planning the node again.
        await until(
            r,
            lambda: (
                {m.node: m.worker and m.worker.state for m in r.status.machines}
                == dict.fromkeys(NODES, "pending")
            ),
        )
        passes = r.pass_count
        with trio.fail_after(lag_s + 20):
            while len(r.expectations) or r.pass_count < passes + 5:
                await r.passes.park()
        assert all(cache_has_job(r, name) for name in NODES)
    assert jobs_per_node(kube) == dict.fromkeys(NODES, 1)
    assert jobs_created(kube) == len(NODES)


def cache_has_job(r: Any, node: str) -> bool:
    return any(job.node == node for job in r.caches.jobs.items.values())


async def test_a_surplus_job_on_a_node_is_deleted_and_the_one_holding_cards_kept(
    kube: KubeStandin,
) -> None:
    schedule_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    async with reconciler(kube, clock=time.time, reconcileSeconds=0.2) as r:
        await until(r, lambda: len(kube.jobs()) == 1)
        (first,) = kube.jobs()
        # Another writer (a replica whose cache lagged) made the next generation too.
        pool = load_pools([pool_block(kube)]).pools[0]
        extra = job_manifest(
            settings_of(pool),
            "node-1",
            4,
            job_name(pool.name, "node-1", 1),
            token_secret_name(job_name(pool.name, "node-1", 1)),
            CONTROLPLANE_URL,
            token="t0ken",
            generation=1,
        ).job
        kube.create("jobs", extra)
        await until(
            r, lambda: [j["metadata"]["name"] for j in kube.jobs()] == [first["metadata"]["name"]]
        )
    keeper = first["metadata"]["name"]
    messages = [e["message"] for e in kube.objects("events", "levers9")]
    assert f"deleted: surplus worker on node-1: {keeper} holds its cards" in messages
    assert jobs_created(kube) == 1  # the pool's own; the other came by hand


async def test_one_nodes_refused_create_is_its_own_and_retried(kube: KubeStandin) -> None:
    schedule_pods_of_jobs(kube)
    for name in NODES:
        kube.add_node(gpu_node(name))
    refused = job_name("gpu", "node-2", 0)
    message = f'Job.batch "{refused}" is invalid: spec.template: Invalid value'
    refuse_creates(kube, JOBS, message, status=422, name_prefix=refused)
    async with reconciler(kube, clock=time.time, reconcileSeconds=0.2) as r:
        await until(r, lambda: "node-2" in r.status.failed and len(kube.jobs()) == 2)
        assert set(jobs_per_node(kube)) == {"node-1", "node-3"}
        # The pass went through; the failure is the node's, shown on its machine.
        assert r.status.error is None
        errors = {m.node: m.error for m in r.status.machines}
        assert errors["node-1"] is None and errors["node-3"] is None
        assert errors["node-2"] is not None and "is invalid" in errors["node-2"]
        refusals = kube.request_count("create", "/apis/batch/v1/namespaces/levers9/jobs")
        # Retried on the node's own backoff, not on every pass.
        passes = r.pass_count
        await until(r, lambda: r.pass_count >= passes + 10)
        assert (
            kube.request_count("create", "/apis/batch/v1/namespaces/levers9/jobs") - refusals < 10
        )
        kube.clear_faults()
        await until(r, lambda: len(kube.jobs()) == 3 and not r.status.failed, timeout_s=60)
        assert all(m.error is None for m in r.status.machines)
    assert jobs_per_node(kube) == dict.fromkeys(NODES, 1)


async def test_a_quota_refusing_creates_does_not_stop_a_delete(kube: KubeStandin) -> None:
    schedule_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    async with reconciler(kube, clock=time.time, reconcileSeconds=0.2) as r:
        await until(r, lambda: len(kube.jobs()) == 1)
        refuse_creates(kube, JOBS, "exceeded quota: gpu-quota, requested: nvidia.com/gpu=4")
        kube.add_node(gpu_node("node-2"))
        kube.update("nodes", gpu_node("node-1", unschedulable=True))
        # node-1's worker goes although node-2's create is refused (in whichever order).
        await until(r, lambda: not kube.jobs() and "node-2" in r.status.failed)
        assert "exceeded quota" in r.status.failed["node-2"]
        assert r.status.error is None


async def test_a_job_whose_secret_was_refused_gets_it_once_writes_go_through(
    kube: KubeStandin,
) -> None:
    schedule_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    refuse_creates(kube, "/api/v1/namespaces/levers9/secrets", "exceeded quota: secrets")
    async with reconciler(kube, clock=time.time, reconcileSeconds=0.2) as r:
        await until(r, lambda: "node-1" in r.status.failed and len(kube.jobs()) == 1)
        assert kube.secrets("levers9") == []
        kube.clear_faults()
        await until(r, lambda: len(kube.secrets("levers9")) == 1 and not r.status.failed)
        (job,) = kube.jobs()
        (secret,) = kube.secrets("levers9")
    assert secret["metadata"]["name"] == token_secret_name(job["metadata"]["name"])
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert jobs_created(kube) == 1


async def test_machine_list_names_a_node_whose_write_was_refused(
    kube: KubeStandin,
    tmp_path: Path,
    nursery: trio.Nursery,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kube.add_node(gpu_node("node-q"))
    refuse_creates(kube, JOBS, "exceeded quota: gpu-quota, requested: nvidia.com/gpu=4")
    control, reconciling, pki = await serve_pool(kube, tmp_path, nursery)
    with trio.fail_after(30):
        while "node-q" not in reconciling.status.failed:
            await reconciling.passes.park()
    args = [
        "--controlplane",
        f"https://127.0.0.1:{control.port}",
        "--token",
        API_TOKEN,
        "--ca",
        str(pki.ca_file),
        "machine",
        "list",
    ]
    assert await trio.to_thread.run_sync(cli_main, [*args, "--json"]) == 0
    (machine,) = json.loads(capsys.readouterr().out)
    assert "exceeded quota: gpu-quota" in machine["error"]
    assert await trio.to_thread.run_sync(cli_main, args) == 0
    printed = capsys.readouterr()
    assert "node-q" in printed.out
    assert "pool gpu: node node-q: last write failed: " in printed.err
    assert "exceeded quota: gpu-quota" in printed.err


async def test_a_gone_worker_whose_tasks_cannot_be_marked_lost_yet_is_told_again_later(
    kube: KubeStandin,
) -> None:
    """Seen in a 35-minute chaos campaign: while PostgreSQL restarted, marking the tasks of a
    worker whose Job ended lost failed, and the error ended the pool's loop. The pass goes on
    (the node gets its next worker) and the worker's end is told once the database is back."""
    schedule_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    database_back = False
    told: list[str] = []

    async def worker_gone(name: str, reason: str) -> None:
        if not database_back:
            raise TaskStoreError(
                ErrorCode.UNAVAILABLE,
                "task database postgresql://db/levers9: server closed the connection "
                "unexpectedly; retry shortly",
            )
        told.append(name)

    async with reconciler(kube, clock=time.time, reconcileSeconds=0.2) as r:
        r.on_worker_gone = worker_gone
        await until(r, lambda: len(kube.jobs()) == 1)
        (first,) = kube.jobs()
        name = first["metadata"]["name"]
        kube.patch("jobs", name, {"status": {"failed": 1}}, namespace="levers9")
        for pod in kube.pods("levers9"):
            kube.set_pod_phase(pod["metadata"]["name"], "Failed", namespace="levers9")
        await until(r, lambda: any(j["metadata"]["name"] != name for j in kube.jobs()))
        passes = r.pass_count
        await until(r, lambda: r.pass_count >= passes + 2)
        assert told == []
        database_back = True
        await until(r, lambda: told == [name])
        await until(r, lambda: r.pass_count >= passes + 6)
    assert told == [name]
