"""Tests for wire.wsstream: a byte stream inside WebSocket binary messages."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
import trio
import trio.testing
from wsproto import ConnectionType
from wsproto.connection import Connection
from wsproto.events import BytesMessage, CloseConnection
from wsproto.events import Ping as WsprotoPing
from wsproto.events import Pong as WsprotoPong

from wire.websocket import OP_BINARY, OP_CLOSE, OP_TEXT, FrameDecoder, encode_frame
from wire.wsstream import (
    WS_MAX_SEND_BYTES,
    ConnectionRejected,
    HandshakeError,
    WebSocketStream,
    open_websocket,
    read_upgrade,
)


async def open_pair(
    transports: tuple[trio.abc.Stream, trio.abc.Stream] | None = None,
) -> tuple[WebSocketStream, WebSocketStream]:
    """A connected (client, server) pair over an in-memory stream pair."""
    if transports is None:
        transports = trio.testing.memory_stream_pair()
    client_transport, server_transport = transports
    server: WebSocketStream | None = None

    async def serve() -> None:
        nonlocal server
        request = await read_upgrade(server_transport)
        assert request.path == "/tunnel"
        assert (b"x-worker", b"w1") in request.headers
        server = await request.accept()

    async with trio.open_nursery() as handshakes:
        handshakes.start_soon(serve)
        client = await open_websocket(
            client_transport, "controlplane.example", "/tunnel", headers=[(b"x-worker", b"w1")]
        )
    assert server is not None
    return client, server


async def test_generic_stream_contract() -> None:
    await trio.testing.check_two_way_stream(open_pair, None)


async def test_32_mib_arrive_intact() -> None:
    client, server = await open_pair()
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


async def test_send_larger_than_one_frame_is_split() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()
    client = WebSocketStream(client_transport, client_side=True)
    decoder = FrameDecoder(client_side=False)
    sizes: list[int] = []

    async def read_headers() -> None:
        # The frame headers on the wire: two frames, the first of the largest size.
        received = 0
        while received < WS_MAX_SEND_BYTES + 10:
            decoder.receive_data(await server_transport.receive_some())
            while (piece := decoder.next_event()) is not None:
                assert isinstance(piece, bytes)
                received += len(piece)
                if decoder._remaining == 0:
                    sizes.append(received - sum(sizes))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_headers)
        await client.send_all(b"z" * (WS_MAX_SEND_BYTES + 10))
    assert sizes == [WS_MAX_SEND_BYTES, 10]


async def test_a_frame_is_handed_out_in_parts() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()
    client = WebSocketStream(client_transport, client_side=True)
    await server_transport.send_all(
        encode_frame(OP_BINARY, b"abcdefgh", mask=False)
        + encode_frame(OP_BINARY, b"ij", mask=False)
    )
    assert await client.receive_some(3) == b"abc"
    assert await client.receive_some(3) == b"def"
    assert await client.receive_some() == b"gh"
    assert await client.receive_some(100) == b"ij"


async def test_a_text_message_breaks_the_stream_with_1003() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()
    client = WebSocketStream(client_transport, client_side=True)
    await server_transport.send_all(encode_frame(OP_TEXT, b"not bytes", mask=False))
    with pytest.raises(trio.BrokenResourceError, match="text message"):
        await client.receive_some()
    with pytest.raises(trio.BrokenResourceError, match="text message"):
        await client.receive_some()
    theirs = Connection(ConnectionType.SERVER)
    theirs.receive_data(bytes(await server_transport.receive_some()))
    (close,) = list(theirs.events())
    assert isinstance(close, CloseConnection) and close.code == 1003


async def test_an_abnormal_close_names_the_code_and_is_answered() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()
    client = WebSocketStream(client_transport, client_side=True)
    theirs = Connection(ConnectionType.SERVER)
    await server_transport.send_all(
        theirs.send(BytesMessage(data=b"before"))
        + theirs.send(CloseConnection(code=4001, reason="worker deregistered"))
    )
    assert await client.receive_some() == b"before"
    with pytest.raises(trio.BrokenResourceError, match="4001: worker deregistered"):
        await client.receive_some()
    with pytest.raises(trio.BrokenResourceError):
        await client.send_all(b"anyone there?")
    theirs.receive_data(bytes(await server_transport.receive_some()))
    (answer,) = list(theirs.events())
    assert isinstance(answer, CloseConnection) and answer.code == 4001


async def test_a_ping_is_answered_between_payloads() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()
    client = WebSocketStream(client_transport, client_side=True)
    theirs = Connection(ConnectionType.SERVER)
    await server_transport.send_all(
        theirs.send(BytesMessage(data=b"one"))
        + theirs.send(WsprotoPing(payload=b"hello?"))
        + theirs.send(BytesMessage(data=b"two"))
    )
    assert await client.receive_some() == b"one"
    assert await client.receive_some() == b"two"
    theirs.receive_data(bytes(await server_transport.receive_some()))
    assert list(theirs.events()) == [WsprotoPong(payload=b"hello?")]


async def test_a_lost_transport_is_a_broken_stream() -> None:
    transports = trio.testing.memory_stream_pair()
    client, _server = await open_pair(transports)
    await trio.aclose_forcefully(transports[1])  # the TCP connection drops
    with pytest.raises(trio.BrokenResourceError, match="1006"):
        await client.receive_some()


@pytest.mark.parametrize("code", [1000, 1001])
async def test_a_normal_close_is_eof(code: int) -> None:
    client, server = await open_pair()
    await server.send_all(b"bye")
    close = encode_frame(OP_CLOSE, struct.pack("!H", code), mask=False)
    await server.transport.send_all(close)
    assert await client.receive_some() == b"bye"
    assert await client.receive_some() == b""
    assert await client.receive_some() == b""
    await client.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await client.receive_some()


async def test_aclose_waits_for_the_peers_answer_then_closes_the_transport() -> None:
    client, server = await open_pair()

    async def peer() -> None:
        assert await server.receive_some() == b""  # our close reads as EOF there
        await server.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer)
        await client.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await client.transport.send_all(b"x")


async def test_a_rejection_carries_the_status_and_body() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()

    async def refuse() -> None:
        request = await read_upgrade(server_transport)
        await request.reject(401, body=b"wrong or missing worker token\n")
        await server_transport.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(refuse)
        with pytest.raises(ConnectionRejected, match="HTTP 401: wrong or missing") as info:
            await open_websocket(client_transport, "cp", "/tunnel", headers=[])
    assert info.value.status_code == 401


async def test_a_plain_get_is_told_this_is_a_websocket_address() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()
    await client_transport.send_all(b"GET /v1/workers/w1/tunnel HTTP/1.1\r\nhost: cp\r\n\r\n")
    with pytest.raises(HandshakeError, match="WebSocket upgrades only"):
        await read_upgrade(server_transport)
    answer = await client_transport.receive_some()
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"WebSocket upgrades only" in answer


async def test_a_server_gone_mid_handshake_is_a_handshake_error() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()

    async def vanish() -> None:
        await server_transport.receive_some()
        await server_transport.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(vanish)
        with pytest.raises(HandshakeError, match="closed the connection"):
            await open_websocket(client_transport, "cp", "/tunnel", headers=[])
