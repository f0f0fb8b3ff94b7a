"""The WebSocket protocol (RFC 6455) as the tunnel uses it, sans-IO: the upgrade and the frames.

Why this module exists: in tunnel mode every byte of every HTTP/2 stream crosses one WebSocket,
so its framing sits on the hottest path of the data plane. A general WebSocket library collects
whole messages, queues them between a reader task and the consumer, and masks in Python. A
tunnel needs none of that: message boundaries carry no meaning in it, so a payload is handed
on as it arrives, a piece at a time, and masking (the client's duty, RFC 6455 §5.3) is done by
compiled code, websockets' ``apply_mask``, which measured 25 times wsproto's on 1 MiB here.

The opening handshake is plain HTTP/1.1, parsed by h11 (python-hyper's sans-IO parser), which
also keeps what arrived after the handshake's head: the peer's first frames may come in the same
read. Nothing here does I/O; `wire.wsstream` drives these objects over a trio stream.
"""

from __future__ import annotations

import base64
import hashlib
import http
import os
import struct
from collections.abc import Sequence
from typing import Literal, NoReturn

import attrs
import h11
from websockets.speedups import apply_mask

__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_NORMAL",
    "CLOSE_PROTOCOL_ERROR",
    "CLOSE_UNSUPPORTED_DATA",
    "Accepted",
    "ClientHandshake",
    "Close",
    "FrameDecoder",
    "HandshakeFailed",
    "Ping",
    "Pong",
    "ProtocolError",
    "Rejected",
    "RequestHead",
    "ServerHandshake",
    "accept_token",
    "encode_close",
    "encode_frame",
]

OP_CONTINUATION = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA
_DATA_OPCODES = frozenset({OP_CONTINUATION, OP_TEXT, OP_BINARY})
_CONTROL_OPCODES = frozenset({OP_CLOSE, OP_PING, OP_PONG})

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_INVALID_DATA = 1007
_CLOSE_CODES_SENT_ON_THE_WIRE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011})
"""Codes a peer may send (RFC 6455 §7.4.1); 3000-4999 are for applications and also allowed."""

MAX_CONTROL_PAYLOAD_BYTES = 125
MAX_HANDSHAKE_BODY_BYTES = 64 * 1024
"""The most of a refusal's body kept for the error; the rest is read and dropped."""

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def accept_token(key: bytes) -> bytes:
    """The ``Sec-WebSocket-Accept`` value the server answers ``key`` with (RFC 6455 §4.2.2)."""
    return base64.b64encode(hashlib.sha1(key + _GUID).digest())


# --- frames ------------------------------------------------------------------------------------


def encode_frame(opcode: int, payload: bytes | bytearray | memoryview, *, mask: bool) -> bytes:
    """One final frame carrying ``payload``, masked with a fresh random key when ``mask`` (a
    client's frames always are; a server's never)."""
    return b"".join(encode_frame_parts(opcode, [payload], mask=mask))


def encode_frame_parts(
    opcode: int, payload: Sequence[bytes | bytearray | memoryview], *, mask: bool
) -> list[bytes | bytearray | memoryview]:
    """`encode_frame` of the pieces of `payload` joined, as its header and the pieces (each
    masked on its own where ``mask``), so no piece is copied but by the mask."""
    length = sum(len(piece) for piece in payload)
    first = 0x80 | opcode
    mask_bit = 0x80 if mask else 0
    if length < 126:
        header = struct.pack("!BB", first, mask_bit | length)
    elif length < 1 << 16:
        header = struct.pack("!BBH", first, mask_bit | 126, length)
    else:
        header = struct.pack("!BBQ", first, mask_bit | 127, length)
    if not mask:
        return [header, *payload]
    key = os.urandom(4)
    frame: list[bytes | bytearray | memoryview] = [header + key]
    offset = 0
    for piece in payload:
        # The key runs on across pieces: a piece starting at `offset` starts at its byte
        # offset % 4 (RFC 6455 5.3).
        turn = offset % 4
        frame.append(apply_mask(piece, key[turn:] + key[:turn]))
        offset += len(piece)
    return frame


def encode_close(code: int, reason: str, *, mask: bool) -> bytes:
    """A close frame with ``code`` and ``reason`` (cut to fit a control frame)."""
    body = struct.pack("!H", code) + reason.encode()[: MAX_CONTROL_PAYLOAD_BYTES - 2]
    return encode_frame(OP_CLOSE, body, mask=mask)


class ProtocolError(Exception):
    """The peer broke RFC 6455 (or sent what a binary tunnel refuses); ``code`` is the close
    code to answer with."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@attrs.frozen
class Ping:
    payload: bytes


@attrs.frozen
class Pong:
    payload: bytes


@attrs.frozen
class Close:
    """The peer's close frame: its code (None when it gave none) and reason."""

    code: int | None
    reason: str


Event = bytes | Ping | Pong | Close
"""What `FrameDecoder.next_event` hands out: a piece of a binary message's payload (never
empty), or a control frame."""


class FrameDecoder:
    """Frames in, payload pieces and control frames out.

    A data frame's payload is handed out as soon as any of it is here, in pieces of at most the
    caller's limit, unmasked: a tunnel never waits for a whole message. Control frames (at most
    125 bytes) are handed out whole. Text messages are refused: the tunnel carries bytes.
    """

    __slots__ = (
        "_data",
        "_expect_masked",
        "_in_message",
        "_key",
        "_key_offset",
        "_masked",
        "_pos",
        "_remaining",
    )

    def __init__(self, *, client_side: bool) -> None:
        # A server's frames are never masked, a client's always (RFC 6455 §5.1).
        self._expect_masked = not client_side
        self._data: bytes | bytearray = b""
        self._pos = 0
        # The data frame being handed out: payload bytes still to come, its key and how far in.
        self._remaining = 0
        self._masked = False
        self._key = b""
        self._key_offset = 0
        self._in_message = False

    def receive_data(self, data: bytes | bytearray) -> None:
        """Bytes read from the transport, in order. A buffer is kept as it is, not copied (a
        trio stream's receive hands each caller a buffer of its own): the caller must not
        change it afterwards."""
        if self._pos < len(self._data):
            self._data = bytes(self._data[self._pos :]) + data
        else:
            self._data = data
        self._pos = 0

    @property
    def buffered_bytes(self) -> int:
        return len(self._data) - self._pos

    def next_event(self, max_bytes: int | None = None) -> Event | None:
        """The next piece of payload (at most ``max_bytes``) or control frame; None when more
        bytes are needed. Raises `ProtocolError` on a frame the peer should not have sent."""
        while True:
            if self._remaining:
                return self._payload_piece(max_bytes)
            event = self._next_frame()
            if event is not True:
                return event

    def _payload_piece(self, max_bytes: int | None) -> bytes | None:
        data, pos = self._data, self._pos
        available = len(data) - pos
        if available <= 0:
            return None
        size = min(self._remaining, available)
        if max_bytes is not None:
            size = min(size, max_bytes)
        piece: bytes | bytearray | memoryview
        if pos == 0 and size == len(data):
            piece = data
            self._data, self._pos = b"", 0
        else:
            piece = memoryview(data)[pos : pos + size]
            self._pos = pos + size
        self._remaining -= size
        if self._masked:
            offset = self._key_offset
            key = self._key if offset == 0 else self._key[offset:] + self._key[:offset]
            self._key_offset = (offset + size) % 4
            return apply_mask(piece, key)
        return piece if isinstance(piece, bytes) else bytes(piece)

    def _next_frame(self) -> Event | Literal[True] | None:
        """Parse one frame header (and a control frame's payload); None when incomplete, True
        when a data frame's header was taken (its payload comes next)."""
        data, pos = self._data, self._pos
        available = len(data) - pos
        if available < 2:
            return None
        first, second = data[pos], data[pos + 1]
        fin, opcode, masked, length = first & 0x80, first & 0x0F, second & 0x80, second & 0x7F
        if first & 0x70:
            raise ProtocolError(CLOSE_PROTOCOL_ERROR, "a frame uses reserved bits (no extension)")
        if bool(masked) != self._expect_masked:
            raise ProtocolError(
                CLOSE_PROTOCOL_ERROR,
                "a client's frame is not masked"
                if self._expect_masked
                else "a server's frame is masked",
            )
        header = 2
        if length == 126:
            header = 4
            if available < header:
                return None
            (length,) = struct.unpack_from("!H", data, pos + 2)
        elif length == 127:
            header = 10
            if available < header:
                return None
            (length,) = struct.unpack_from("!Q", data, pos + 2)
            if length >> 63:
                raise ProtocolError(CLOSE_PROTOCOL_ERROR, "a frame's length is over 2**63")
        key = b""
        if masked:
            if available < header + 4:
                return None
            key = bytes(data[pos + header : pos + header + 4])
            header += 4
        if opcode in _CONTROL_OPCODES:
            return self._control_frame(opcode, fin, length, key, header)
        if opcode not in _DATA_OPCODES:
            raise ProtocolError(CLOSE_PROTOCOL_ERROR, f"a frame has the unknown opcode {opcode}")
        if opcode == OP_TEXT:
            raise ProtocolError(
                CLOSE_UNSUPPORTED_DATA, "the peer sent a text message, but this tunnel is binary"
            )
        if opcode == OP_CONTINUATION and not self._in_message:
            raise ProtocolError(CLOSE_PROTOCOL_ERROR, "a continuation frame with no message")
        if opcode == OP_BINARY and self._in_message:
            raise ProtocolError(CLOSE_PROTOCOL_ERROR, "a new message before the last one ended")
        self._in_message = not fin
        self._pos = pos + header
        self._remaining = length
        self._masked = bool(masked)
        self._key = key
        self._key_offset = 0
        return True

    def _control_frame(
        self, opcode: int, fin: int, length: int, key: bytes, header: int
    ) -> Event | None:
        if not fin or length > MAX_CONTROL_PAYLOAD_BYTES:
            raise ProtocolError(CLOSE_PROTOCOL_ERROR, "a control frame is fragmented or too long")
        start = self._pos + header
        if len(self._data) - start < length:
            return None
        payload = bytes(self._data[start : start + length])
        self._pos = start + length
        if key:
            payload = apply_mask(payload, key)
        if opcode == OP_PING:
            return Ping(payload)
        if opcode == OP_PONG:
            return Pong(payload)
        return _parse_close(payload)


def _parse_close(payload: bytes) -> Close:
    if not payload:
        return Close(None, "")
    if len(payload) == 1:
        raise ProtocolError(CLOSE_PROTOCOL_ERROR, "a close frame's code is one byte long")
    (code,) = struct.unpack_from("!H", payload)
    if code not in _CLOSE_CODES_SENT_ON_THE_WIRE and not 3000 <= code <= 4999:
        raise ProtocolError(CLOSE_PROTOCOL_ERROR, f"a close frame has the invalid code {code}")
    try:
        reason = payload[2:].decode()
    except UnicodeDecodeError:
        raise ProtocolError(CLOSE_INVALID_DATA, "a close frame's reason is not UTF-8") from None
    return Close(code, reason)


# --- the opening handshake ----------------------------------------------------------------------


class HandshakeFailed(Exception):
    """The opening handshake broke: not an HTTP upgrade, or not a WebSocket one."""


@attrs.frozen
class Accepted:
    """The server switched to WebSocket; ``received`` is what came after its answer."""

    received: bytes


@attrs.frozen
class Rejected:
    """The server answered with ``status_code`` instead (``body`` cut to 64 KiB)."""

    status_code: int
    body: bytes


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _has_token(value: bytes | None, token: bytes) -> bool:
    return value is not None and token in (part.strip().lower() for part in value.split(b","))


_SERVER_GONE = "the server closed the connection during the WebSocket handshake"


class ClientHandshake:
    """The client's side of the upgrade: `request` to send, then `receive_data` until `result`."""

    def __init__(
        self, host: str, resource: str, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self._h11 = h11.Connection(h11.CLIENT)
        self._key = base64.b64encode(os.urandom(16))
        self._host = host
        self._resource = resource
        self._extra = list(headers or [])
        self._status: int | None = None
        self._body = bytearray()
        self.result: Accepted | Rejected | None = None

    def request(self) -> bytes:
        headers = [
            (b"host", self._host.encode("idna")),
            (b"upgrade", b"websocket"),
            (b"connection", b"Upgrade"),
            (b"sec-websocket-key", self._key),
            (b"sec-websocket-version", b"13"),
            *self._extra,
        ]
        request = h11.Request(method=b"GET", target=self._resource.encode(), headers=headers)
        return self._h11.send(request) + (self._h11.send(h11.EndOfMessage()) or b"")

    def receive_data(self, data: bytes) -> None:
        """What the server sent (b"" when it closed); sets `result` once the answer is in."""
        self._h11.receive_data(data)
        while self.result is None:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                if not data:
                    raise HandshakeFailed(_SERVER_GONE) from None
                raise HandshakeFailed(f"the server's answer is not valid HTTP: {exc}") from None
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.ConnectionClosed):
                raise HandshakeFailed(_SERVER_GONE)
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 101:
                    self._check_switch(list(event.headers))
                    received, _closed = self._h11.trailing_data
                    self.result = Accepted(bytes(received))
                    return
                continue
            if isinstance(event, h11.Response):
                self._status = event.status_code
            elif isinstance(event, h11.Data):
                room = MAX_HANDSHAKE_BODY_BYTES - len(self._body)
                self._body += event.data[: max(room, 0)]
            elif isinstance(event, h11.EndOfMessage) and self._status is not None:
                self.result = Rejected(self._status, bytes(self._body))

    def _check_switch(self, headers: list[tuple[bytes, bytes]]) -> None:
        if not _has_token(_header(headers, b"upgrade"), b"websocket"):
            raise HandshakeFailed("the server switched protocols, but not to websocket")
        if not _has_token(_header(headers, b"connection"), b"upgrade"):
            raise HandshakeFailed("the server's 101 answer lacks 'Connection: Upgrade'")
        if _header(headers, b"sec-websocket-accept") != accept_token(self._key):
            raise HandshakeFailed("the server's Sec-WebSocket-Accept does not match our key")
        if _header(headers, b"sec-websocket-extensions") is not None:
            raise HandshakeFailed("the server chose an extension; none was offered")


@attrs.frozen
class RequestHead:
    """A client's upgrade request: the path it asked for and its headers (names lower case)."""

    path: str
    headers: list[tuple[bytes, bytes]]


class ServerHandshake:
    """The server's side: `receive_data` until `request`, then `accept` or `reject`.

    A request that is not a WebSocket upgrade raises `HandshakeFailed`; `refusal` then holds an
    HTTP 400 (426 for a version other than 13) to send back, naming what is wrong.
    """

    def __init__(self) -> None:
        self._h11 = h11.Connection(h11.SERVER)
        self._key = b""
        self.request: RequestHead | None = None
        self.refusal = b""

    def receive_data(self, data: bytes) -> None:
        self._h11.receive_data(data)
        while self.request is None:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._refuse(400, f"not a valid HTTP request: {exc}")
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.ConnectionClosed):
                raise HandshakeFailed("the client closed the connection before its request")
            if isinstance(event, h11.Request):
                self._check(event)
                self.request = RequestHead(
                    path=event.target.decode("latin-1"), headers=list(event.headers)
                )

    def _check(self, request: h11.Request) -> None:
        headers = list(request.headers)
        if request.method != b"GET":
            self._refuse(400, "a WebSocket upgrade is a GET")
        if not _has_token(_header(headers, b"upgrade"), b"websocket"):
            self._refuse(400, "this address takes WebSocket upgrades only ('Upgrade: websocket')")
        if not _has_token(_header(headers, b"connection"), b"upgrade"):
            self._refuse(400, "a WebSocket upgrade needs 'Connection: Upgrade'")
        if _header(headers, b"sec-websocket-version") != b"13":
            self._refuse(426, "only WebSocket version 13 is spoken here")
        key = _header(headers, b"sec-websocket-key")
        if key is None or len(base64.b64decode(key + b"==", validate=False)) < 16:
            self._refuse(400, "a WebSocket upgrade needs a Sec-WebSocket-Key of 16 bytes")
        self._key = key

    def _refuse(self, status: int, reason: str) -> NoReturn:
        extra = [(b"sec-websocket-version", b"13")] if status == 426 else []
        self.refusal = _response(status, (reason + "\n").encode(), extra)
        raise HandshakeFailed(reason)

    def accept(self) -> tuple[bytes, bytes]:
        """The 101 answer, and what the client sent after its request (its first frames)."""
        answer = self._h11.send(
            h11.InformationalResponse(
                status_code=101,
                headers=[
                    (b"upgrade", b"websocket"),
                    (b"connection", b"Upgrade"),
                    (b"sec-websocket-accept", accept_token(self._key)),
                ],
            )
        )
        received, _closed = self._h11.trailing_data
        return answer or b"", bytes(received)

    def reject(self, status_code: int, body: bytes) -> bytes:
        """A refusal with ``status_code`` and a plain-text ``body``."""
        return _response(status_code, body, [])


def _response(status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> bytes:
    # Written out rather than through h11: a refusal ends the connection, whatever state the
    # parser is in (a request it could not read, say).
    head = [
        f"HTTP/1.1 {status} {_phrase(status)}".encode(),
        b"content-type: text/plain; charset=utf-8",
        f"content-length: {len(body)}".encode(),
        b"connection: close",
        *(name + b": " + value for name, value in extra),
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Refused"
