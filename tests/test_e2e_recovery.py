"""End to end, when things go wrong or wait: the controlplane restarts mid-task (its records in
SQLite or in PostgreSQL), a worker is
killed, a multi-card task waits for one worker with enough cards, a task runs past its timeout,
and `levers9 run` gives up waiting while the task goes on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from control.cli.client import ControlClient
from control.config import DatabaseSettings
from control.models import TaskRequest, TaskView
from sim.cluster import open_node_cluster
from sim.kubeapi.objects import make_pod
from sim.kubeapi.store import KubeStandin
from tests.test_e2e import wait_for_line, wait_state

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.kube_fixtures", "tests.registry_fixtures", "tests.postgres_fixtures"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")


@pytest.mark.parametrize(
    ("mode", "records"), [("direct", "sqlite"), ("tunnel", "sqlite"), ("tunnel", "postgres")]
)
async def test_controlplane_restart_mid_task_keeps_records_and_logs(
    mode: str, records: str, tmp_path: Path, kube: KubeStandin, request: pytest.FixtureRequest
) -> None:
    registry: SharedRegistry = request.getfixturevalue("registry")
    database = None
    if records == "postgres":
        settings: DatabaseSettings = request.getfixturevalue("postgres_database")
        database = {"url": settings.url, "password": settings.password}
    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        1,
        tunnel=mode == "tunnel",
        database=database,
    ) as cluster:
        with trio.fail_after(90):
            (worker,) = await cluster.wait_workers(1)
            script = "echo before; while [ ! -e /go ]; do sleep 0.1; done; echo after"
            async with cluster.client() as client:
                task = await client.create_task(
                    TaskRequest(image=registry.busybox, command=("sh", "-c", script), cards=1)
                )
                await wait_for_line(client, task.id, "before")
            await cluster.restart_controlplane()
            # The worker comes back (re-registers, or reopens its tunnel) to the new process.
            assert await cluster.wait_workers(1) == [worker]
            async with cluster.client() as client:
                # The stopped process may not have recorded the container as running yet (its
                # first line came back first); the new one does, as it adopts the task.
                running = await wait_state(client, task.id, "running")
                assert running.worker == worker
                assert len(running.card_ids) == 1
                code = await client.exec_in_task(task.id, _exec("touch /go"), on_output=_ignore)
                assert code == 0
                lines = [line.text async for line in client.task_logs(task.id, follow=True)]
                done = await client.wait_task(task.id)
        assert lines == ["before", "after"]
        assert done.state == "succeeded"
        assert done.exit_code == 0


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
async def test_a_killed_worker_loses_its_task_and_a_new_worker_appears(
    mode: str, tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        2,
        tunnel=mode == "tunnel",
    ) as cluster:
        with trio.fail_after(90):
            (worker,) = await cluster.wait_workers(1)
            async with cluster.client() as client:
                task = await client.create_task(
                    TaskRequest(image=registry.busybox, command=("sleep", "600"), cards=2)
                )
                await wait_state(client, task.id, "running")
                cluster.kubelet.kill(worker)
                lost = await wait_state(client, task.id, "lost")
                assert worker in (lost.reason or "")
                assert lost.finished_at is not None
                # The next reconcile starts a new worker on the node, with all its cards.
                while True:
                    workers = await cluster.wait_workers(1)
                    if workers != [worker] and worker not in workers:
                        break
                    await trio.sleep(0.2)
                again = await client.create_task(
                    TaskRequest(image=registry.busybox, command=("true",), cards=2)
                )
                done = await client.wait_task(again.id)
        assert done.state == "succeeded", done
        assert done.worker != worker


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
async def test_a_multi_card_task_waits_for_one_worker_with_enough_cards(
    mode: str, tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    # A model server holds 2 of the node's 4 cards: the worker gets the other 2. The worker
    # idles out only after the pool's idleMinutes (5), far beyond this test.
    kube.add_pod(make_pod("model-server", "gpu-node-1", gpu_limit=2))
    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        4,
        tunnel=mode == "tunnel",
    ) as cluster:
        with trio.fail_after(120):
            (first,) = await cluster.wait_workers(1)
            async with cluster.client() as client:
                task = await client.create_task(
                    TaskRequest(image=registry.busybox, command=("true",), cards=3)
                )
                view = await wait_waiting(client, task.id, "3 cards")
                assert view.state == "pending"
                reason = view.waiting or ""
                assert "never split" in reason, reason
                # The model server scales down: the idle 2-card worker is retired at once, the
                # next one takes every card, and the task runs there.
                kube.remove_pod("model-server")
                done = await client.wait_task(task.id)
        assert done.state == "succeeded", done
        assert done.worker != first
        assert len(done.card_ids) == 3
        # The operator can see why the first worker went (`kubectl describe job`).
        deleted = [
            e["message"]
            for e in kube.objects("events", "levers9")
            if e["involvedObject"]["name"] == first and e["reason"] == "Deleted"
        ]
        assert deleted == [
            f"deleted: retired while idle: task {task.id} asks 3 cards, and this worker's "
            "2 cards with the 2 now free on node gpu-node-1 make 4"
        ], deleted


async def test_a_task_past_its_timeout_is_stopped(
    tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        1,
    ) as cluster:
        with trio.fail_after(90):
            async with cluster.client() as client:
                task = await client.create_task(
                    TaskRequest(
                        image=registry.busybox,
                        command=("sh", "-c", "echo started; sleep 600"),
                        timeout_s=2,
                    )
                )
                done = await client.wait_task(task.id)
                lines = [line.text async for line in client.task_logs(task.id, follow=False)]
        assert done.state == "failed"
        assert "timeout of 2 s" in (done.reason or "")
        assert lines == ["started"]


async def wait_waiting(client: ControlClient, task_id: str, reason: str) -> TaskView:
    """The task once its waiting reason says `reason`."""
    while True:
        view = await client.task(task_id)
        if reason in (view.waiting or ""):
            return view
        await trio.sleep(0.1)


def _exec(command: str):  # type: ignore[no-untyped-def]
    from workerapi.models import ExecRequest

    return ExecRequest(command=("sh", "-c", command))


async def _ignore(channel: int, data: bytes) -> None:
    pass
