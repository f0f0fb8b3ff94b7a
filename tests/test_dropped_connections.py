"""An agent whose controlplane drops its connections keeps running and retries.

A controlplane restarting, or a load balancer in front of it, can accept a connection and end
it at any point before HTTP/2 is under way. Each stage gets a listener of its own on the
controlplane's address: one that closes at once, one that resets (RST) right after the TLS
handshake, one that reads the HTTP/2 preface and closes. The agent, in either mode, must keep
dialling with its backoff, and register as soon as a real controlplane takes the address.
"""

from __future__ import annotations

import socket
import ssl
import struct
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from agent.daemon.run import run_agent
from control.api.server import Controlplane
from sim.configs import Pki, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.workers import agent_config
from wire.http2 import PREFACE

STAGES = ["at-once", "reset-after-tls", "after-preface"]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


def _reset(stream: trio.SocketStream) -> None:
    """Close with RST instead of FIN (SO_LINGER 0), as a load balancer resetting does."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def _dropping_listener(
    pki: Pki, stage: str, accepted: list[int], *, task_status: trio.TaskStatus[int]
) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.cert_file, pki.key_file)
    context.set_alpn_protocols(["h2", "http/1.1"])

    async def handle(tcp: trio.SocketStream) -> None:
        accepted.append(1)
        if stage == "at-once":
            await tcp.aclose()
            return
        tls = trio.SSLStream(tcp, context, server_side=True)
        try:
            await tls.do_handshake()
            if stage == "after-preface":
                received = b""
                while len(received) < len(PREFACE):
                    data = await tls.receive_some()
                    if not data:
                        break
                    received += data
            else:
                _reset(tcp)
        except trio.BrokenResourceError:
            pass
        await tcp.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = int(listeners[0].socket.getsockname()[1])
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(port)
        await trio.sleep_forever()


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
@pytest.mark.parametrize("stage", STAGES)
async def test_the_agent_outlives_dropped_connections_and_registers_later(
    pki: Pki, stage: str, mode: str
) -> None:
    accepted: list[int] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            dropping = trio.CancelScope()

            async def drop(*, task_status: trio.TaskStatus[int]) -> None:
                with dropping:
                    await _dropping_listener(pki, stage, accepted, task_status=task_status)

            port: int = await nursery.start(drop)
            agent_exited = trio.Event()

            async def agent() -> None:
                try:
                    await run_agent(agent_config(pki, port, mode=mode))
                finally:
                    agent_exited.set()

            nursery.start_soon(agent)
            # Several dials were dropped, and the agent is still there.
            while len(accepted) < 3:
                assert not agent_exited.is_set(), "the agent exited on a dropped connection"
                await trio.sleep(0.05)
            assert not agent_exited.is_set()
            dropping.cancel()
            await trio.lowlevel.checkpoint()
            control: Controlplane = await nursery.start(
                run_controlplane, control_config(pki, port=port)
            )
            client = await control.registry.client_for(f"w-{mode}")
            assert (await client.health()).status == "ok"
            assert not agent_exited.is_set()
            nursery.cancel_scope.cancel()
