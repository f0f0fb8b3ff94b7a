"""Tests for agent.wire.wsstream: a byte stream inside WebSocket binary messages."""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio
import trio.testing
import trio_websocket

from agent.wire.wsstream import WS_MAX_SEND_BYTES, WebSocketStream, wrap_client, wrap_server

WebSocketPair = tuple[trio_websocket.WebSocketConnection, trio_websocket.WebSocketConnection]


async def open_websockets(
    nursery: trio.Nursery,
    transports: tuple[trio.abc.Stream, trio.abc.Stream] | None = None,
) -> WebSocketPair:
    """A connected (client, server) WebSocket pair over an in-memory stream pair."""
    if transports is None:
        transports = trio.testing.memory_stream_pair()
    client_transport, server_transport = transports
    server_ws: trio_websocket.WebSocketConnection | None = None

    async def serve() -> None:
        nonlocal server_ws
        request = await wrap_server(nursery, server_transport)
        assert request.path == "/tunnel"
        assert (b"x-worker", b"w1") in request.headers
        server_ws = await request.accept()

    async with trio.open_nursery() as handshakes:
        handshakes.start_soon(serve)
        client_ws = await wrap_client(
            nursery,
            client_transport,
            "controlplane.example",
            "/tunnel",
            headers=[(b"x-worker", b"w1")],
        )
    assert server_ws is not None
    return client_ws, server_ws


@pytest.fixture
async def background() -> AsyncIterator[trio.Nursery]:
    """A nursery for the WebSocket reader tasks, cancelled when the test ends."""
    async with trio.open_nursery() as nursery:
        yield nursery
        nursery.cancel_scope.cancel()


def stream_maker(
    nursery: trio.Nursery,
) -> Callable[[], Awaitable[tuple[trio.abc.Stream, trio.abc.Stream]]]:
    async def make() -> tuple[trio.abc.Stream, trio.abc.Stream]:
        client_ws, server_ws = await open_websockets(nursery)
        return WebSocketStream(client_ws), WebSocketStream(server_ws)

    return make


async def test_generic_stream_contract(background: trio.Nursery) -> None:
    await trio.testing.check_two_way_stream(stream_maker(background), None)


async def test_32_mib_arrive_intact(background: trio.Nursery) -> None:
    client_ws, server_ws = await open_websockets(background)
    client, server = WebSocketStream(client_ws), WebSocketStream(server_ws)
    payload = random.Random(3).randbytes(32 * 1024 * 1024)
    digest = hashlib.sha256()

    async def receive_all() -> None:
        while chunk := await server.receive_some():
            digest.update(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_all)
        view = memoryview(payload)
        step = 1024 * 1024 + 13
        for start in range(0, len(payload), step):
            await client.send_all(view[start : start + step])
        await client.aclose()
    assert digest.hexdigest() == hashlib.sha256(payload).hexdigest()


async def test_send_larger_than_one_message_is_split(background: trio.Nursery) -> None:
    client_ws, server_ws = await open_websockets(background)
    client = WebSocketStream(client_ws)
    payload = b"z" * (WS_MAX_SEND_BYTES + 10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, payload)
        # The peer would have closed with 1009 (too big) had this gone as one message.
        assert len(await server_ws.get_message()) == WS_MAX_SEND_BYTES
        assert await server_ws.get_message() == b"z" * 10


async def test_message_is_handed_out_in_parts(background: trio.Nursery) -> None:
    client_ws, server_ws = await open_websockets(background)
    client = WebSocketStream(client_ws)
    await server_ws.send_message(b"abcdefgh")
    await server_ws.send_message(b"ij")
    assert await client.receive_some(3) == b"abc"
    assert await client.receive_some(3) == b"def"
    assert await client.receive_some() == b"gh"
    assert await client.receive_some(100) == b"ij"


async def test_text_message_breaks_the_stream(background: trio.Nursery) -> None:
    client_ws, server_ws = await open_websockets(background)
    client = WebSocketStream(client_ws)

    async def peer() -> None:
        await server_ws.send_message("not bytes")
        with pytest.raises(trio_websocket.ConnectionClosed) as info:
            await server_ws.get_message()
        assert info.value.reason is not None
        assert info.value.reason.code == 1003

    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer)
        with pytest.raises(trio.BrokenResourceError, match="text message"):
            await client.receive_some()
    with pytest.raises(trio.BrokenResourceError, match="text message"):
        await client.receive_some()


async def test_abnormal_close_names_the_code(background: trio.Nursery) -> None:
    client_ws, server_ws = await open_websockets(background)
    client = WebSocketStream(client_ws)
    await server_ws.send_message(b"before")
    await server_ws.aclose(4001, "worker deregistered")
    assert await client.receive_some() == b"before"
    with pytest.raises(trio.BrokenResourceError) as info:
        await client.receive_some()
    assert "4001" in str(info.value)
    assert "worker deregistered" in str(info.value)
    with pytest.raises(trio.BrokenResourceError):
        await client.send_all(b"anyone there?")


async def test_lost_transport_is_a_broken_stream(background: trio.Nursery) -> None:
    transports = trio.testing.memory_stream_pair()
    client_ws, _server_ws = await open_websockets(background, transports)
    client = WebSocketStream(client_ws)
    await trio.aclose_forcefully(transports[1])  # the TCP connection drops
    with pytest.raises(trio.BrokenResourceError, match="1006"):
        await client.receive_some()


@pytest.mark.parametrize("code", [1000, 1001])
async def test_normal_close_is_eof(background: trio.Nursery, code: int) -> None:
    client_ws, server_ws = await open_websockets(background)
    client = WebSocketStream(client_ws)
    await server_ws.send_message(b"bye")
    await server_ws.aclose(code)
    assert await client.receive_some() == b"bye"
    assert await client.receive_some() == b""
    assert await client.receive_some() == b""
    await client.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await client.receive_some()
