"""Three controlplane replicas over one PostgreSQL database, behind one Service, as the chart
runs them with `replicaCount: 3`: each its own process, the workers in both modes reaching them
only through the Service.

A task created through one replica is followed through a second and reached (exec, a port)
through the third, whichever holds the worker; the replica holding it is killed with SIGKILL
mid-task, the worker comes back on another, the task keeps running and succeeds, the log
follow resumes without losing or repeating a line, and the container ran once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from control.cli.client import ControlClient, ControlClientError
from control.config import DatabaseSettings
from control.models import TaskRequest
from sim.cluster import PoolSpec
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode
from sim.replicas import ReplicatedCluster, open_replicated_cluster
from tests.test_e2e import wait_state
from wire.errors import ApiError
from workerapi.models import ExecRequest

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.kube_fixtures", "tests.registry_fixtures", "tests.postgres_fixtures"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")

SCRIPT = (
    "mkdir -p /www && echo hello > /www/index.html && httpd -p 8080 -h /www && "
    "echo before; while [ ! -e /go ]; do sleep 0.1; done; echo after"
)


async def holder(cluster: ReplicatedCluster, worker: str, *, not_: int | None = None) -> int:
    """Which replica holds the worker now (by its HOSTNAME, the start of its identity); with
    `not_`, once one other than that holds it."""
    while True:
        async with cluster.client("operator") as client:
            listed = {w.worker_id: w for w in (await client.workers()).workers}
        replica = listed[worker].replica if worker in listed else None
        if replica is not None and listed[worker].connected:
            index = int(replica.split("_")[0].rsplit("-", 1)[1])
            if index != not_:
                return index
        await trio.sleep(0.1)


async def http_get(client: ControlClient, task_id: str, port: int) -> bytes:
    stream = await client.connect_port(task_id, port)
    async with stream:
        await stream.send_all(b"GET / HTTP/1.0\r\nHost: task\r\n\r\n")
        answer = b""
        while chunk := await stream.receive_some():
            answer += chunk
    return answer


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
async def test_a_task_outlives_the_replica_holding_its_worker(
    mode: str,
    tmp_path: Path,
    kube: KubeStandin,
    registry: SharedRegistry,
    postgres_database: DatabaseSettings,
) -> None:
    database = {"url": postgres_database.url, "password": postgres_database.password}
    async with open_replicated_cluster(
        tmp_path / "cluster",
        kube,
        nodes=[(SimNode("gpu-node-1", 2), "gpu")],
        pools=[PoolSpec("gpu", tunnel=mode == "tunnel")],
        database=database,
    ) as cluster:
        with trio.fail_after(150):
            (worker,) = await cluster.wait_workers(1)
            owner = await holder(cluster, worker)
            follower, reacher = (owner + 1) % 3, (owner + 2) % 3
            async with cluster.client(replica=0) as first:
                task = await first.create_task(
                    TaskRequest(
                        image=registry.busybox,
                        command=("sh", "-c", SCRIPT),
                        cards=1,
                        ports=(8080,),
                    )
                )
            lines: list[str] = []
            before = trio.Event()

            async def follow() -> None:
                async with cluster.client(replica=follower) as client:
                    async for line in client.task_logs(task.id, follow=True):
                        lines.append(line.text)
                        if line.text == "before":
                            before.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow)
                await before.wait()
                await cluster.kill(owner)
                # The worker comes back on one of the other two, through the Service.
                await holder(cluster, worker, not_=owner)
                async with cluster.client(replica=reacher) as client:
                    # The killed holder may have died before it recorded the container as
                    # running (its log reached the follower first); the new holder does, as
                    # it adopts the worker's tasks.
                    await wait_state(client, task.id, "running")
                    assert b"hello" in await http_get(client, task.id, 8080)
                    code = await client.exec_in_task(
                        task.id, ExecRequest(command=("touch", "/go")), on_output=_ignore
                    )
                    assert code == 0
                    done = await client.wait_task(task.id)
            # The follow through a replica that never held the worker saw every line once.
            assert lines == ["before", "after"]
            assert done.state == "succeeded", done
            assert done.exit_code == 0
            assert done.worker == worker


async def _ignore(channel: int, data: bytes) -> None:
    pass


def jobs_created(kube: KubeStandin) -> int:
    """Job creates the stand-in answered with success, from any replica."""
    return sum(
        1
        for r in kube.requests
        if r.verb == "create" and r.path.endswith("/jobs") and r.status < 300
    )


TASKS = 200


async def test_a_rolling_restart_under_a_stream_of_tasks_loses_none_and_doubles_no_job(
    tmp_path: Path,
    kube: KubeStandin,
    registry: SharedRegistry,
    postgres_database: DatabaseSettings,
) -> None:
    """Each replica in turn is stopped (SIGTERM: it drains) and started again, as a
    RollingUpdate does, while short tasks keep arriving through the Service; every task
    succeeds exactly once, and each node got exactly one worker Job."""
    database = {"url": postgres_database.url, "password": postgres_database.password}
    async with open_replicated_cluster(
        tmp_path / "cluster",
        kube,
        nodes=[(SimNode("gpu-node-1", 2), "gpu"), (SimNode("gpu-node-2", 2), "gpu")],
        pools=[PoolSpec("gpu", tunnel=True)],
        database=database,
    ) as cluster:
        with trio.fail_after(400):
            await cluster.wait_workers(2)
            created: list[str] = []
            submitted = trio.Event()

            async def submit() -> None:
                while len(created) < TASKS:
                    try:
                        async with cluster.client() as client:
                            while len(created) < TASKS:
                                task = await client.create_task(
                                    TaskRequest(image=registry.busybox, command=("true",))
                                )
                                created.append(task.id)
                                await trio.sleep(0.05)
                    except* (ApiError, ControlClientError):
                        # Its replica drained under us: the next connection goes to another.
                        pass
                    await trio.sleep(0.1)
                submitted.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(submit)
                for index in range(3):
                    await trio.sleep(2)
                    assert await cluster.stop(index) == 0
                    await cluster.start(index)
                await submitted.wait()
            ended = {}
            async with cluster.client() as client:
                for task_id in created:
                    ended[task_id] = await client.wait_task(task_id)
                listed = await client.tasks(limit=TASKS + 10)
        # No task was lost, and none was made twice by a retried create.
        assert sorted(view.id for view in listed) == sorted(created)
        assert len(ended) == TASKS
        unsucceeded = {
            task_id: f"{view.state}: {view.reason}"
            for task_id, view in ended.items()
            if view.state != "succeeded"
        }
        assert unsucceeded == {}, f"{len(unsucceeded)} task(s) did not succeed: {unsucceeded}"
        assert jobs_created(kube) == 2
