"""Where a worker's plain CONNECT may go: its containers' declared ports, and its loopback only
behind LEVERS9_LOOPBACK_CONNECT=on (with hostNetwork the worker's loopback is the node's).

The worker side is the agent's own service (`build_service`) over memory streams, reaching a
listener of the test's on loopback; the controlplane side is its CONNECT dialer, which refuses
an undeclared port before it asks any worker. A container's declared and undeclared ports,
with runc: tests/test_containers.py and tests/test_e2e.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import attrs
import pytest
import trio
import trio.testing

from agent.daemon.config import AgentConfig, ConfigError, load_config
from agent.daemon.routes import WorkerState
from agent.daemon.run import build_service
from control.api.endpoints import EndpointProxy
from control.api.tasks import TaskRoutes, undeclared_port
from control.kube.manifests import PoolSettings, job_manifest, job_name, token_secret_name
from control.models import TaskState
from control.tasks.dispatch import Dispatcher
from control.tasks.store import TaskRecord, TaskSpec
from tests.streams import exchange
from wire.connection import Http2Connection
from wire.errors import ApiError, ErrorCode
from wire.service import Router
from workerapi.client import WorkerClient, open_worker_client

TOKEN = "worker-s3cr3t-token"


def _config(**changes: Any) -> AgentConfig:
    return AgentConfig(
        worker_id="w-1",
        token=TOKEN,
        mode="direct",
        controlplane_url="https://cp.example.com",
        **changes,
    )


@contextlib.asynccontextmanager
async def _worker(nursery: trio.Nursery, config: AgentConfig) -> AsyncIterator[WorkerClient]:
    """A client of the agent's own service for `config`, over memory streams."""
    service = build_service(config, WorkerState(worker_id=config.worker_id, mode=config.mode))
    server_side, client_side = trio.testing.memory_stream_pair()
    nursery.start_soon(Http2Connection(server_side, client_side=False, handler=service).run)
    async with open_worker_client(client_side, token=TOKEN) as client:
        yield client


@pytest.fixture
async def node_port(nursery: trio.Nursery) -> int:
    """A service of the node's on its loopback, as the kubelet's ports are: it echoes."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                await stream.send_all(data)

    nursery.start_soon(trio.serve_listeners, echo, listeners)
    return int(listeners[0].socket.getsockname()[1])


async def _echoes(worker: WorkerClient, host: str, port: int) -> bytes:
    return await exchange(await worker.connect_tcp(host, port), b"ping " + host.encode())


# -- the worker: its loopback only behind the setting ----------------------------------------------


async def test_loopback_connect_is_refused_by_default_naming_the_setting(
    nursery: trio.Nursery, node_port: int
) -> None:
    assert _config().loopback_connect is False
    async with _worker(nursery, _config()) as worker:
        for host in ("127.0.0.1", "::1", "10.1.2.3"):
            with pytest.raises(ApiError) as err:
                await worker.connect_tcp(host, node_port)
            assert err.value.code is ErrorCode.PERMISSION_DENIED
            assert f"{host}:{node_port}" in err.value.message
            assert "declared ports" in err.value.message
            assert "LEVERS9_LOOPBACK_CONNECT=on" in err.value.message


async def test_loopback_connect_is_carried_with_the_setting_on(
    nursery: trio.Nursery, node_port: int
) -> None:
    async with _worker(nursery, _config(loopback_connect=True)) as worker:
        assert await _echoes(worker, "127.0.0.1", node_port) == b"ping 127.0.0.1"
        # The setting opens the loopback, nothing else.
        with pytest.raises(ApiError) as err:
            await worker.connect_tcp("10.1.2.3", 80)
        assert err.value.code is ErrorCode.PERMISSION_DENIED
        assert "only its loopback" in err.value.message


async def test_connect_reaches_ipv4_and_ipv6_addresses_and_names_a_closed_port(
    nursery: trio.Nursery,
) -> None:
    """An address is dialled straight (no name lookup): both families arrive, and a port
    nobody listens on is refused in words that name it."""

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                await stream.send_all(data)

    v4 = await trio.open_tcp_listeners(0, host="127.0.0.1")
    v6 = await trio.open_tcp_listeners(0, host="::1")
    nursery.start_soon(trio.serve_listeners, echo, v4 + v6)
    port4 = int(v4[0].socket.getsockname()[1])
    port6 = int(v6[0].socket.getsockname()[1])
    closed = await trio.open_tcp_listeners(0, host="127.0.0.1")
    closed_port = int(closed[0].socket.getsockname()[1])
    await closed[0].aclose()
    async with _worker(nursery, _config(loopback_connect=True)) as worker:
        assert await _echoes(worker, "127.0.0.1", port4) == b"ping 127.0.0.1"
        assert await _echoes(worker, "::1", port6) == b"ping ::1"
        with pytest.raises(ApiError) as err:
            await worker.connect_tcp("127.0.0.1", closed_port)
        assert err.value.code is ErrorCode.UNAVAILABLE
        assert f"cannot reach 127.0.0.1:{closed_port} on the worker" in err.value.message


@pytest.mark.parametrize(("raw", "expected"), [(None, False), ("off", False), ("on", True)])
def test_the_setting_is_read_from_the_agents_environment(raw: str | None, expected: bool) -> None:
    env = {
        "LEVERS9_WORKER_ID": "w-1",
        "LEVERS9_WORKER_TOKEN": TOKEN,
        "LEVERS9_CONTROLPLANE_URL": "https://cp.example.com",
    }
    if raw is not None:
        env["LEVERS9_LOOPBACK_CONNECT"] = raw
    assert load_config(env).loopback_connect is expected


def test_a_wrong_value_of_the_setting_is_refused_by_name() -> None:
    env = {
        "LEVERS9_WORKER_ID": "w-1",
        "LEVERS9_WORKER_TOKEN": TOKEN,
        "LEVERS9_CONTROLPLANE_URL": "https://cp.example.com",
        "LEVERS9_LOOPBACK_CONNECT": "yes please",
    }
    with pytest.raises(ConfigError) as err:
        load_config(env)
    assert err.value.variable == "LEVERS9_LOOPBACK_CONNECT"
    assert "'on' or 'off'" in str(err.value)


@pytest.mark.parametrize("host_network", [True, False])
def test_the_worker_job_keeps_loopback_connect_off(host_network: bool) -> None:
    settings = PoolSettings(
        name="p", namespace="ns", image="img", tunnel=True, host_network=host_network
    )
    name = job_name("p", "n1", 0)
    manifests = job_manifest(
        settings, "n1", 1, name, token_secret_name(name), "https://cp", token="s3cret"
    )
    env_list = manifests.job["spec"]["template"]["spec"]["containers"][0]["env"]
    rendered = {e["name"]: e["value"] for e in env_list if "value" in e}
    assert rendered["LEVERS9_LOOPBACK_CONNECT"] == "off"
    # ...and the agent reads the Job's environment as off.
    agent_env = {**rendered, "LEVERS9_WORKER_TOKEN": "s3cret"}
    assert load_config(agent_env).loopback_connect is False


# -- the controlplane: an undeclared port is refused before any worker is asked --------------------


def test_an_undeclared_port_is_named_with_the_declared_ones() -> None:
    assert undeclared_port("t-1", (8080, 9000), 9000) is None
    assert undeclared_port("t-1", (8080, 9000), 7000) == (
        "task t-1 declares no port 7000 (its ports: 8080, 9000); "
        "declare it with --port when running the task"
    )
    assert "(its ports: none)" in (undeclared_port("t-1", (), 22) or "")


@attrs.define
class _OneRunningTask:
    """The part of `Dispatcher` a box-port CONNECT uses, for one running task."""

    record: TaskRecord
    store: object = None
    asked: list[tuple[str, int]] = attrs.field(factory=list)

    async def running_record(self, workspace: str, task_id: str) -> TaskRecord:
        assert (workspace, task_id) == (self.record.workspace, self.record.id)
        return self.record

    async def on_worker(
        self, worker_id: str, call: Callable[[Any], Awaitable[trio.abc.HalfCloseableStream]]
    ) -> trio.abc.HalfCloseableStream:
        asked = self.asked

        class Worker:
            async def connect_tcp_early(self, host: str, port: int) -> trio.abc.HalfCloseableStream:
                asked.append((host, port))
                return trio.testing.memory_stream_pair()[0]

        return await call(Worker())


async def test_the_controlplane_refuses_a_box_port_the_task_did_not_declare() -> None:
    record = TaskRecord(
        id="t-1",
        workspace="team",
        spec=TaskSpec(image="busybox", ports=(8080,)),
        state=TaskState.RUNNING,
        created_at=0.0,
        worker="w-1",
    )
    dispatcher = _OneRunningTask(record)
    dial = TaskRoutes(cast(Dispatcher, dispatcher), EndpointProxy()).add_to(Router())
    with pytest.raises(ApiError) as err:
        await dial("t-1", 7000, "ws:team")
    assert err.value.code is ErrorCode.PERMISSION_DENIED
    assert "declares no port 7000 (its ports: 8080)" in err.value.message
    assert dispatcher.asked == []  # no worker was asked
    stream = await dial("t-1", 8080, "ws:team")
    await stream.aclose()
    assert dispatcher.asked == [("t-1", 8080)]


def test_a_pool_with_agent_metrics_gives_its_workers_the_listener() -> None:
    base = PoolSettings(name="p", namespace="ns", image="img", tunnel=True)
    name = job_name("p", "n1", 0)
    for settings, expected in (
        (base, None),
        (attrs.evolve(base, metrics_port=9400), ("127.0.0.1", 9400)),
    ):
        manifests = job_manifest(
            settings, "n1", 1, name, token_secret_name(name), "https://cp", token="s3cret"
        )
        env_list = manifests.job["spec"]["template"]["spec"]["containers"][0]["env"]
        rendered = {e["name"]: e["value"] for e in env_list if "value" in e}
        metrics = load_config({**rendered, "LEVERS9_WORKER_TOKEN": "s3cret"}).metrics
        assert (None if metrics is None else (metrics.host, metrics.port)) == expected


async def test_bytes_sent_with_a_connect_arrive_first_and_a_refusal_still_says_why(
    nursery: trio.Nursery, node_port: int
) -> None:
    """The endpoint route sends a request's head with its CONNECT, before the worker has
    answered: the listener gets those bytes ahead of what follows, and a CONNECT the worker
    refuses fails with the worker's reason, not a broken stream."""
    async with _worker(nursery, _config(loopback_connect=True)) as worker:
        stream = await worker.connect_tcp("127.0.0.1", node_port, first=b"GET / HTTP/1.1\r\n")
        await stream.send_all(b"\r\n")
        await stream.send_eof()
        echoed = b""
        while data := await stream.receive_some():
            echoed += data
        await stream.aclose()
        assert echoed == b"GET / HTTP/1.1\r\n\r\n"
        with pytest.raises(ApiError) as err:
            await worker.connect_tcp("10.1.2.3", 80, first=b"GET / HTTP/1.1\r\n\r\n")
        assert err.value.code is ErrorCode.PERMISSION_DENIED
        assert "only its loopback" in err.value.message
        # The connection carries on: the refused stream's bytes were dropped, not queued.
        assert await _echoes(worker, "127.0.0.1", node_port) == b"ping 127.0.0.1"
