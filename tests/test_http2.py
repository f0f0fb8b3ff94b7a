"""The sans-IO HTTP/2 core: two `Http2Protocol`s wired together, no trio, no sockets.

Bytes move between the two ends through `Wire`, which cuts every flight at points hypothesis
chooses, so frame headers, HPACK blocks and DATA payloads arrive split anywhere. Attacks and
malformed input are written frame by frame with hyperframe, as a hostile peer would.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Sequence

import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire.http2 import HeaderListTooLarge, Http2Protocol, Http2Settings, ProtocolViolation

ErrorCodes = h2.errors.ErrorCodes
MiB = 1024 * 1024
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"worker"),
    (b":path", b"/v1/upload"),
]
RESPONSE = [(b":status", b"200")]

# Small windows and frames make a body of a few hundred kB cross many window updates and
# frame boundaries, which is what the random cuts are for.
SMALL = Http2Settings(
    stream_window_bytes=100_000, connection_window_bytes=150_000, max_frame_bytes=16_384
)

# Each flight of bytes is cut at these offsets (taken modulo its length), so a flight arrives
# in at most nine pieces: cheap, yet any boundary can fall anywhere.
CUTS = st.lists(st.integers(min_value=0, max_value=2**20), max_size=8)


class Wire:
    """Carries bytes both ways between a client and a server, cut at `cuts`."""

    def __init__(
        self, client: Http2Protocol, server: Http2Protocol, cuts: Sequence[int] = ()
    ) -> None:
        self.client = client
        self.server = server
        self.cuts = cuts
        self.now = 0.0
        self.moved = 0

    def _pieces(self, data: bytes) -> list[bytes]:
        points = sorted({0, len(data), *(c % (len(data) + 1) for c in self.cuts)})
        return [data[a:b] for a, b in itertools.pairwise(points)]

    def _deliver(self, data: bytes, to: Http2Protocol) -> list[h2.events.Event]:
        events: list[h2.events.Event] = []
        for piece in self._pieces(data):
            events += to.receive_data(piece, self.now)
        return events

    def exchange(self) -> tuple[list[h2.events.Event], list[h2.events.Event]]:
        """One flight each way; returns (events at the client, events at the server)."""
        to_server = self.client.data_to_send()
        to_client = self.server.data_to_send()
        self.moved = len(to_server) + len(to_client)
        return self._deliver(to_client, self.client), self._deliver(to_server, self.server)

    def pump(self) -> tuple[list[h2.events.Event], list[h2.events.Event]]:
        """Exchange until both ends are quiet; returns all events at each end."""
        at_client: list[h2.events.Event] = []
        at_server: list[h2.events.Event] = []
        while True:
            c, s = self.exchange()
            at_client += c
            at_server += s
            if not self.moved:
                return at_client, at_server


def connected(
    server_settings: Http2Settings | None = None,
    client_settings: Http2Settings | None = None,
    cuts: Sequence[int] = (),
) -> Wire:
    client = Http2Protocol(client_side=True, settings=client_settings)
    server = Http2Protocol(client_side=False, settings=server_settings)
    client.initiate()
    server.initiate()
    wire = Wire(client, server, cuts)
    wire.pump()
    return wire


def parse_frames(data: bytes) -> list[Frame]:
    """Every frame in `data` (which must hold whole frames only)."""
    frames = []
    view = memoryview(data)
    while view:
        frame, length = Frame.parse_frame_header(view[:9])
        frame.parse_body(view[9 : 9 + length])
        frames.append(frame)
        view = view[9 + length :]
    return frames


def goaway_in(data: bytes) -> GoAwayFrame:
    goaways = [f for f in parse_frames(data) if isinstance(f, GoAwayFrame)]
    assert len(goaways) == 1, f"expected one GOAWAY, got {parse_frames(data)}"
    return goaways[0]


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def send_what_fits(proto: Http2Protocol, stream_id: int, pending: bytearray) -> None:
    """Send as much of `pending` as the windows allow, ending the stream with the last byte."""
    while pending:
        window = proto.send_window(stream_id)
        if window <= 0:
            return
        size = min(window, len(pending), proto.max_outbound_frame_bytes)
        chunk = bytes(pending[:size])
        del pending[:size]
        proto.send_data(stream_id, chunk, end_stream=not pending)


def test_queued_frames_taken_as_parts_keep_their_order() -> None:
    # Large DATA payloads wait apart from the frames queued around them; taken as parts and
    # sent one after another, everything arrives in the order it was queued.
    wire = connected()
    client, server = wire.client, wire.server
    first, second = client.next_stream_id(), 0
    big, small, last = payload(100_000, 1), b"0123456789", payload(20_000, 2)
    client.send_headers(first, REQUEST)
    client.send_data(first, big)
    second = client.next_stream_id()
    client.send_headers(second, REQUEST)
    client.send_data(second, small)
    client.send_data(second, last, end_stream=True)
    client.ping(b"parts-ok")
    queued = client.queued_bytes()
    parts = client.take_parts()
    assert sum(len(part) for part in parts) == queued
    assert not client.has_data_to_send() and client.queued_bytes() == 0
    events = server.receive_data(b"".join(parts), 0.0)
    received = [(e.stream_id, e.data) for e in events if isinstance(e, h2.events.DataReceived)]
    assert received == [(first, big), (second, small), (second, last)]
    kinds = [type(e).__name__ for e in events if not isinstance(e, h2.events.DataReceived)]
    assert kinds == ["RequestReceived", "RequestReceived", "StreamEnded", "PingReceived"]


# -- calls in: what the connection layer asks of the protocol --


@settings(max_examples=40, deadline=None)
@given(
    cuts=CUTS,
    size=st.integers(0, 3 * SMALL.max_frame_bytes + 1),
    as_view=st.booleans(),
    end=st.booleans(),
)
def test_send_data_goes_in_frames_the_peer_accepts_and_ends_on_the_last(
    cuts: list[int], size: int, as_view: bool, end: bool
) -> None:
    wire = connected(SMALL, SMALL, cuts)
    client, server = wire.client, wire.server
    sid = client.next_stream_id()
    client.send_headers(sid, REQUEST)
    body = payload(size, size)
    client.send_data(sid, memoryview(body) if as_view else body, end_stream=end)
    sent = client.data_to_send()
    frames = [f for f in parse_frames(sent) if isinstance(f, DataFrame)]
    assert all(len(f.data) <= SMALL.max_frame_bytes for f in frames)
    assert len(frames) == max(1, -(-size // SMALL.max_frame_bytes))
    assert ["END_STREAM" in f.flags for f in frames] == [False] * (len(frames) - 1) + [end]
    events = wire._deliver(sent, server)
    assert received(events) == (body, size, end)


def test_a_bytes_payload_of_one_frame_is_queued_as_it_is() -> None:
    """The connection hands a whole bytes body to `send_data`: it waits in the queue by
    reference, not copied; a view (a piece of a larger body) is copied, since its owner may
    reuse the memory."""
    wire = connected()
    client = wire.client
    sid = client.next_stream_id()
    client.send_headers(sid, REQUEST)
    body = payload(100_000, 3)
    client.send_data(sid, body)
    assert any(part is body for part in client.take_parts())
    client.send_data(sid, memoryview(body), end_stream=True)
    parts = client.take_parts()
    assert not any(part is body for part in parts)
    assert body in b"".join(parts)


@settings(max_examples=20, deadline=None)
@given(cuts=CUTS)
def test_end_reset_and_ping_reach_the_peer(cuts: list[int]) -> None:
    wire = connected(cuts=cuts)
    client, server = wire.client, wire.server
    ended, reset = client.next_stream_id(), 0
    client.send_headers(ended, REQUEST)
    reset = client.next_stream_id()
    assert reset == ended + 2
    client.send_headers(reset, REQUEST)
    _, at_server = wire.pump()
    assert [e.stream_id for e in at_server if isinstance(e, h2.events.RequestReceived)] == [
        ended,
        reset,
    ]

    client.end_stream(ended)
    server.reset_stream(reset, ErrorCodes.REFUSED_STREAM)
    server.ping(b"12345678")
    at_client, at_server = wire.pump()
    assert [e.stream_id for e in at_server if isinstance(e, h2.events.StreamEnded)] == [ended]
    resets = [
        (e.stream_id, e.error_code) for e in at_client if isinstance(e, h2.events.StreamReset)
    ]
    assert resets == [(reset, ErrorCodes.REFUSED_STREAM)]
    acks = [e.ping_data for e in at_server if isinstance(e, h2.events.PingAckReceived)]
    assert acks == [b"12345678"]
    # The ended stream still answers; the reset one is closed for sending.
    server.send_headers(ended, RESPONSE, end_stream=True)
    with pytest.raises(h2.exceptions.StreamClosedError):
        client.send_data(reset, b"late")


def test_opening_past_the_peers_concurrency_limit_raises_too_many_streams() -> None:
    """The connection waits for a stream to end when h2 says so (`open_stream`)."""
    wire = connected(server_settings=Http2Settings(max_concurrent_streams=2))
    client = wire.client
    for _ in range(2):
        client.send_headers(client.next_stream_id(), REQUEST)
    with pytest.raises(h2.exceptions.TooManyStreamsError):
        client.send_headers(client.next_stream_id(), REQUEST)


def test_next_stream_id_runs_out_at_the_last_odd_id() -> None:
    """The connection drains once ids run out (`open_stream`); h2 says so with this error."""
    wire = connected()
    wire.client.h2.highest_outbound_stream_id = 2**31 - 1
    with pytest.raises(h2.exceptions.NoAvailableStreamIDError):
        wire.client.next_stream_id()


# -- settings --


def test_settings_announced_for_bulk_transfer() -> None:
    wire = connected()
    for me, peer in ((wire.client, wire.server), (wire.server, wire.client)):
        announced = me.h2.remote_settings
        assert announced.initial_window_size >= 4 * MiB
        assert announced.max_frame_size == 1 * MiB
        assert announced.max_concurrent_streams == Http2Settings().max_concurrent_streams
        assert announced.max_header_list_size == Http2Settings().max_header_list_bytes
        # The connection window is opened beyond the RFC's 64 KiB with a WINDOW_UPDATE.
        assert me.open_window() >= 16 * MiB
        assert me.open_window() == peer.settings.connection_window_bytes
    # RFC 8441: only the server announces extended CONNECT (WebSocket over HTTP/2).
    assert wire.client.h2.remote_settings.enable_connect_protocol == 1
    assert wire.server.h2.remote_settings.enable_connect_protocol == 0


def test_settings_reject_values_outside_the_protocol() -> None:
    with pytest.raises(ValueError, match="max_frame_bytes"):
        Http2Settings(max_frame_bytes=1000)
    with pytest.raises(ValueError, match="stream_window_bytes"):
        Http2Settings(stream_window_bytes=2**31)
    with pytest.raises(ValueError, match="max_concurrent_streams"):
        Http2Settings(max_concurrent_streams=0)


# -- a request and a response larger than the windows --


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cuts=CUTS,
    request_size=st.integers(SMALL.stream_window_bytes + 1, 4 * SMALL.stream_window_bytes),
    response_size=st.integers(SMALL.stream_window_bytes + 1, 4 * SMALL.stream_window_bytes),
    read_bytes=st.integers(1_000, 120_000),
    seed=st.integers(0, 2**32),
)
def test_bodies_larger_than_the_window_arrive_intact(
    cuts: list[int], request_size: int, response_size: int, read_bytes: int, seed: int
) -> None:
    wire = connected(SMALL, SMALL, cuts)
    client, server = wire.client, wire.server
    request = payload(request_size, seed)
    response = payload(response_size, seed + 1)

    sid = client.next_stream_id()
    client.send_headers(sid, REQUEST)
    to_server = bytearray(request)
    to_client = bytearray()
    # What each end has received but its consumer has not read yet, and what it has read.
    unread = {client: bytearray(), server: bytearray()}
    read = {client: bytearray(), server: bytearray()}
    ended = {client: False, server: False}
    responding = False

    for _ in range(10_000):
        send_what_fits(client, sid, to_server)
        if responding:
            send_what_fits(server, sid, to_client)
        at_client, at_server = wire.exchange()
        for me, events in ((client, at_client), (server, at_server)):
            for event in events:
                if isinstance(event, h2.events.DataReceived):
                    assert event.stream_id == sid
                    unread[me] += event.data or b""
                    # Bounded buffering: never more unread than the window we advertised.
                    assert len(unread[me]) <= SMALL.stream_window_bytes
                elif isinstance(event, h2.events.StreamEnded):
                    ended[me] = True
            # The consumer reads a little at a time and only what it read is acknowledged.
            piece = bytes(unread[me][:read_bytes])
            del unread[me][: len(piece)]
            read[me] += piece
            me.acknowledge(sid, len(piece))
        if ended[server] and not unread[server] and not responding:
            assert bytes(read[server]) == request
            server.send_headers(sid, RESPONSE)
            to_client = bytearray(response)
            responding = True
        if ended[client] and not unread[client]:
            break
    else:
        pytest.fail("the transfer stalled")

    assert hashlib.sha256(read[client]).digest() == hashlib.sha256(response).digest()
    assert len(read[client]) == response_size


@settings(max_examples=20, deadline=None)
@given(cuts=CUTS)
def test_unread_data_stops_at_the_advertised_stream_window(cuts: list[int]) -> None:
    wire = connected(cuts=cuts)
    client, server = wire.client, wire.server
    window = Http2Settings().stream_window_bytes
    sid = client.next_stream_id()
    client.send_headers(sid, REQUEST)
    pending = bytearray(3 * window)

    received = 0
    for _ in range(3):
        send_what_fits(client, sid, pending)
        _, at_server = wire.pump()
        received += sum(
            len(e.data or b"") for e in at_server if isinstance(e, h2.events.DataReceived)
        )
    # The server never read anything: the client stopped at exactly the advertised window.
    assert received == window
    assert client.send_window(sid) == 0
    assert len(pending) == 2 * window

    # Reading (and so acknowledging) half of it lets the sender go on, by that much.
    server.acknowledge(sid, window // 2)
    wire.pump()
    assert client.send_window(sid) == window // 2
    send_what_fits(client, sid, pending)
    _, at_server = wire.pump()
    more = sum(len(e.data or b"") for e in at_server if isinstance(e, h2.events.DataReceived))
    assert more == window // 2


def test_unread_data_on_many_streams_stops_at_the_connection_window() -> None:
    wire = connected()
    client = wire.client
    connection_window = Http2Settings().connection_window_bytes
    stream_window = Http2Settings().stream_window_bytes
    streams = connection_window // stream_window + 2
    pending: dict[int, bytearray] = {}
    for _ in range(streams):
        sid = client.next_stream_id()
        client.send_headers(sid, REQUEST)
        pending[sid] = bytearray(stream_window)
    for sid, data in pending.items():
        send_what_fits(client, sid, data)
    _, at_server = wire.pump()
    received = sum(len(e.data or b"") for e in at_server if isinstance(e, h2.events.DataReceived))
    assert received == connection_window
    assert client.open_window() == 0
    assert all(client.send_window(sid) == 0 for sid in pending)


# -- flood limits --


def flood_settings(**limits: int) -> Http2Settings:
    return Http2Settings(flood_window_s=10.0, **limits)


def ping(n: int) -> bytes:
    return PingFrame(0, opaque_data=n.to_bytes(8, "big")).serialize()


def empty_settings() -> bytes:
    return SettingsFrame(0, settings={h2.settings.SettingCodes.ENABLE_PUSH: 0}).serialize()


def open_and_reset(wire: Wire) -> bytes:
    """The bytes of one stream opened and at once reset by the client (the "rapid reset")."""
    sid = wire.client.next_stream_id()
    wire.client.send_headers(sid, REQUEST)
    wire.client.reset_stream(sid, ErrorCodes.CANCEL)
    return wire.client.data_to_send()


def open_stream(wire: Wire, stream_id: int = 1) -> None:
    """Have the client open `stream_id` (request headers, no END_STREAM) at the server."""
    if stream_id not in wire.server.h2.streams:
        wire.client.send_headers(stream_id, REQUEST)
        wire.pump()


def empty_data(wire: Wire) -> bytes:
    open_stream(wire)
    return DataFrame(1, data=b"").serialize()


def padded_empty_data(wire: Wire) -> bytes:
    open_stream(wire)
    return DataFrame(1, data=b"", pad_length=20, flags=["PADDED"]).serialize()


def empty_continuation(wire: Wire) -> bytes:
    """An empty CONTINUATION of a header block that never ends (the first call opens it)."""
    head = b""
    if not getattr(wire, "block_open", False):
        setattr(wire, "block_open", True)  # noqa: B010
        head = HeadersFrame(1, data=encoded_headers(REQUEST)[:1]).serialize()
    return head + ContinuationFrame(1, data=b"").serialize()


def stream_window_update(wire: Wire) -> bytes:
    open_stream(wire)
    return WindowUpdateFrame(1, window_increment=1).serialize()


def data_on_a_reset_stream(wire: Wire) -> bytes:
    """One byte of DATA on a stream the client reset: h2 answers each with RST_STREAM."""
    if 1 not in wire.server.h2.streams:
        open_stream(wire)
        wire.client.reset_stream(1, ErrorCodes.CANCEL)
        wire.pump()
    return DataFrame(1, data=b"x").serialize()


FLOODS = {
    "RST_STREAM": ("max_resets_per_window", open_and_reset),
    "PING": ("max_pings_per_window", lambda wire: ping(random.getrandbits(32))),
    "SETTINGS": ("max_settings_per_window", lambda wire: empty_settings()),
    "PRIORITY": (
        "max_priority_per_window",
        lambda wire: PriorityFrame(3, depends_on=0, stream_weight=15).serialize(),
    ),
    "unknown-type": ("max_unknown_frames_per_window", lambda wire: frame_header(4, 0x20) + b"abcd"),
    "empty DATA": ("max_empty_frames_per_window", empty_data),
    "empty padded DATA": ("max_empty_frames_per_window", padded_empty_data),
    "empty CONTINUATION": ("max_empty_frames_per_window", empty_continuation),
    "connection WINDOW_UPDATE": (
        "max_window_updates_per_window",
        lambda wire: WindowUpdateFrame(0, window_increment=1).serialize(),
    ),
    "stream WINDOW_UPDATE": ("max_window_updates_per_window", stream_window_update),
    "DATA on a reset stream": ("max_frames_on_closed_streams_per_window", data_on_a_reset_stream),
}
MESSAGES = {
    "empty DATA": "empty",
    "empty padded DATA": "empty",
    "empty CONTINUATION": "empty",
    "DATA on a reset stream": "closed streams",
}


def test_resets_of_answered_streams_are_cancellations_not_a_flood() -> None:
    """A controlplane relays its clients' cancellations: streams the worker answered, then
    reset. Ten times the limit of those leave the connection open; resets of streams not yet
    answered (the rapid reset) still count, as many as the limit and no more, mixed in or not."""
    limit = 50
    wire = connected(server_settings=flood_settings(max_resets_per_window=limit))
    client, server = wire.client, wire.server
    for _ in range(10 * limit):
        sid = client.next_stream_id()
        client.send_headers(sid, REQUEST)
        wire.pump()
        server.send_headers(sid, RESPONSE)  # the worker answers (a CONNECT's 200, say)
        wire.pump()
        client.reset_stream(sid, ErrorCodes.CANCEL)
        wire.pump()
    assert not server.closed
    for _ in range(limit):
        server.receive_data(open_and_reset(wire), now=1.0)
    assert not server.closed
    with pytest.raises(ProtocolViolation, match="RST_STREAM") as err:
        server.receive_data(open_and_reset(wire), now=1.0)
    assert err.value.error_code == ErrorCodes.ENHANCE_YOUR_CALM


@pytest.mark.parametrize("kind", FLOODS)
def test_flood_is_answered_with_enhance_your_calm(kind: str) -> None:
    field, frame_bytes = FLOODS[kind]
    limit = 50
    wire = connected(server_settings=flood_settings(**{field: limit}))
    server = wire.server
    # The SETTINGS and WINDOW_UPDATE of the client's preface count too.
    allowed = limit - 1 if kind.rsplit(maxsplit=1)[-1] in ("SETTINGS", "WINDOW_UPDATE") else limit
    for _ in range(allowed):
        server.receive_data(frame_bytes(wire), now=1.0)
    assert not server.closed
    server.data_to_send()  # the answers (PING ACKs, SETTINGS ACKs) to allowed frames

    named = MESSAGES.get(kind, kind.rsplit(maxsplit=1)[-1])
    with pytest.raises(ProtocolViolation, match=named) as err:
        server.receive_data(frame_bytes(wire), now=2.0)
    assert err.value.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    goaway = goaway_in(server.data_to_send())
    assert goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    # And the connection stays dead: nothing more is processed.
    assert server.receive_data(ping(1), now=3.0) == []


@pytest.mark.parametrize("kind", FLOODS)
def test_the_same_frames_spread_over_time_are_fine(kind: str) -> None:
    field, frame_bytes = FLOODS[kind]
    limit = 20
    wire = connected(server_settings=flood_settings(**{field: limit}))
    server = wire.server
    # Three windows' worth at just under the limit each, with time passing between them.
    for window in range(1, 4):
        for i in range(limit - 1):
            server.receive_data(frame_bytes(wire), now=window * 10.5 + i * 0.01)
    assert not server.closed
    assert not any(isinstance(f, GoAwayFrame) for f in parse_frames(server.data_to_send()))


def test_the_default_flood_limits_hold_too() -> None:
    """The shipped limits are enforced as configured (every kind is tested at 50 above)."""
    wire = connected()
    limit = Http2Settings().max_pings_per_window
    for n in range(limit):
        wire.server.receive_data(ping(n), now=1.0)
    with pytest.raises(ProtocolViolation, match="PING"):
        wire.server.receive_data(ping(limit), now=1.0)


def test_a_ping_flood_in_one_buffer_gets_no_answer_past_the_limit() -> None:
    """PINGs arriving together are counted before h2 answers any: at most `limit` ACKs."""
    limit = 200
    wire = connected(server_settings=flood_settings(max_pings_per_window=limit))
    server = wire.server
    for n in range(limit - 10):
        server.receive_data(ping(n), now=1.0)
    with pytest.raises(ProtocolViolation, match="PING"):
        server.receive_data(b"".join(ping(n) for n in range(5000)), now=1.0)
    acks = [f for f in parse_frames(server.data_to_send()) if isinstance(f, PingFrame)]
    assert len(acks) == limit - 10


def test_window_updates_are_allowed_in_proportion_to_the_data_sent() -> None:
    """A peer downloading a lot answers each DATA frame; that is not a flood."""
    base = 10
    wire = connected(server_settings=flood_settings(max_window_updates_per_window=base))
    open_stream(wire)
    server = wire.server
    frames = 200
    for _ in range(frames):
        server.send_data(1, b"x" * 100)
    server.data_to_send()
    for _ in range(base + 2 * frames - 1):  # the client's preface sent one
        server.receive_data(WindowUpdateFrame(1, window_increment=1).serialize(), now=1.0)
    assert not server.closed
    with pytest.raises(ProtocolViolation, match="WINDOW_UPDATE"):
        server.receive_data(WindowUpdateFrame(0, window_increment=1).serialize(), now=1.0)


def test_an_empty_data_frame_that_ends_its_stream_is_not_counted() -> None:
    wire = connected(server_settings=flood_settings(max_empty_frames_per_window=2))
    events: list[h2.events.Event] = []
    for sid in range(1, 21, 2):
        open_stream(wire, sid)
        events += wire.server.receive_data(
            DataFrame(sid, data=b"", flags=["END_STREAM"]).serialize(), now=1.0
        )
    assert not wire.server.closed
    assert sum(isinstance(e, h2.events.StreamEnded) for e in events) == 10


def test_rapid_reset_streams_reach_the_server_before_the_limit() -> None:
    """Below the limit each opened-and-reset stream is seen and its reset reported."""
    wire = connected(server_settings=flood_settings(max_resets_per_window=5))
    events: list[h2.events.Event] = []
    for _ in range(5):
        events += wire.server.receive_data(open_and_reset(wire), now=0.0)
    assert sum(isinstance(e, h2.events.RequestReceived) for e in events) == 5
    assert sum(isinstance(e, h2.events.StreamReset) for e in events) == 5


# -- malformed input --


def test_garbage_instead_of_the_preface_is_refused_with_goaway() -> None:
    server = Http2Protocol(client_side=False)
    server.initiate()
    server.data_to_send()
    with pytest.raises(ProtocolViolation) as err:
        server.receive_data(b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n", now=0.0)
    assert err.value.error_code == ErrorCodes.PROTOCOL_ERROR
    assert goaway_in(server.data_to_send()).error_code == ErrorCodes.PROTOCOL_ERROR


def frame_header(length: int, frame_type: int, flags: int = 0, stream_id: int = 0) -> bytes:
    return length.to_bytes(3, "big") + bytes([frame_type, flags]) + stream_id.to_bytes(4, "big")


BAD_LENGTHS = {
    "PING of 7 bytes": frame_header(7, 0x6) + b"\0" * 7,
    "SETTINGS of 5 bytes": frame_header(5, 0x4) + b"\0" * 5,
    "WINDOW_UPDATE of 3 bytes": frame_header(3, 0x8) + b"\0" * 3,
    "RST_STREAM of 5 bytes": frame_header(5, 0x3, stream_id=1) + b"\0" * 5,
}


@pytest.mark.parametrize("side", ["server", "client"])
@pytest.mark.parametrize("frame", BAD_LENGTHS.values(), ids=BAD_LENGTHS.keys())
def test_frame_with_a_bad_length_is_a_frame_size_error(side: str, frame: bytes) -> None:
    wire = connected()
    receiver = wire.server if side == "server" else wire.client
    with pytest.raises(ProtocolViolation) as err:
        receiver.receive_data(frame, now=0.0)
    assert err.value.error_code == ErrorCodes.FRAME_SIZE_ERROR
    assert goaway_in(receiver.data_to_send()).error_code == ErrorCodes.FRAME_SIZE_ERROR


@pytest.mark.parametrize("side", ["server", "client"])
def test_frame_larger_than_max_frame_is_refused_at_its_header(side: str) -> None:
    """An oversized frame is refused as soon as its header says so, not once it is buffered.

    A peer speaking something else (an HTTP/1.1 error page, say) looks like a frame header
    announcing megabytes; waiting for them would leave the connection hanging.
    """
    wire = connected()
    receiver = wire.server if side == "server" else wire.client
    header = frame_header(Http2Settings().max_frame_bytes + 1, 0x0, stream_id=1)
    with pytest.raises(ProtocolViolation) as err:
        receiver.receive_data(header + b"\0" * 100, now=0.0)
    assert err.value.error_code == ErrorCodes.FRAME_SIZE_ERROR
    assert goaway_in(receiver.data_to_send()).error_code == ErrorCodes.FRAME_SIZE_ERROR


def test_http1_answer_to_a_client_is_refused_at_once() -> None:
    wire = connected()
    with pytest.raises(ProtocolViolation) as err:
        wire.client.receive_data(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", 0.0)
    assert err.value.error_code == ErrorCodes.FRAME_SIZE_ERROR
    assert goaway_in(wire.client.data_to_send()).error_code == ErrorCodes.FRAME_SIZE_ERROR


def encoded_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    return hpack.Encoder().encode(headers)


def test_header_list_larger_than_announced_is_refused() -> None:
    wire = connected()
    limit = Http2Settings().max_header_list_bytes
    block = encoded_headers([*REQUEST, (b"x-big", b"a" * limit)])
    frame = HeadersFrame(1, data=block, flags=["END_HEADERS", "END_STREAM"]).serialize()
    with pytest.raises(ProtocolViolation) as err:
        wire.server.receive_data(frame, now=0.0)
    assert err.value.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert goaway_in(wire.server.data_to_send()).error_code == ErrorCodes.ENHANCE_YOUR_CALM


def test_header_list_just_under_the_limit_is_accepted() -> None:
    wire = connected()
    limit = Http2Settings().max_header_list_bytes
    # RFC 9113 6.5.2: each field counts its name, its value and 32 bytes.
    used = sum(len(k) + len(v) + 32 for k, v in REQUEST) + len(b"x-big") + 32
    block = encoded_headers([*REQUEST, (b"x-big", b"a" * (limit - used))])
    frame = HeadersFrame(1, data=block, flags=["END_HEADERS", "END_STREAM"]).serialize()
    events = wire.server.receive_data(frame, now=0.0)
    assert any(isinstance(e, h2.events.RequestReceived) for e in events)


def test_too_many_continuation_frames_are_refused() -> None:
    wire = connected()
    block = encoded_headers(REQUEST)
    frames = [HeadersFrame(1, data=block[:1], flags=["END_STREAM"]).serialize()]
    # One byte at a time is well under any size limit; the count is what is refused.
    frames += [ContinuationFrame(1, data=b"").serialize() for _ in range(100)]
    with pytest.raises(ProtocolViolation) as err:
        wire.server.receive_data(b"".join(frames), now=0.0)
    assert err.value.error_code == ErrorCodes.PROTOCOL_ERROR
    assert goaway_in(wire.server.data_to_send()).error_code == ErrorCodes.PROTOCOL_ERROR


def test_header_block_growing_past_the_limit_is_refused_before_it_ends() -> None:
    """CONTINUATION frames of a block past max_header_list_bytes are not buffered on and on."""
    wire = connected()
    limit = Http2Settings().max_header_list_bytes
    piece = b"\0" * (limit // 2)
    frames = [HeadersFrame(1, data=piece).serialize()]
    frames += [ContinuationFrame(1, data=piece).serialize() for _ in range(8)]
    with pytest.raises(ProtocolViolation) as err:
        for frame in frames:
            wire.server.receive_data(frame, now=0.0)
    assert err.value.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert goaway_in(wire.server.data_to_send()).error_code == ErrorCodes.ENHANCE_YOUR_CALM


def test_window_update_overflowing_the_window_is_a_flow_control_error() -> None:
    wire = connected()
    frame = WindowUpdateFrame(0, window_increment=2**31 - 1).serialize()
    with pytest.raises(ProtocolViolation) as err:
        wire.server.receive_data(frame, now=0.0)
    assert err.value.error_code == ErrorCodes.FLOW_CONTROL_ERROR
    assert goaway_in(wire.server.data_to_send()).error_code == ErrorCodes.FLOW_CONTROL_ERROR


def test_data_beyond_the_window_is_a_flow_control_error() -> None:
    wire = connected(server_settings=SMALL)
    wire.server.receive_data(
        HeadersFrame(1, data=encoded_headers(REQUEST), flags=["END_HEADERS"]).serialize(), 0.0
    )
    frame = DataFrame(1, data=b"\0" * SMALL.max_frame_bytes).serialize()
    with pytest.raises(ProtocolViolation) as err:
        for _ in range(SMALL.connection_window_bytes // SMALL.max_frame_bytes + 2):
            wire.server.receive_data(frame, now=0.0)
    assert err.value.error_code == ErrorCodes.FLOW_CONTROL_ERROR
    assert goaway_in(wire.server.data_to_send()).error_code == ErrorCodes.FLOW_CONTROL_ERROR


def open_request(wire: Wire) -> None:
    wire.server.receive_data(
        HeadersFrame(1, data=encoded_headers(REQUEST), flags=["END_HEADERS"]).serialize(), 0.0
    )


def received(events: list[h2.events.Event]) -> tuple[bytes, int, bool]:
    """The body bytes, the flow-controlled length and whether the stream ended."""
    data = [e for e in events if isinstance(e, h2.events.DataReceived)]
    ended = any(isinstance(e, h2.events.StreamEnded) for e in events)
    return b"".join(e.data or b"" for e in data), sum(e.flow_controlled_length for e in data), ended


def test_data_pieces_read_from_a_reused_buffer_arrive_as_sent() -> None:
    # A transport may hand over one buffer it then overwrites with the next read.
    wire = connected()
    open_request(wire)
    body = payload(200_000, 7)
    frame = DataFrame(1, data=body, flags=["END_STREAM"]).serialize()
    buffer = bytearray(1000)
    events: list[h2.events.Event] = []
    for at in range(0, len(frame), 1000):
        piece = frame[at : at + 1000]
        buffer[: len(piece)] = piece
        events += wire.server.receive_data(
            buffer[: len(piece)] if len(piece) < 1000 else buffer, 0.0
        )
        buffer[:] = b"\xff" * 1000
    assert received(events) == (body, len(body), True)


@pytest.mark.parametrize("split", [1, 9, 10, 20_000])
def test_padded_large_small_and_empty_data_frames_arrive_with_their_flow_control(
    split: int,
) -> None:
    wire = connected()
    open_request(wire)
    frames = (
        DataFrame(1, data=b"a" * 30_000, pad_length=40, flags=["PADDED"]).serialize()
        + DataFrame(1, data=b"c" * 20_000).serialize()
        + DataFrame(1, data=b"b" * 10).serialize()
        + DataFrame(1, data=b"", flags=["END_STREAM"]).serialize()
    )
    events: list[h2.events.Event] = []
    for at in range(0, len(frames), split):
        events += wire.server.receive_data(frames[at : at + split], 0.0)
    # Padding counts against the window: the pad length byte and the 40 pad bytes.
    body = b"a" * 30_000 + b"c" * 20_000 + b"b" * 10
    assert received(events) == (body, 30_000 + 41 + 20_000 + 10, True)


@pytest.mark.parametrize("where", ["stream 0", "inside a header block"])
def test_data_on_stream_zero_or_inside_a_header_block_is_a_protocol_error(where: str) -> None:
    wire = connected()
    if where == "stream 0":
        data = DataFrame(1, data=b"x" * 20_000).serialize()
        data = data[:5] + b"\0\0\0\0" + data[9:]  # the stream id cleared
    else:
        data = (
            HeadersFrame(1, data=encoded_headers(REQUEST)).serialize()  # no END_HEADERS
            + DataFrame(1, data=b"x" * 20_000).serialize()
        )
    with pytest.raises(ProtocolViolation) as err:
        wire.server.receive_data(data, now=0.0)
    assert err.value.error_code == ErrorCodes.PROTOCOL_ERROR
    assert goaway_in(wire.server.data_to_send()).error_code == ErrorCodes.PROTOCOL_ERROR


# -- concurrent streams --


@settings(max_examples=30, deadline=None)
@given(cuts=CUTS, extra=st.integers(1, 6))
def test_streams_beyond_the_concurrency_limit_are_refused(cuts: list[int], extra: int) -> None:
    limit = 4
    server_settings = Http2Settings(max_concurrent_streams=limit)
    client = Http2Protocol(client_side=True)
    server = Http2Protocol(client_side=False, settings=server_settings)
    client.initiate()
    server.initiate()
    wire = Wire(client, server, cuts)
    # The client opens its streams before the server's SETTINGS reach it, as any client may.
    sids = []
    for _ in range(limit + extra):
        sid = client.next_stream_id()
        client.send_headers(sid, REQUEST, end_stream=True)
        sids.append(sid)
    at_client, at_server = wire.pump()

    accepted = [e.stream_id for e in at_server if isinstance(e, h2.events.RequestReceived)]
    assert accepted == sids[:limit]
    refused = {e.stream_id: e.error_code for e in at_client if isinstance(e, h2.events.StreamReset)}
    assert refused == {sid: ErrorCodes.REFUSED_STREAM for sid in sids[limit:]}
    assert not client.closed and not server.closed

    # The accepted streams are answered, and after them new streams are accepted again.
    for sid in accepted:
        server.send_headers(sid, RESPONSE, end_stream=True)
    at_client, _ = wire.pump()
    assert sum(isinstance(e, h2.events.ResponseReceived) for e in at_client) == limit
    sid = client.next_stream_id()
    client.send_headers(sid, REQUEST, end_stream=True)
    _, at_server = wire.pump()
    assert [e.stream_id for e in at_server if isinstance(e, h2.events.RequestReceived)] == [sid]


# -- graceful GOAWAY --


@settings(max_examples=20, deadline=None)
@given(cuts=CUTS)
def test_stream_in_flight_finishes_after_a_graceful_goaway(cuts: list[int]) -> None:
    wire = connected(SMALL, SMALL, cuts)
    client, server = wire.client, wire.server
    sid = client.next_stream_id()
    client.send_headers(sid, REQUEST)
    wire.pump()

    server.go_away(ErrorCodes.NO_ERROR)
    at_client, _ = wire.pump()
    goaways = [e for e in at_client if isinstance(e, h2.events.ConnectionTerminated)]
    assert [(g.error_code, g.last_stream_id) for g in goaways] == [(ErrorCodes.NO_ERROR, sid)]

    # Both directions of the stream the server accepted still work, past several windows.
    request = bytearray(payload(3 * SMALL.stream_window_bytes, 1))
    response = bytearray(payload(3 * SMALL.stream_window_bytes, 2))
    server.send_headers(sid, RESPONSE)
    got = {client: 0, server: 0}
    ended = {client: False, server: False}
    for _ in range(1000):
        send_what_fits(client, sid, request)
        send_what_fits(server, sid, response)
        at_client, at_server = wire.exchange()
        for me, events in ((client, at_client), (server, at_server)):
            for event in events:
                if isinstance(event, h2.events.DataReceived):
                    got[me] += len(event.data or b"")
                    me.acknowledge(sid, event.flow_controlled_length or 0)
                elif isinstance(event, h2.events.StreamEnded):
                    ended[me] = True
        if all(ended.values()):
            break
    assert got == {client: 3 * SMALL.stream_window_bytes, server: 3 * SMALL.stream_window_bytes}
    assert not client.closed and not server.closed


# -- headers we send --


def test_long_header_values_go_out_as_plain_literals_and_arrive_intact() -> None:
    """hpack's Huffman coder is quadratic in a value's length; long values skip it."""
    wire = connected()
    value = b"a" * 40_000
    wire.client.send_headers(1, [*REQUEST, (b"x-long", value)], end_stream=True)
    block = wire.client.data_to_send()
    assert value in block
    events = wire.server.receive_data(block, now=0.0)
    request = next(e for e in events if isinstance(e, h2.events.RequestReceived))
    assert (b"x-long", value) in list(request.headers or [])


def test_a_token_goes_never_indexed_and_not_huffman_coded_on_every_request() -> None:
    """The bearer token is never put in either side's table (it goes with every request), and
    is sent as it is: Huffman-coding it cost both ends CPU on every request."""
    wire = connected()
    token = b"Bearer 3q2-7wXnTz_g9kLmPQ4s0aVbYcRdUeFf1hJiKlMn"
    headers = [*REQUEST, (b"authorization", token)]
    for sid in (1, 3):
        wire.client.send_headers(sid, headers, end_stream=True)
        block = wire.client.data_to_send()
        assert token in block
        events = wire.server.receive_data(block, now=0.0)
        request = next(e for e in events if isinstance(e, h2.events.RequestReceived))
        received = dict(request.headers or [])
        assert received[b"authorization"] == token
        assert isinstance(
            next(h for h in request.headers or [] if h[0] == b"authorization"),
            hpack.NeverIndexedHeaderTuple,
        )
    for side in (wire.client.h2.encoder, wire.server.h2.decoder):
        assert all(value != token for _, value in side.header_table.dynamic_entries)


def test_headers_over_the_peers_limit_are_refused_before_anything_is_sent() -> None:
    wire = connected()
    limit = Http2Settings().max_header_list_bytes
    with pytest.raises(HeaderListTooLarge, match=f"over the {limit} bytes"):
        wire.client.send_headers(1, [*REQUEST, (b"x-big", b"a" * limit)])
    assert wire.client.data_to_send() == b""
    assert 1 not in wire.client.h2.streams
    # The HPACK state on both sides is still in step: the next request arrives whole.
    wire.client.send_headers(1, [*REQUEST, (b"x-small", b"b")], end_stream=True)
    events = wire.server.receive_data(wire.client.data_to_send(), now=0.0)
    request = next(e for e in events if isinstance(e, h2.events.RequestReceived))
    assert (b"x-small", b"b") in list(request.headers or [])
