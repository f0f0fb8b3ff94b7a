"""WebSocket messages over one HTTP/2 stream (RFC 8441 extended CONNECT).

Exec needs a bidirectional, message-framed channel per command (stdin, stdout, stderr, resize,
exit code); RFC 8441 gives each one its own HTTP/2 stream on the connection the controlplane
already has, instead of a new TCP+TLS handshake. The opening handshake is the extended CONNECT
itself, so what runs on the stream is plain WebSocket framing: wsproto's frame-level
`Connection` (sans-IO) driven over the stream's bytes.
"""

from __future__ import annotations

import trio
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.utilities import LocalProtocolError

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CLOSE_WAIT_S = 2.0


class WebSocketClosed(trio.BrokenResourceError):
    """The WebSocket is closed; `code` and `reason` are what the closing side said."""

    def __init__(self, code: int, reason: str | None) -> None:
        super().__init__(f"websocket closed ({code}{': ' + reason if reason else ''})")
        self.code = code
        self.reason = reason


class H2WebSocket:
    """Send and receive whole WebSocket messages over a byte stream (one HTTP/2 stream)."""

    def __init__(self, stream: trio.abc.HalfCloseableStream, *, client_side: bool) -> None:
        self._stream = stream
        self._ws = Connection(ConnectionType.CLIENT if client_side else ConnectionType.SERVER)
        self._parts: list[bytes | bytearray | str] = []
        self._size = 0
        self._pending: list[bytes | str] = []
        self._closed: WebSocketClosed | None = None
        self._send_lock = trio.StrictFIFOLock()

    async def send_message(self, message: bytes | str) -> None:
        if self._closed is not None:
            raise self._closed
        async with self._send_lock:
            try:
                event: BytesMessage | TextMessage = (
                    BytesMessage(data=message)
                    if isinstance(message, bytes)
                    else TextMessage(data=message)
                )
                data = self._ws.send(event)
            except LocalProtocolError as exc:
                raise WebSocketClosed(1006, str(exc)) from None
            await self._stream.send_all(data)

    async def receive_message(self) -> bytes | str:
        """The next whole message; raises `WebSocketClosed` once the peer closed."""
        while not self._pending:
            if self._closed is not None:
                raise self._closed
            try:
                data = await self._stream.receive_some()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._closed = WebSocketClosed(1006, "stream broke")
                raise self._closed from None
            if not data:
                self._closed = WebSocketClosed(1006, "stream ended without a close frame")
                raise self._closed
            self._ws.receive_data(bytes(data))
            await self._process_events()
        return self._pending.pop(0)

    async def _process_events(self) -> None:
        for event in self._ws.events():
            if isinstance(event, BytesMessage | TextMessage):
                self._parts.append(event.data)
                self._size += len(event.data)
                if self._size > MAX_MESSAGE_BYTES:
                    await self._close_with(1009, "message too big")
                    return
                if event.message_finished:
                    if isinstance(event, TextMessage):
                        self._pending.append("".join(str(p) for p in self._parts))
                    else:
                        self._pending.append(b"".join(bytes(p) for p in self._parts))  # type: ignore[arg-type]
                    self._parts = []
                    self._size = 0
            elif isinstance(event, Ping):
                async with self._send_lock:
                    await self._stream.send_all(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    async with self._send_lock:
                        await self._stream.send_all(self._ws.send(event.response()))
                self._closed = WebSocketClosed(event.code, event.reason)

    async def _close_with(self, code: int, reason: str) -> None:
        self._closed = WebSocketClosed(code, reason)
        if self._ws.state is ConnectionState.OPEN:
            async with self._send_lock:
                try:
                    await self._stream.send_all(
                        self._ws.send(CloseConnection(code=code, reason=reason))
                    )
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        """Send a close frame (if still open) and end the stream."""
        if self._ws.state is ConnectionState.OPEN:
            await self._close_with(code, reason)
        if self._closed is None:
            self._closed = WebSocketClosed(code, reason)
        try:
            await self._stream.send_eof()
            # Wait (bounded) for the peer's side to end, so our close frame is not cut off
            # by a stream reset.
            with trio.move_on_after(CLOSE_WAIT_S):
                while await self._stream.receive_some():
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await self._stream.aclose()
