"""A byte stream carried in the binary messages of a WebSocket: the tunnel's transport.

Why this module exists: in tunnel mode the agent dials the controlplane over ``wss`` (the one
kind of connection that gets through corporate proxies and load balancers) and the whole HTTP/2
connection then runs inside that WebSocket. HTTP/2 needs a byte stream, so `WebSocketStream`
turns each ``send_all`` into one binary frame written straight to the TLS stream, and frames
back into ``receive_some`` bytes as they arrive. Message boundaries carry no meaning.

No reader task and no message queue sit between the two: the HTTP/2 connection's own reader
calls ``receive_some``, which reads the transport and unframes in place, so a payload reaches
HTTP/2 in the same scheduler pass that read it, and backpressure is the transport's own. Pings
are answered and close frames handled on that same path.

`open_websocket` (the agent's side) and `read_upgrade` (the controlplane's) run the opening
handshake; the framing and the handshake's parsing are `wire.websocket`'s, sans-IO.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NoReturn

import attrs
import trio

from wire.conflict import ConflictDetector
from wire.parts import Buffer, send_parts
from wire.websocket import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    OP_BINARY,
    OP_PONG,
    Accepted,
    ClientHandshake,
    Close,
    FrameDecoder,
    HandshakeFailed,
    Ping,
    Pong,
    ProtocolError,
    ServerHandshake,
    encode_close,
    encode_frame,
    encode_frame_parts,
)

__all__ = [
    "WS_MAX_SEND_BYTES",
    "WS_RECEIVE_BYTES",
    "ConnectionRejected",
    "HandshakeError",
    "UpgradeRequest",
    "WebSocketStream",
    "open_websocket",
    "read_upgrade",
]

WS_RECEIVE_BYTES = 256 * 1024
"""How much is asked of the transport at a time."""

WS_MAX_SEND_BYTES = 16 * 1024 * 1024
"""`WebSocketStream.send_all` splits its data into frames of at most this many bytes."""

_NORMAL_CLOSE_CODES = frozenset({CLOSE_NORMAL, CLOSE_GOING_AWAY})
_HANDSHAKE_READ_BYTES = 16 * 1024


class HandshakeError(Exception):
    """The WebSocket's opening handshake failed; the message says how."""


class ConnectionRejected(HandshakeError):
    """The server answered the upgrade with ``status_code`` (and ``body``) instead of 101."""

    def __init__(self, status_code: int, body: bytes) -> None:
        text = body.decode("utf-8", "replace").strip()
        super().__init__(f"HTTP {status_code}" + (f": {text[:200]}" if text else ""))
        self.status_code = status_code
        self.body = body


def _describe(close: Close | None) -> str:
    if close is None or close.code is None:
        return "the WebSocket closed without a close code (1006)"
    text = f"the WebSocket closed with code {close.code}"
    if close.reason:
        text += f": {close.reason}"
    return text


class WebSocketStream(trio.abc.Stream):
    """A `trio.abc.Stream` over an open WebSocket on ``transport``.

    A normal close by the peer (code 1000 or 1001) reads as EOF; any other close, a text
    message or a broken frame raises `trio.BrokenResourceError` (and is answered with the close
    code it deserves). Nothing is buffered beyond one read of the transport.
    """

    def __init__(
        self,
        transport: trio.abc.Stream,
        *,
        client_side: bool,
        received: bytes = b"",
        close_timeout_s: float = 2.0,
    ) -> None:
        self.transport = transport
        """The stream under the WebSocket (the TLS stream)."""
        self._mask = client_side
        self._decoder = FrameDecoder(client_side=client_side)
        if received:
            self._decoder.receive_data(received)
        self._close_timeout_s = close_timeout_s
        self._write_lock = trio.StrictFIFOLock()
        self._closed = False
        self._close_sent = False
        self._peer_closed = False
        self._broken: str | None = None
        self._receiving = False
        self._send_conflict = ConflictDetector(
            "another task is already sending on this WebSocket stream"
        )
        self._receive_conflict = ConflictDetector(
            "another task is already receiving on this WebSocket stream"
        )

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_conflict:
            self._check_usable()
            if self._peer_closed:
                raise trio.BrokenResourceError("the peer closed the WebSocket")
            view = memoryview(data).cast("B")
            # Nothing has happened yet if we are cancelled here.
            await trio.lowlevel.checkpoint_if_cancelled()
            if not view:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            for start in range(0, len(view), WS_MAX_SEND_BYTES):
                frame = encode_frame(
                    OP_BINARY, view[start : start + WS_MAX_SEND_BYTES], mask=self._mask
                )
                await self._write(frame)

    async def send_parts(self, parts: Sequence[Buffer]) -> None:
        """`send_all` of the parts joined, as one frame whose payload pieces are masked where
        they lie and handed on as pieces (see `wire.parts`)."""
        if sum(len(part) for part in parts) > WS_MAX_SEND_BYTES:
            await self.send_all(b"".join(parts))
            return
        with self._send_conflict:
            self._check_usable()
            if self._peer_closed:
                raise trio.BrokenResourceError("the peer closed the WebSocket")
            await trio.lowlevel.checkpoint_if_cancelled()
            await self._write(encode_frame_parts(OP_BINARY, parts, mask=self._mask))

    async def wait_send_all_might_not_block(self) -> None:
        with self._send_conflict:
            self._check_usable()
            await self.transport.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        with self._receive_conflict:
            limit = None if max_bytes is None else operator.index(max_bytes)
            if limit is not None and limit < 1:
                raise ValueError(f"max_bytes must be at least 1, got {limit}")
            self._check_usable()
            self._receiving = True
            try:
                return await self._receive(limit)
            finally:
                self._receiving = False

    async def _receive(self, limit: int | None) -> bytes:
        waited = False
        while True:
            if self._peer_closed:
                break
            try:
                event = self._decoder.next_event(limit)
            except ProtocolError as exc:
                await self._fail(exc.code, exc.message)
            if event is None:
                await self._read()
                waited = True
            elif isinstance(event, bytes):
                if not waited:
                    await trio.lowlevel.checkpoint()
                return event
            elif isinstance(event, Ping):
                await self._write(encode_frame(OP_PONG, event.payload, mask=self._mask))
                waited = True
            elif isinstance(event, Close):
                await self._on_close(event)
                waited = True
            else:
                assert isinstance(event, Pong)  # unasked-for pongs are allowed and ignored
        if not waited:
            await trio.lowlevel.checkpoint()
        return b""

    async def _read(self) -> None:
        try:
            data = await self.transport.receive_some(WS_RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._check_usable()
            self._broken = f"{_describe(None)}: {exc}"
            raise trio.BrokenResourceError(self._broken) from exc
        if not data:
            self._broken = f"{_describe(None)}: the connection ended without a close frame"
            raise trio.BrokenResourceError(self._broken)
        self._decoder.receive_data(data)

    async def _on_close(self, close: Close) -> None:
        """Answer the peer's close (RFC 6455 §5.5.1), then end or break the stream."""
        if not self._close_sent:
            self._close_sent = True
            answer = close.code if close.code is not None else CLOSE_NORMAL
            try:
                await self._write(encode_close(answer, "", mask=self._mask))
            except trio.BrokenResourceError:
                pass
        if close.code in _NORMAL_CLOSE_CODES:
            self._peer_closed = True
            return
        self._broken = _describe(close)
        raise trio.BrokenResourceError(self._broken)

    async def _fail(self, code: int, message: str) -> NoReturn:
        """Close with ``code`` after the peer broke the protocol; always raises."""
        self._broken = message
        if not self._close_sent:
            self._close_sent = True
            with trio.move_on_after(self._close_timeout_s):
                try:
                    await self._write(encode_close(code, message, mask=self._mask))
                except trio.BrokenResourceError:
                    pass
        raise trio.BrokenResourceError(message)

    async def _write(self, frame: bytes | Sequence[Buffer]) -> None:
        """Write one whole frame (bytes, or the pieces `encode_frame_parts` made); frames from
        the sender and from the reader (pongs, closes) never interleave."""
        try:
            self._write_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._write_lock.acquire()
        try:
            if isinstance(frame, bytes):
                await self.transport.send_all(frame)
            else:
                await send_parts(self.transport, frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._check_usable()
            if self._broken is None:
                self._broken = f"{_describe(None)}: {exc}"
            raise trio.BrokenResourceError(self._broken) from exc
        finally:
            self._write_lock.release()

    async def aclose(self) -> None:
        """Close the WebSocket normally (code 1000), wait a moment for the peer's reply, and
        close the transport."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        try:
            with trio.move_on_after(self._close_timeout_s):
                try:
                    if not self._close_sent and self._broken is None:
                        self._close_sent = True
                        await self._write(encode_close(CLOSE_NORMAL, "", mask=self._mask))
                        if not self._receiving:
                            await self._await_close_reply()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        except BaseException:
            # Cancelled (or worse): the transport still closes, at once.
            await trio.aclose_forcefully(self.transport)
            raise
        with trio.move_on_after(self._close_timeout_s) as scope:
            try:
                await self.transport.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        if scope.cancelled_caught:
            await trio.aclose_forcefully(self.transport)

    async def _await_close_reply(self) -> None:
        """Read (and drop) until the peer's close frame or the end of the connection."""
        while not self._peer_closed:
            try:
                event = self._decoder.next_event()
            except ProtocolError:
                return
            if isinstance(event, Close):
                return
            if event is None:
                data = await self.transport.receive_some(WS_RECEIVE_BYTES)
                if not data:
                    return
                self._decoder.receive_data(data)

    def _check_usable(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this WebSocket stream was closed")
        if self._broken is not None:
            raise trio.BrokenResourceError(self._broken)


async def open_websocket(
    transport: trio.abc.Stream,
    host: str,
    resource: str,
    *,
    headers: list[tuple[bytes, bytes]],
) -> WebSocketStream:
    """Upgrade ``transport`` to a WebSocket as its client. Raises `ConnectionRejected` when the
    server answered with another status, `HandshakeError` when the answer was not an upgrade."""
    handshake = ClientHandshake(host, resource, headers)
    await transport.send_all(handshake.request())
    while handshake.result is None:
        data = await transport.receive_some(_HANDSHAKE_READ_BYTES)
        try:
            handshake.receive_data(bytes(data))
        except HandshakeFailed as exc:
            raise HandshakeError(str(exc)) from None
    if not isinstance(handshake.result, Accepted):
        raise ConnectionRejected(handshake.result.status_code, handshake.result.body)
    return WebSocketStream(transport, client_side=True, received=handshake.result.received)


@attrs.define
class UpgradeRequest:
    """A client's WebSocket upgrade, read and checked; the server accepts or rejects it."""

    transport: trio.abc.Stream
    path: str
    headers: list[tuple[bytes, bytes]]
    _handshake: ServerHandshake

    async def accept(self) -> WebSocketStream:
        answer, received = self._handshake.accept()
        await self.transport.send_all(answer)
        return WebSocketStream(self.transport, client_side=False, received=received)

    async def reject(self, status_code: int, *, body: bytes = b"") -> None:
        """Answer with ``status_code`` and ``body``; the caller closes the transport. A client
        already gone is not told."""
        try:
            await self.transport.send_all(self._handshake.reject(status_code, body))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def read_upgrade(transport: trio.abc.Stream) -> UpgradeRequest:
    """Read a client's upgrade request from ``transport``. One that is not a WebSocket upgrade
    is answered with 400 (or 426) naming what is wrong, and raises `HandshakeError`."""
    handshake = ServerHandshake()
    while handshake.request is None:
        data = await transport.receive_some(_HANDSHAKE_READ_BYTES)
        try:
            handshake.receive_data(bytes(data))
        except HandshakeFailed as exc:
            if handshake.refusal:
                await transport.send_all(handshake.refusal)
            raise HandshakeError(str(exc)) from None
    request = handshake.request
    return UpgradeRequest(transport, request.path, request.headers, handshake)
