"""A controlplane replica that stops drains: its port closes at once, every connection gets a
GOAWAY, a tunnel's agent opens its next tunnel at once (through the Service, to another
replica) while what is in flight on the old one finishes; and the process does it on SIGTERM.

Two replicas on loopback share one PostgreSQL database; the "Service" in front of them is a
small TCP forwarder that sends each connection to the first replica that accepts it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

from agent.daemon.run import run_agent
from control.api.server import Controlplane
from control.config import DatabaseSettings
from control.tasks.store import TaskSpec
from sim.configs import API_TOKEN, Pki, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.workers import agent_config

pytest_plugins = ["tests.postgres_fixtures"]

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def pipe(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        async for data in source:
            await sink.send_all(data)
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await sink.send_eof()


async def serve_service(
    port: int, backends: list[int], *, task_status: trio.TaskStatus[list[trio.SocketListener]]
) -> None:
    """Each connection to `port` goes to the first backend that accepts it."""

    async def forward(client: trio.SocketStream) -> None:
        async with client:
            for backend in backends:
                try:
                    upstream = await trio.open_tcp_stream("127.0.0.1", backend)
                except OSError:
                    continue
                async with upstream, trio.open_nursery() as nursery:
                    nursery.start_soon(pipe, client, upstream)
                    nursery.start_soon(pipe, upstream, client)
                return

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    await trio.serve_listeners(forward, listeners, task_status=task_status)


async def echo(stream: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError):
        async for data in stream:
            await stream.send_all(data)


@asynccontextmanager
async def replicas(
    pki: Pki, database: DatabaseSettings, nursery: trio.Nursery
) -> AsyncIterator[tuple[Controlplane, Controlplane, trio.CancelScope]]:
    """Replicas A and B over one database; cancelling the scope stops A."""
    configs = [attrs.evolve(control_config(pki), database=database, drain_s=60.0)]
    configs.append(attrs.evolve(configs[0]))
    a_scope = trio.CancelScope()

    async def serve_a(*, task_status: trio.TaskStatus[Controlplane]) -> None:
        with a_scope:
            await run_controlplane(configs[0], task_status=task_status)

    a: Controlplane = await nursery.start(serve_a)
    b: Controlplane = await nursery.start(run_controlplane, configs[1])
    yield a, b, a_scope


async def test_a_draining_replica_hands_its_tunnel_to_another_and_lets_streams_finish(
    tmp_path: Path, postgres_database: DatabaseSettings
) -> None:
    pki = make_pki(tmp_path)
    async with trio.open_nursery() as nursery:
        async with replicas(pki, postgres_database, nursery) as (a, b, stop_a):
            service = free_port()
            await nursery.start(serve_service, service, [a.port, b.port])
            echo_listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            echo_port = echo_listeners[0].socket.getsockname()[1]
            nursery.start_soon(trio.serve_listeners, echo, echo_listeners)
            config = agent_config(pki, service, mode="tunnel", loopback_connect=True)
            nursery.start_soon(run_agent, config)
            worker = config.worker_id
            with trio.fail_after(20):
                on_a = await a.registry.client_for(worker)
                # Something in flight on A's tunnel: a TCP stream to the worker's host.
                stream = await on_a.connect_tcp("127.0.0.1", echo_port)
                await stream.send_all(b"before\n")
                assert await stream.receive_some() == b"before\n"

            async with trio.open_nursery() as draining:
                draining.start_soon(a.drain, 60.0)
                with trio.fail_after(20):  # A lets the stream run for up to 60 s
                    # A's port is closed at once: the Service sends new connections to B.
                    while True:
                        try:
                            probe = await trio.open_tcp_stream("127.0.0.1", a.port)
                        except OSError:
                            break
                        await probe.aclose()
                        await trio.sleep(0.01)
                    # The agent opens its next tunnel at once, through the Service, to B.
                    on_b = await b.registry.client_for(worker)
                    assert (await on_b.health()).worker_id == worker
                    # The stream in flight on A's tunnel still works meanwhile.
                    await stream.send_all(b"during\n")
                    assert await stream.receive_some() == b"during\n"
                    assert not on_a.conn.closed
                    await stream.aclose()
                # With nothing in flight, A's drain ends long before its 60 s.
            assert on_a.conn.closed or on_a.conn.statistics().open_streams == 0
            # Records are the database's, not a replica's.
            task = await a.dispatcher.store.create("ws", TaskSpec(image="busybox"))
            assert (await b.dispatcher.store.get("ws", task.id)).id == task.id
            stop_a.cancel()
            nursery.cancel_scope.cancel()


async def test_the_controlplane_process_drains_on_sigterm_and_exits_cleanly(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path)
    port = free_port()
    values = {
        "config": {
            "publicUrl": f"https://127.0.0.1:{port}",
            "listen": f"127.0.0.1:{port}",
            "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
            "apiTokens": [{"name": "tests", "token": API_TOKEN}],
            "database": {"path": str(tmp_path / "tasks.db")},
            "drainS": 30,
        }
    }
    path = tmp_path / "values.json"
    path.write_text(json.dumps(values))
    env = {**os.environ, "LEVERS9_LOG_LEVEL": "WARNING"}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "control.main", "serve", "--config", str(path)],
        cwd=REPO,
        env=env,
    )
    try:
        with trio.fail_after(30):
            while True:
                try:
                    conn = await trio.open_tcp_stream("127.0.0.1", port)
                    break
                except OSError:
                    await trio.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(25):  # nothing in flight: well inside its 30 s
            await process.wait()
        assert process.returncode == 0
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)
        await conn.aclose()
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
