"""The worker API over in-memory streams: requests, errors, auth, CONNECT, WebSocket."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from agent.api.client import WorkerClient, open_worker_client
from agent.daemon.routes import WorkerState, build_router
from agent.wire.connection import Http2Connection
from agent.wire.errors import ApiError, ErrorCode
from agent.wire.service import ConnectPolicy, Service, bearer_auth

TOKEN = "s3cr3t-token"


@pytest.fixture
async def client(nursery: trio.Nursery) -> AsyncIterator[WorkerClient]:
    server_side, client_side = trio.testing.memory_stream_pair()
    service = Service(
        build_router(WorkerState("w-1", "direct")),
        authenticate=bearer_auth(TOKEN),
        connect_policy=ConnectPolicy(loopback=True),
    )
    conn = Http2Connection(server_side, client_side=False, handler=service)
    nursery.start_soon(conn.run)
    async with open_worker_client(client_side, token=TOKEN) as c:
        yield c


async def test_health_and_worker(client: WorkerClient) -> None:
    health = await client.health()
    assert health.status == "ok"
    assert health.worker_id == "w-1"
    info = await client.worker()
    assert info.worker_id == "w-1"
    assert info.mode == "direct"
    assert info.uptime_s >= 0


async def test_unknown_route_is_not_found(client: WorkerClient) -> None:
    with pytest.raises(ApiError) as err:
        await client.call("GET", "/v1/nope")
    assert err.value.code is ErrorCode.NOT_FOUND


async def test_wrong_token_is_refused_before_routing(nursery: trio.Nursery) -> None:
    server_side, client_side = trio.testing.memory_stream_pair()
    service = Service(
        build_router(WorkerState("w-1", "direct")),
        authenticate=bearer_auth(TOKEN),
        connect_policy=ConnectPolicy(),
    )
    conn = Http2Connection(server_side, client_side=False, handler=service)
    nursery.start_soon(conn.run)
    async with open_worker_client(client_side, token="wrong") as c:
        with pytest.raises(ApiError) as err:
            await c.health()
        assert err.value.code is ErrorCode.UNAUTHENTICATED
        with pytest.raises(ApiError) as err:
            await c.call("GET", "/v1/nope")
        assert err.value.code is ErrorCode.UNAUTHENTICATED


async def test_connect_carries_bytes_both_ways(client: WorkerClient, nursery: trio.Nursery) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                await stream.send_all(data)

    nursery.start_soon(trio.serve_listeners, echo, listeners)
    payload = bytes(range(256)) * 40_000
    stream = await client.connect_tcp("127.0.0.1", port)
    received = hashlib.sha256()
    count = 0

    async def reader() -> None:
        nonlocal count
        while data := await stream.receive_some():
            received.update(data)
            count += len(data)

    async with trio.open_nursery() as inner:
        inner.start_soon(reader)
        await stream.send_all(payload)
        await stream.send_eof()
    await stream.aclose()
    assert count == len(payload)
    assert received.hexdigest() == hashlib.sha256(payload).hexdigest()


async def test_connect_outside_policy_is_denied(client: WorkerClient) -> None:
    with pytest.raises(ApiError) as err:
        await client.connect_tcp("10.1.2.3", 80)
    assert err.value.code is ErrorCode.PERMISSION_DENIED
    assert "10.1.2.3:80" in err.value.message


async def test_websocket_echo(client: WorkerClient) -> None:
    ws = await client.open_websocket("/v1/echo")
    await ws.send_message(b"hello")
    assert await ws.receive_message() == b"hello"
    await ws.send_message("text")
    assert await ws.receive_message() == "text"
    await ws.aclose()


async def test_early_answer_to_a_large_body_is_returned(nursery: trio.Nursery) -> None:
    # A wrong token is refused before the body is read; the client still gets the 401,
    # not "worker unavailable", even though the server resets the rest of the upload.
    server_side, client_side = trio.testing.memory_stream_pair()
    service = Service(build_router(WorkerState("w-1", "direct")), authenticate=bearer_auth(TOKEN))
    conn = Http2Connection(server_side, client_side=False, handler=service)
    nursery.start_soon(conn.run)
    async with open_worker_client(client_side, token="wrong") as c:
        with pytest.raises(ApiError) as err:
            await c.call("POST", "/v1/health", {"data": "x" * (20 * 1024 * 1024)})
        assert err.value.code is ErrorCode.UNAUTHENTICATED
