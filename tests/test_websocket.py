"""Tests for wire.websocket: the tunnel's WebSocket framing and handshake, sans-IO.

Our frames are checked against an independent implementation, wsproto, in both directions and
both roles, and hypothesis splits the bytes at arbitrary boundaries."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.connection import Connection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.events import Ping as WsprotoPing

from wire.websocket import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_TEXT,
    Accepted,
    ClientHandshake,
    Close,
    FrameDecoder,
    HandshakeFailed,
    Ping,
    ProtocolError,
    Rejected,
    ServerHandshake,
    accept_token,
    encode_close,
    encode_frame,
    encode_frame_parts,
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    pieces, last = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[last:point])
        last = point
    return pieces


def drain(decoder: FrameDecoder, max_bytes: int | None = None) -> list[object]:
    events: list[object] = []
    while (event := decoder.next_event(max_bytes)) is not None:
        events.append(event)
    return events


def test_the_accept_token_is_the_rfcs_example() -> None:
    assert accept_token(b"dGhlIHNhbXBsZSBub25jZQ==") == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(st.binary(min_size=0, max_size=70_000), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0), max_size=12),
    client_side=st.booleans(),
    max_bytes=st.one_of(st.none(), st.integers(min_value=1, max_value=5000)),
)
def test_payloads_arrive_whole_however_the_bytes_are_cut(
    messages: list[bytes], cuts: list[int], client_side: bool, max_bytes: int | None
) -> None:
    # What the client sends (masked) the server decodes, and the other way round.
    wire = b"".join(encode_frame(OP_BINARY, m, mask=client_side) for m in messages)
    decoder = FrameDecoder(client_side=not client_side)
    received = bytearray()
    for piece in split(wire, cuts):
        decoder.receive_data(piece)
        for event in drain(decoder, max_bytes):
            assert isinstance(event, bytes) and event
            assert max_bytes is None or len(event) <= max_bytes
            received += event
    assert bytes(received) == b"".join(messages)
    assert decoder.buffered_bytes == 0


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=0, max_size=20_000), min_size=1, max_size=6),
    client_side=st.booleans(),
)
def test_a_frame_of_pieces_is_the_frame_of_them_joined(
    pieces: list[bytes], client_side: bool
) -> None:
    # Each piece is masked on its own, with the key turned to where the piece starts.
    theirs = Connection(ConnectionType.SERVER if client_side else ConnectionType.CLIENT)
    frame = encode_frame_parts(OP_BINARY, pieces, mask=client_side)
    theirs.receive_data(b"".join(frame))
    got = b"".join(bytes(e.data) for e in theirs.events() if isinstance(e, BytesMessage))
    assert got == b"".join(pieces)


@pytest.mark.parametrize("client_side", [True, False])
@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536, 300_000])
def test_wsproto_reads_our_frames(client_side: bool, size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    theirs = Connection(ConnectionType.SERVER if client_side else ConnectionType.CLIENT)
    theirs.receive_data(encode_frame(OP_BINARY, payload, mask=client_side))
    theirs.receive_data(encode_close(4001, "worker gone", mask=client_side))
    events = list(theirs.events())
    got = b"".join(bytes(e.data) for e in events if isinstance(e, BytesMessage))
    assert got == payload
    assert isinstance(events[-1], CloseConnection)
    assert (events[-1].code, events[-1].reason) == (4001, "worker gone")


@pytest.mark.parametrize("client_side", [True, False])
def test_we_read_wsprotos_frames_fragments_and_pings(client_side: bool) -> None:
    theirs = Connection(ConnectionType.SERVER if client_side else ConnectionType.CLIENT)
    wire = (
        theirs.send(Message(data=b"first half ", message_finished=False))
        + theirs.send(WsprotoPing(payload=b"are you there"))
        + theirs.send(Message(data=b"second half", message_finished=True))
        + theirs.send(Message(data=b"x" * 70_000))
        + theirs.send(CloseConnection(code=1001, reason="going away"))
    )
    decoder = FrameDecoder(client_side=client_side)
    decoder.receive_data(wire)
    events = drain(decoder)
    assert Ping(b"are you there") in events
    data = b"".join(e for e in events if isinstance(e, bytes))
    assert data == b"first half second half" + b"x" * 70_000
    assert events[-1] == Close(1001, "going away")


def frame(opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0) -> bytes:
    """A server's (unmasked) frame, built by hand so it can be wrong."""
    return struct.pack("!BB", (0x80 if fin else 0) | rsv | opcode, len(payload)) + payload


@pytest.mark.parametrize(
    ("wire", "code", "words"),
    [
        (frame(OP_TEXT, b"hello"), 1003, "text message"),
        (frame(OP_BINARY, b"x", rsv=0x40), 1002, "reserved bits"),
        (frame(OP_CONTINUATION, b"x"), 1002, "continuation frame with no message"),
        (frame(OP_BINARY, b"a", fin=False) + frame(OP_BINARY, b"b"), 1002, "before the last"),
        (frame(OP_PING, b"p", fin=False), 1002, "control frame"),
        (frame(0x3, b""), 1002, "unknown opcode"),
        (frame(OP_CLOSE, b"\x03"), 1002, "one byte"),
        (frame(OP_CLOSE, struct.pack("!H", 1005)), 1002, "invalid code 1005"),
        (frame(OP_CLOSE, struct.pack("!H", 1000) + b"\xff"), 1007, "not UTF-8"),
        (encode_frame(OP_BINARY, b"masked", mask=True), 1002, "server's frame is masked"),
    ],
)
def test_a_broken_frame_names_what_is_wrong_and_its_close_code(
    wire: bytes, code: int, words: str
) -> None:
    decoder = FrameDecoder(client_side=True)
    decoder.receive_data(wire)
    with pytest.raises(ProtocolError, match=words) as info:
        drain(decoder)
    assert info.value.code == code


def test_a_client_frame_must_be_masked() -> None:
    decoder = FrameDecoder(client_side=False)
    decoder.receive_data(encode_frame(OP_BINARY, b"plain", mask=False))
    with pytest.raises(ProtocolError, match="not masked"):
        drain(decoder)


def test_a_control_frame_waits_until_it_is_whole() -> None:
    decoder = FrameDecoder(client_side=True)
    wire = frame(OP_PING, b"0123456789")
    decoder.receive_data(wire[:5])
    assert decoder.next_event() is None
    decoder.receive_data(wire[5:])
    assert decoder.next_event() == Ping(b"0123456789")


# --- the handshake ----------------------------------------------------------------------------


def test_our_client_is_accepted_by_wsproto_and_keeps_what_follows_the_101() -> None:
    ours = ClientHandshake("cp.example", "/v1/workers/w1/tunnel", [(b"authorization", b"x")])
    theirs = WSConnection(ConnectionType.SERVER)
    theirs.receive_data(ours.request())
    (request,) = list(theirs.events())
    assert isinstance(request, Request)
    assert request.target == "/v1/workers/w1/tunnel" and request.host == "cp.example"
    answer = theirs.send(AcceptConnection())
    first_frame = theirs.send(Message(data=b"h2 preface"))
    ours.receive_data(answer + first_frame)  # one read brings both
    assert isinstance(ours.result, Accepted)
    decoder = FrameDecoder(client_side=True)
    decoder.receive_data(ours.result.received)
    assert decoder.next_event() == b"h2 preface"


def test_a_refusal_is_read_with_its_body() -> None:
    ours = ClientHandshake("cp.example", "/tunnel")
    theirs = WSConnection(ConnectionType.SERVER)
    theirs.receive_data(ours.request())
    list(theirs.events())
    answer = theirs.send(
        RejectConnection(status_code=401, headers=[(b"content-length", b"6")], has_body=True)
    ) + theirs.send(RejectData(data=b"denied"))
    for byte in answer:
        ours.receive_data(bytes([byte]))
    assert ours.result == Rejected(401, b"denied")


def test_an_answer_that_is_not_an_upgrade_fails() -> None:
    ours = ClientHandshake("cp.example", "/tunnel")
    ours.request()
    with pytest.raises(HandshakeFailed, match="Sec-WebSocket-Accept"):
        ours.receive_data(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
            b"connection: upgrade\r\nsec-websocket-accept: wrong\r\n\r\n"
        )


def test_wsprotos_client_is_accepted_by_our_server() -> None:
    theirs = WSConnection(ConnectionType.CLIENT)
    request = theirs.send(Request(host="cp.example", target="/tunnel?x=1"))
    ours = ServerHandshake()
    ours.receive_data(request[:10])
    assert ours.request is None
    ours.receive_data(request[10:] + b"\x82\x80" + b"\x00" * 4)  # a first, empty frame
    assert ours.request is not None and ours.request.path == "/tunnel?x=1"
    answer, received = ours.accept()
    theirs.receive_data(answer)
    assert isinstance(next(theirs.events()), AcceptConnection)
    assert received == b"\x82\x80" + b"\x00" * 4
    assert theirs.send(BytesMessage(data=b"ok"))  # wsproto is open


@pytest.mark.parametrize(
    ("request_bytes", "status", "words"),
    [
        (b"GET /tunnel HTTP/1.1\r\nhost: a\r\n\r\n", 400, "WebSocket upgrades only"),
        (
            b"POST /tunnel HTTP/1.1\r\nhost: a\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
            b"content-length: 0\r\n\r\n",
            400,
            "is a GET",
        ),
        (
            b"GET /t HTTP/1.1\r\nhost: a\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
            b"sec-websocket-version: 8\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
            426,
            "version 13",
        ),
        (
            b"GET /t HTTP/1.1\r\nhost: a\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
            b"sec-websocket-version: 13\r\n\r\n",
            400,
            "Sec-WebSocket-Key",
        ),
        (b"\x16\x03\x01 not http\r\n\r\n", 400, "not a valid HTTP request"),
    ],
)
def test_a_request_that_is_not_an_upgrade_is_refused_in_words(
    request_bytes: bytes, status: int, words: str
) -> None:
    ours = ServerHandshake()
    with pytest.raises(HandshakeFailed, match=words):
        ours.receive_data(request_bytes)
    assert ours.refusal.startswith(f"HTTP/1.1 {status} ".encode())
    assert words.encode() in ours.refusal


def test_text_frames_of_wsproto_are_refused() -> None:
    theirs = Connection(ConnectionType.SERVER)
    decoder = FrameDecoder(client_side=True)
    decoder.receive_data(theirs.send(TextMessage(data="hi")))
    with pytest.raises(ProtocolError) as info:
        decoder.next_event()
    assert info.value.code == 1003
