"""A byte stream carried in the binary messages of a WebSocket.

Why this module exists: in tunnel mode the agent dials the controlplane over ``wss`` (the one
kind of connection that gets through corporate proxies and load balancers) and the whole HTTP/2
connection then runs inside that WebSocket. HTTP/2 needs a byte stream, so `WebSocketStream`
turns ``send_all`` calls into binary messages and messages back into ``receive_some`` bytes.
Message boundaries carry no meaning.

`wrap_client` and `wrap_server` open the WebSocket with settings fit for bulk transfer;
trio-websocket's defaults (4 KiB reads, 1 MiB messages, a queue of one message) would throttle a
tunnel that carries container images.
"""

from __future__ import annotations

import operator
from typing import cast

import trio
import trio_websocket

from agent.wire.conflict import ConflictDetector

__all__ = [
    "WS_MAX_MESSAGE_BYTES",
    "WS_MAX_SEND_BYTES",
    "WS_MESSAGE_QUEUE_SIZE",
    "WS_RECEIVE_BUFFER_BYTES",
    "WebSocketStream",
    "wrap_client",
    "wrap_server",
]

WS_RECEIVE_BUFFER_BYTES = 256 * 1024
"""How much the WebSocket reader asks its transport for at a time."""

WS_MAX_SEND_BYTES = 16 * 1024 * 1024
"""`WebSocketStream.send_all` splits its data into messages of at most this many bytes."""

WS_MAX_MESSAGE_BYTES = WS_MAX_SEND_BYTES + 64 * 1024
"""The largest message accepted: one maximal HTTP/2 frame (16 MiB) with room to spare."""

WS_MESSAGE_QUEUE_SIZE = 4
"""Messages received ahead of the reader; with the size limit this bounds a tunnel's memory."""

_NORMAL_CLOSE_CODES = frozenset({1000, 1001})
_UNSUPPORTED_DATA = 1003


def _describe(reason: trio_websocket.CloseReason | None) -> str:
    if reason is None:
        return "the WebSocket closed without a close code"
    text = f"the WebSocket closed with code {reason.code} ({reason.name})"
    if reason.reason:
        text += f": {reason.reason}"
    return text


class WebSocketStream(trio.abc.Stream):
    """A `trio.abc.Stream` over an open `trio_websocket.WebSocketConnection`.

    A normal close by the peer (code 1000 or 1001) reads as EOF; any other close, or a text
    message, raises `trio.BrokenResourceError`. At most one received message is held here (plus
    trio-websocket's bounded queue).
    """

    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        transport: trio.abc.Stream | None = None,
        *,
        close_timeout_s: float = 2.0,
    ) -> None:
        self._ws = ws
        # The stream under the WebSocket, closed directly when the closing handshake cannot
        # finish (its reader task is gone, or the peer does not answer).
        self._transport = transport
        self._close_timeout_s = close_timeout_s
        # The message being handed out, and how much of it has been.
        self._pending = b""
        self._offset = 0
        self._closed = False
        self._broken: str | None = None
        self._send_conflict = ConflictDetector(
            "another task is already sending on this WebSocket stream"
        )
        self._receive_conflict = ConflictDetector(
            "another task is already receiving on this WebSocket stream"
        )

    @property
    def websocket(self) -> trio_websocket.WebSocketConnection:
        """The WebSocket underneath."""
        return self._ws

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_conflict:
            self._check_usable()
            view = memoryview(data).cast("B")
            # Nothing has happened yet if we are cancelled here.
            await trio.lowlevel.checkpoint_if_cancelled()
            if not view:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            for start in range(0, len(view), WS_MAX_SEND_BYTES):
                message = (
                    data
                    if isinstance(data, bytes) and len(data) <= WS_MAX_SEND_BYTES
                    else bytes(view[start : start + WS_MAX_SEND_BYTES])
                )
                try:
                    await self._ws.send_message(message)
                except trio_websocket.ConnectionClosed as exc:
                    self._check_usable()
                    raise trio.BrokenResourceError(_describe(exc.reason)) from exc

    async def wait_send_all_might_not_block(self) -> None:
        # trio-websocket offers nothing to wait on; send_all itself applies the backpressure.
        with self._send_conflict:
            self._check_usable()
            await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        with self._receive_conflict:
            limit = None if max_bytes is None else operator.index(max_bytes)
            if limit is not None and limit < 1:
                raise ValueError(f"max_bytes must be at least 1, got {limit}")
            self._check_usable()
            if self._offset < len(self._pending):
                await trio.lowlevel.checkpoint()
            else:
                message = await self._next_message()
                if not message:
                    return b""
                self._pending, self._offset = message, 0
            # Nothing is awaited from here on, so a cancellation cannot lose what we take.
            start = self._offset
            end = len(self._pending) if limit is None else min(len(self._pending), start + limit)
            chunk = self._pending if start == 0 and end == len(self._pending) else None
            if chunk is None:
                chunk = self._pending[start:end]
            if end == len(self._pending):
                self._pending, self._offset = b"", 0
            else:
                self._offset = end
            return chunk

    async def _next_message(self) -> bytes:
        """The next non-empty binary message, or b"" after a normal close."""
        while True:
            try:
                message = await self._ws.get_message()
            except trio_websocket.ConnectionClosed as exc:
                # A closed channel raises without yielding; receive_some must always yield.
                await trio.lowlevel.checkpoint()
                self._check_usable()
                if exc.reason is not None and exc.reason.code in _NORMAL_CLOSE_CODES:
                    return b""
                raise trio.BrokenResourceError(_describe(exc.reason)) from exc
            if isinstance(message, str):
                self._broken = "the peer sent a text message, but this tunnel is binary"
                # Closing waits for the peer's reply; the caller's cancel scope bounds that.
                await self._ws.aclose(_UNSUPPORTED_DATA, "binary messages only")
                raise trio.BrokenResourceError(self._broken)
            if message:
                return message

    async def aclose(self) -> None:
        """Close the WebSocket normally (code 1000), waiting for the peer's reply."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        self._pending, self._offset = b"", 0
        with trio.move_on_after(self._close_timeout_s) as scope:
            await self._ws.aclose(1000)
        if scope.cancelled_caught and self._transport is not None:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._transport)
        # When the peer had already closed, trio-websocket returns without yielding.
        await trio.lowlevel.checkpoint()

    def _check_usable(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this WebSocket stream was closed")
        if self._broken is not None:
            raise trio.BrokenResourceError(self._broken)


async def wrap_client(
    nursery: trio.Nursery,
    stream: trio.abc.Stream,
    host: str,
    resource: str,
    *,
    headers: list[tuple[bytes, bytes]],
) -> trio_websocket.WebSocketConnection:
    """Open a client WebSocket over ``stream``, its reader task running in ``nursery``.

    Returns once the server accepted; raises trio-websocket's ``HandshakeError`` subclasses
    (``ConnectionRejected``) when it did not.
    """
    connection = await trio_websocket.wrap_client_stream(
        nursery,
        # Typed as SocketStream | SSLStream, but any trio stream works.
        cast(trio.SocketStream, stream),
        host,
        resource,
        extra_headers=headers,
        message_queue_size=WS_MESSAGE_QUEUE_SIZE,
        max_message_size=WS_MAX_MESSAGE_BYTES,
        receive_buffer_size=WS_RECEIVE_BUFFER_BYTES,
    )
    return connection


async def wrap_server(
    nursery: trio.Nursery, stream: trio.abc.Stream
) -> trio_websocket.WebSocketRequest:
    """Read a WebSocket handshake request from ``stream``; the caller accepts or rejects it."""
    request = await trio_websocket.wrap_server_stream(
        nursery,
        stream,
        message_queue_size=WS_MESSAGE_QUEUE_SIZE,
        max_message_size=WS_MAX_MESSAGE_BYTES,
        receive_buffer_size=WS_RECEIVE_BUFFER_BYTES,
    )
    return request
