"""End to end: tasks submitted to the controlplane run on workers it started as Kubernetes
Jobs, in direct and in tunnel mode, with real runc containers, reached back through the worker
API (directly or through the tunnel)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from control.cli.client import ControlClient
from control.models import TaskRequest, TaskView, TaskVolume
from sim.cluster import Cluster, PoolSpec, open_cluster, open_node_cluster
from sim.configs import read_line
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode
from sim.s3 import S3Server
from tests.streams import exchange
from wire.errors import ApiError, ErrorCode
from workerapi.models import ExecRequest

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import AuthRegistry, SharedRegistry

pytest_plugins = ["tests.kube_fixtures", "tests.registry_fixtures", "tests.s3_fixtures"]
LEVERS9 = (sys.executable, "-m", "control.cli")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")


@pytest.fixture(params=["direct", "tunnel"])
async def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, kube: KubeStandin
) -> AsyncIterator[Cluster]:
    tunnel = request.param == "tunnel"
    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        2,
        tunnel=tunnel,
    ) as running:
        yield running


async def test_a_gpu_task_runs_and_its_logs_and_exit_code_come_back(
    cluster: Cluster, registry: SharedRegistry
) -> None:
    async with cluster.client() as client:
        task = await client.create_task(
            TaskRequest(
                image=registry.busybox,
                command=(
                    "sh",
                    "-c",
                    "echo visible=$NVIDIA_VISIBLE_DEVICES; ls /dev | grep nvidia; exit 3",
                ),
                cards=1,
            )
        )
        with trio.fail_after(60):
            done = await client.wait_task(task.id)
        lines = [line.text async for line in client.task_logs(task.id, follow=False)]
    assert done.state == "failed", done
    assert done.exit_code == 3
    assert len(done.card_ids) == 1
    assert f"visible={done.card_ids[0]}" in lines
    assert "nvidia0" in lines or "nvidia1" in lines


SERVER = (
    "mkdir -p /www && echo hello from $(hostname) > /www/index.html && "
    "(nc -ll -p 9000 -e cat &) && echo ready && exec httpd -f -p 8080 -h /www"
)


async def wait_for_line(client: ControlClient, task_id: str, text: str) -> list[str]:
    seen = []
    async for line in client.task_logs(task_id, follow=True):
        seen.append(line.text)
        if line.text == text:
            return seen
    raise AssertionError(f"the log ended without {text!r}: {seen!r}")


async def test_endpoint_box_port_exec_and_snapshot_restore(
    cluster: Cluster, registry: SharedRegistry
) -> None:
    async with cluster.client() as client:
        task = await client.create_task(
            TaskRequest(image=registry.busybox, command=("sh", "-c", SERVER), ports=(8080, 9000))
        )
        with trio.fail_after(60):
            await wait_for_line(client, task.id, "ready")

            # An endpoint: HTTP to the task's declared port through the controlplane.
            path = f"/v1/tasks/{task.id}/ports/8080/index.html"
            async with client.stream("GET", path) as response:
                assert response.status == 200
                page = await response.read()
            assert page.startswith(b"hello from ")
            with pytest.raises(ApiError) as undeclared:
                await client.call("GET", f"/v1/tasks/{task.id}/ports/7000/")
            assert undeclared.value.code is ErrorCode.NOT_FOUND
            with pytest.raises(ApiError) as refused:
                await client.connect_port(task.id, 7000)
            assert refused.value.code is ErrorCode.PERMISSION_DENIED
            assert "declares no port 7000 (its ports: 8080, 9000)" in refused.value.message

            # A box port: a byte stream to a port the task declared.
            stream = await client.connect_port(task.id, 9000)
            payload = os.urandom(1 << 20)
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    await stream.send_all(payload)
                    await stream.send_eof()

                nursery.start_soon(send)
                echoed = b""
                while data := await stream.receive_some():
                    echoed += data
            assert echoed == payload

            # Exec, then a snapshot of what it wrote, restored into a new task.
            output: list[tuple[int, bytes]] = []

            async def collect(channel: int, data: bytes) -> None:
                output.append((channel, data))

            code = await client.exec_in_task(
                task.id,
                ExecRequest(command=("sh", "-c", "echo kept > /www/saved.txt; echo oops >&2")),
                on_output=collect,
            )
            assert code == 0
            assert (2, b"oops\n") in output
            snapshot = await client.snapshot_task(task.id)
            assert snapshot.digest.startswith("sha256:")

            cancelled = await client.cancel_task(task.id)
            assert cancelled.state == "cancelled"
            restored = await client.create_task(
                TaskRequest(
                    image=registry.busybox,
                    command=("cat", "/www/saved.txt"),
                    snapshot=snapshot.digest,
                )
            )
            done = await client.wait_task(restored.id)
            lines = [line.text async for line in client.task_logs(restored.id, follow=False)]
        assert done.state == "succeeded", done
        assert lines == ["kept"]


SSE_EVENTS = 5
SSE_SCRIPT = f"""#!/bin/sh
printf 'Content-Type: text/event-stream\\r\\n\\r\\n'
i=0
while [ $i -lt {SSE_EVENTS} ]; do
  printf 'data: event %s\\n\\n' $i
  n=0
  while [ ! -e /tmp/ack.$i ] && [ $n -lt 3000 ]; do sleep 0.01; n=$((n+1)); done
  i=$((i+1))
done
"""
"""A CGI event stream that writes event N+1 only once the client acknowledged event N (by a GET
of the ack script below, through the same route): were any hop to hold event N back until more
bytes came, the stream would stall and the test time out."""
ACK_SCRIPT = """#!/bin/sh
touch /tmp/ack.$QUERY_STRING
printf 'Content-Type: text/plain\\r\\n\\r\\nok\\n'
"""
SSE_SERVER = (
    "mkdir -p /www/cgi-bin && cd /www/cgi-bin && printf '%s' \"$SSE\" > sse && "
    "printf '%s' \"$ACK\" > ack && chmod +x sse ack && echo ready && "
    "exec httpd -f -p 8080 -h /www"
)


async def test_server_sent_events_arrive_one_by_one_through_the_endpoint(
    cluster: Cluster, registry: SharedRegistry
) -> None:
    async with cluster.client() as client:
        task = await client.create_task(
            TaskRequest(
                image=registry.busybox,
                command=("sh", "-c", SSE_SERVER),
                env={"SSE": SSE_SCRIPT, "ACK": ACK_SCRIPT},
                ports=(8080,),
            )
        )
        with trio.fail_after(60):
            await wait_for_line(client, task.id, "ready")
        base = f"/v1/tasks/{task.id}/ports/8080/cgi-bin"
        events: list[str] = []
        with trio.fail_after(30):
            async with client.stream("GET", f"{base}/sse") as response:
                assert response.status == 200
                assert response.headers["content-type"] == "text/event-stream"
                buffered = b""
                async for chunk in response.iter_chunks():
                    buffered += chunk
                    while b"\n\n" in buffered:
                        event, buffered = buffered.split(b"\n\n", 1)
                        events.append(event.decode())
                        # The server waits for this before it writes the next event.
                        ack = f"{base}/ack?{len(events) - 1}"
                        async with client.stream("GET", ack) as acked:
                            assert (acked.status, await acked.read()) == (200, b"ok\n")
        await client.cancel_task(task.id)
    assert events == [f"data: event {i}" for i in range(SSE_EVENTS)]


async def test_tasks_of_one_workspace_are_invisible_to_another(
    cluster: Cluster, registry: SharedRegistry
) -> None:
    async with cluster.client("team-a") as alice:
        task = await alice.create_task(
            TaskRequest(image=registry.busybox, command=("sleep", "600"), ports=(80,))
        )
        async with cluster.client("team-b") as bob:
            with trio.fail_after(60):
                await wait_state(alice, task.id, "running")
            assert await bob.tasks() == ()
            for call in (
                bob.task(task.id),
                bob.cancel_task(task.id),
                bob.connect_port(task.id, 80),
                bob.call("GET", f"/v1/tasks/{task.id}/ports/80/"),
            ):
                with pytest.raises(ApiError) as info:
                    await call
                assert info.value.code is ErrorCode.NOT_FOUND, info.value
            with pytest.raises(ApiError) as logs:
                async for _ in bob.task_logs(task.id, follow=False):
                    pass
            assert logs.value.code is ErrorCode.NOT_FOUND
        async with cluster.client("operator") as operator:
            with pytest.raises(ApiError) as denied:
                await operator.tasks()
            assert denied.value.code is ErrorCode.PERMISSION_DENIED
        assert (await alice.task(task.id)).state == "running"
        assert (await alice.cancel_task(task.id)).state == "cancelled"


async def wait_state(client: ControlClient, task_id: str, state: str) -> TaskView:
    while True:
        view = await client.task(task_id)
        if view.state == state:
            return view
        assert not view.terminal or state in ("succeeded", "failed", "cancelled", "lost"), view
        await trio.sleep(0.1)


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
async def test_the_cli_runs_a_task_and_a_short_wait_leaves_it_running(
    mode: str, tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    import json

    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        2,
        tunnel=mode == "tunnel",
    ) as cluster:
        with trio.fail_after(120):
            machines = json.loads((await cluster.cli("machine", "list", "--json")).stdout)
            assert [(m["node"], m["cards"]["total"]) for m in machines] == [("gpu-node-1", 2)]

            ran = await cluster.cli(
                "run", "--gpus", "2", registry.busybox, "--",
                "sh", "-c", "echo out; echo err >&2; exit 7",
                check=False,
            )  # fmt: skip
            assert ran.returncode == 7, ran.stderr
            assert ran.stdout.decode().splitlines() == ["out"]
            assert "err" in ran.stderr.decode().splitlines()

            # An image whose registry nobody serves: the task fails at once, with the
            # worker's words about the registry, not after the worker counts as lost.
            with socket.socket() as unused:
                unused.bind(("127.0.0.1", 0))
                nowhere = f"127.0.0.1:{unused.getsockname()[1]}"
            with trio.fail_after(30):
                unreachable = await cluster.cli(
                    "run", f"{nowhere}/busybox:latest", "--", "true", check=False
                )
            assert unreachable.returncode == 1
            assert f"registry {nowhere} is unreachable" in unreachable.stderr.decode()

            # A wait shorter than the start: DEADLINE_EXCEEDED, and the task goes on.
            short = await cluster.cli(
                "run", "--wait", "0", registry.busybox, "--", "sh", "-c", "sleep 1; echo done",
                check=False,
            )  # fmt: skip
            assert short.returncode == 124
            message = short.stderr.decode()
            assert "DEADLINE_EXCEEDED" in message
            task_id = message.split("task ", 1)[1].split()[0]
            async with cluster.client() as client:
                done = await client.wait_task(task_id)
            assert done.state == "succeeded", done
            logs = await cluster.cli("task", "logs", task_id)
            assert logs.stdout == b"done\n"
            listed = json.loads((await cluster.cli("task", "list", "--json")).stdout)
            assert {t["id"]: t["state"] for t in listed}[task_id] == "succeeded"
            other = await cluster.cli("task", "get", task_id, workspace="team-b", check=False)
            assert other.returncode == 1
            assert b"NOT_FOUND" in other.stderr

            # exec with stdin from a pipe, and a local port forwarded to the task's box port.
            echo = await cluster.cli(
                "run", "--detach", "--port", "9000", registry.busybox,
                "--", "nc", "-ll", "-p", "9000", "-e", "cat",
            )  # fmt: skip
            echo_id = echo.stdout.decode().strip()
            async with cluster.client() as client:
                await wait_state(client, echo_id, "running")
            piped = await trio.run_process(
                [*LEVERS9, "exec", echo_id, "--", "sh", "-c", "cat; exit 4"],
                env=cluster.cli_env(),
                stdin=b"through exec\n",
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )  # fmt: skip
            assert piped.returncode == 4, piped.stderr
            assert piped.stdout == b"through exec\n"
            forward = await trio.lowlevel.open_process(
                [*LEVERS9, "port", echo_id, "9000", "--local", "127.0.0.1:0"],
                env=cluster.cli_env(),
                stderr=subprocess.PIPE,
            )  # fmt: skip
            try:
                assert forward.stderr is not None
                line = (await read_line(forward.stderr)).decode()
                assert line.startswith("forwarding 127.0.0.1:"), line
                local_port = int(line.split()[1].rsplit(":", 1)[1])
                for _ in range(2):  # two connections over the one forwarder
                    stream = await trio.open_tcp_stream("127.0.0.1", local_port)
                    assert await exchange(stream, b"through port\n") == b"through port\n"
            finally:
                forward.terminate()
                await forward.wait()


async def test_a_snapshot_follows_its_task_to_another_worker(
    tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    async with open_cluster(
        tmp_path / "cluster",
        kube,
        nodes=[(SimNode("gpu-node-1", 1), "gpu"), (SimNode("gpu-node-2", 2), "gpu")],
        pools=[PoolSpec("gpu")],
    ) as cluster:
        with trio.fail_after(120):
            await cluster.wait_workers(2)
            async with cluster.client() as client:
                first = await client.create_task(
                    TaskRequest(
                        image=registry.busybox,
                        command=("sh", "-c", "echo work > /result.txt; echo ready; sleep 600"),
                        cards=1,
                    )
                )
                await wait_for_line(client, first.id, "ready")
                snapshot = await client.snapshot_task(first.id)
                await client.cancel_task(first.id)
                second = await client.create_task(
                    TaskRequest(
                        image=registry.busybox,
                        command=("cat", "/result.txt"),
                        cards=2,
                        snapshot=snapshot.digest,
                    )
                )
                done = await client.wait_task(second.id)
                lines = [line.text async for line in client.task_logs(second.id, follow=False)]
                placed = await client.task(first.id)
        assert done.state == "succeeded", done
        assert done.worker != placed.worker  # two cards: only the second node's worker
        assert lines == ["work"]


async def test_a_task_mounts_its_workspace_bucket_with_the_workspaces_credentials(
    tmp_path: Path, kube: KubeStandin, registry: SharedRegistry, s3_server: S3Server
) -> None:
    user = s3_server.users["a"]
    s3_server.client(user=user).put_object(Bucket=user.bucket, Key="in.txt", Body=b"from-s3\n")
    bucket = {
        "name": "data",
        "url": f"s3://{user.bucket}/",
        "s3": {
            "accessKeyId": user.access_key_id,
            "secretAccessKey": user.secret_access_key,
            "endpoint": s3_server.endpoint,
        },
    }
    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        1,
        tunnel=True,
        agent_env={"LEVERS9_BUCKET_CA": str(s3_server.ca_file)},
        buckets={"team-a": [bucket]},
    ) as cluster:
        with trio.fail_after(120):
            async with cluster.client() as client:
                task = await client.create_task(
                    TaskRequest(
                        image=registry.busybox,
                        command=("sh", "-c", "cat /data/in.txt && echo done > /data/out.txt"),
                        volumes=(TaskVolume(bucket="data", mount_path="/data"),),
                    )
                )
                done = await client.wait_task(task.id)
                lines = [line.text async for line in client.task_logs(task.id, follow=False)]
            async with cluster.client("team-b") as bob:
                with pytest.raises(ApiError) as info:
                    await bob.create_task(
                        TaskRequest(
                            image=registry.busybox,
                            volumes=(TaskVolume(bucket="data", mount_path="/data"),),
                        )
                    )
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        assert info.value.field == "volumes[0].bucket"
        assert done.state == "succeeded", done
        assert lines == ["from-s3"]
        body = s3_server.client(user=user).get_object(Bucket=user.bucket, Key="out.txt")["Body"]
        assert body.read() == b"done\n"
        # The workspace's keys reached the worker, never the task database.
        stored = b"".join(p.read_bytes() for p in (tmp_path / "cluster").glob("tasks.db*"))
        assert user.secret_access_key.encode() not in stored
        assert user.access_key_id.encode() not in stored


async def test_a_workspace_pulls_from_a_private_registry_with_its_own_login(
    tmp_path: Path, kube: KubeStandin, basic_registry: AuthRegistry
) -> None:
    login = {
        "host": basic_registry.server.host,
        "username": basic_registry.credentials.username,
        "password": basic_registry.credentials.password,
    }
    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        1,
        registries={"team-a": [login]},
    ) as cluster:
        with trio.fail_after(120):
            async with cluster.client("team-a") as alice:
                task = await alice.create_task(
                    TaskRequest(image=basic_registry.busybox, command=("echo", "pulled"))
                )
                done = await alice.wait_task(task.id)
            async with cluster.client("team-b") as bob:
                refused = await bob.create_task(
                    TaskRequest(image=basic_registry.busybox, command=("echo", "pulled"))
                )
                failed = await bob.wait_task(refused.id)
    assert done.state == "succeeded", done
    assert failed.state == "failed"
    assert failed.reason and basic_registry.server.host in failed.reason, failed.reason
    stored = b"".join(p.read_bytes() for p in (tmp_path / "cluster").glob("tasks.db*"))
    assert basic_registry.credentials.password.encode() not in stored
