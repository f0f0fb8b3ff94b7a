"""`Http2Connection` over in-memory streams: multiplexing, flow control, liveness, shutdown.

Every test runs a client and a server connection over `trio.testing.memory_stream_pair()` with
a small handler of its own (no `Service`), and those that wait on time use the autojump clock.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import attrs
import h2.errors
import pytest
import trio
import trio.lowlevel
import trio.testing

from wire.connection import (
    WRITES_PER_TURN,
    ConnectionLost,
    H2ByteStream,
    H2Stream,
    Headers,
    Http2Connection,
    KeepaliveConfig,
    StreamRefused,
    header_value,
)
from wire.http2 import Http2Settings

Handler = Callable[[H2Stream], Awaitable[None]]
MiB = 1024 * 1024
OK = [(b":status", b"200")]
CONNECT = [(b":method", b"CONNECT"), (b":authority", b"db.internal:5432")]
# Small windows keep the bytes moved per test low while still crossing many window updates.
SMALL = Http2Settings(
    stream_window_bytes=256 * 1024, connection_window_bytes=1024 * 1024, max_frame_bytes=16_384
)


def request(path: str, method: bytes = b"GET") -> Headers:
    return [
        (b":method", method),
        (b":scheme", b"https"),
        (b":authority", b"worker"),
        (b":path", path.encode()),
    ]


def path_of(stream: H2Stream) -> str:
    assert stream.headers is not None
    return (header_value(stream.headers, b":path") or b"").decode()


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


@attrs.define
class Pair:
    client: Http2Connection
    server: Http2Connection
    # The raw transports, for tests that play a misbehaving peer.
    client_transport: trio.abc.Stream
    server_transport: trio.abc.Stream


@asynccontextmanager
async def open_pair(
    handler: Handler | None,
    *,
    settings: Http2Settings | None = None,
    client_keepalive: KeepaliveConfig | None = None,
    wrap_server_transport: Callable[[trio.abc.Stream], trio.abc.Stream] = lambda t: t,
    wrap_client_transport: Callable[[trio.abc.Stream], trio.abc.Stream] = lambda t: t,
    sockets: bool = False,
) -> AsyncIterator[Pair]:
    """A connected pair over memory streams, or over a socket pair (`sockets`), whose writes
    take one scheduler pass where a memory stream's take several."""
    server_end: trio.abc.Stream
    client_end: trio.abc.Stream
    if sockets:
        server_socket, client_socket = trio.socket.socketpair()
        server_end, client_end = trio.SocketStream(server_socket), trio.SocketStream(client_socket)
    else:
        server_end, client_end = trio.testing.memory_stream_pair()
    server_transport = wrap_server_transport(server_end)
    client_transport = wrap_client_transport(client_end)
    server = Http2Connection(
        server_transport, client_side=False, settings=settings, handler=handler, name="server"
    )
    client = Http2Connection(
        client_transport,
        client_side=True,
        settings=settings,
        keepalive=client_keepalive,
        name="client",
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        yield Pair(client, server, client_transport, server_transport)
        await client.aclose()
        await server.aclose()
        nursery.cancel_scope.cancel()


def all_arrived(stream: H2Stream, size: int) -> bool:
    return stream.ended or stream.buffered_bytes == size


async def wait_until(condition: Callable[[], bool]) -> None:
    """Let every task run until `condition` holds (it must, once all of them block)."""
    while not condition():
        await trio.testing.wait_all_tasks_blocked()
        if not condition():
            await trio.sleep(0.001)


# -- H2ByteStream is a trio stream --


async def open_tunnel_pair(nursery: trio.Nursery) -> tuple[H2ByteStream, H2ByteStream]:
    """Both ends of one CONNECT stream, on a connection of its own."""
    send, receive = trio.open_memory_channel[H2ByteStream](1)

    async def tunnel(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        await send.send(H2ByteStream(stream))
        await trio.sleep_forever()  # the stream lives on outside the handler

    server_end, client_end = trio.testing.memory_stream_pair()
    server = Http2Connection(server_end, client_side=False, handler=tunnel)
    client = Http2Connection(client_end, client_side=True)
    await nursery.start(server.run)
    await nursery.start(client.run)
    stream = await client.open_stream(CONNECT)
    await stream.wait_headers()
    return H2ByteStream(stream), await receive.receive()


async def test_connect_stream_behaves_as_a_half_closeable_stream(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def maker() -> tuple[H2ByteStream, H2ByteStream]:
        return await open_tunnel_pair(nursery)

    # A stream that freezes fails here at once (the clock jumps) rather than hanging.
    with trio.fail_after(60):
        await trio.testing.check_half_closeable_stream(maker, None)


async def test_connect_stream_carries_more_than_a_window_each_way(nursery: trio.Nursery) -> None:
    client, server = await open_tunnel_pair(nursery)
    up = payload(3 * Http2Settings().stream_window_bytes, 1)
    down = payload(3 * Http2Settings().stream_window_bytes, 2)
    got: dict[str, bytes] = {}

    async def send(stream: H2ByteStream, data: bytes) -> None:
        await stream.send_all(data)
        await stream.send_eof()

    async def receive(stream: H2ByteStream, name: str) -> None:
        parts = []
        while chunk := await stream.receive_some(100_000):
            parts.append(chunk)
        got[name] = b"".join(parts)

    async with trio.open_nursery() as inner:
        inner.start_soon(send, client, up)
        inner.start_soon(send, server, down)
        inner.start_soon(receive, client, "client")
        inner.start_soon(receive, server, "server")
    assert got == {"client": down, "server": up}


# -- many streams on one connection --


async def test_a_thousand_concurrent_streams_are_all_answered() -> None:
    async def answer(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        await stream.send_data(f"answer to {path_of(stream)}".encode(), end_stream=True)

    answers: dict[int, bytes] = {}

    async with open_pair(answer) as pair:

        async def ask(n: int) -> None:
            stream = await pair.client.open_stream(request(f"/q/{n}"), end_stream=True)
            assert header_value(await stream.wait_headers(), b":status") == b"200"
            answers[n] = await stream.read_all(1024)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for n in range(1000):
                    nursery.start_soon(ask, n)
        assert answers == {n: f"answer to /q/{n}".encode() for n in range(1000)}
        assert pair.server.statistics().streams_opened == 1000
        await wait_until(lambda: pair.server.statistics().open_streams == 0)


async def test_answers_sent_at_once_leave_together_in_a_few_writes() -> None:
    """16 handlers answering in the same moment (an endpoint under load) share writes: each
    TLS record and system call carries many answers, not one."""
    waiting = 0
    release = trio.Event()

    async def answer(stream: H2Stream) -> None:
        nonlocal waiting
        waiting += 1
        await release.wait()
        await stream.send_headers(OK)
        await stream.send_data(f"answer to {path_of(stream)}".encode(), end_stream=True)

    counted: list[MuteStream] = []
    async with open_pair(answer, wrap_server_transport=muting(counted)) as pair:
        streams = [
            await pair.client.open_stream(request(f"/q/{n}"), end_stream=True) for n in range(16)
        ]
        with trio.fail_after(30):
            await wait_until(lambda: waiting == 16)
            before = counted[0].writes
            release.set()
            for n, stream in enumerate(streams):
                assert header_value(await stream.wait_headers(), b":status") == b"200"
                assert await stream.read_all(1024) == f"answer to /q/{n}".encode()
        # Before, a write per answer and one for the headers: 17.
        assert counted[0].writes - before <= 4


class WrappedStream(trio.abc.Stream):
    """A transport passed through to `inner`; the wrappers below change one thing each."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


class GatedStream(WrappedStream):
    """Holds each write, while `gated`, until the test lets one through (`allow`)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        super().__init__(inner)
        self.gated = False
        self.held = 0
        self.passed = 0
        """Writes let through while gated."""
        self._permits = 0
        self._lot = trio.lowlevel.ParkingLot()

    def allow(self, writes: int = 1) -> None:
        self._permits += writes
        self._lot.unpark_all()

    def open(self) -> None:
        self.gated = False
        self._lot.unpark_all()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        while self.gated and not self._permits:
            self.held += 1
            try:
                await self._lot.park()
            finally:
                self.held -= 1
        if self.gated:
            self._permits -= 1
            self.passed += 1
        await self.inner.send_all(data)


async def test_a_small_send_never_waits_behind_another_and_a_writer_soon_goes_back() -> None:
    """While one stream's task is writing, others' small sends return at once (their frames go
    with that task's next write); and that task, with others sending all the while, is back on
    its own stream after a few writes, the rest written by the connection itself."""
    received: dict[str, bytes] = {}

    async def collect(stream: H2Stream) -> None:
        received[path_of(stream)] = await stream.read_all(MiB)
        await stream.send_headers(OK, end_stream=True)

    gates: list[GatedStream] = []

    def gated(transport: trio.abc.Stream) -> trio.abc.Stream:
        gates.append(GatedStream(transport))
        return gates[-1]

    async with open_pair(collect, wrap_client_transport=gated) as pair:
        gate = gates[0]
        streams = [await pair.client.open_stream(request(f"/s/{n}", b"POST")) for n in range(4)]
        sent = [b""] * 4
        writer_back = trio.Event()

        async def write_first() -> None:
            await streams[0].send_data(b"first")
            writer_back.set()

        with trio.fail_after(30):
            gate.gated = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write_first)
                await wait_until(lambda: gate.held == 1)  # the writer is in its write
                for n in (1, 2, 3):
                    await streams[n].send_data(b"x")  # returns though the write is held
                    sent[n] += b"x"

                def settled(writes: int) -> bool:
                    return gate.passed == writes and (gate.held > 0 or writer_back.is_set())

                try:
                    for writes in range(1, 9):
                        await streams[writes % 3 + 1].send_data(b"y")
                        sent[writes % 3 + 1] += b"y"
                        gate.allow()
                        await wait_until(partial(settled, writes))
                        if writer_back.is_set():
                            break
                finally:
                    gate.open()
                assert writer_back.is_set() and writes <= 4, "it kept writing for the others"
            for stream in streams:
                await stream.end()
                await stream.wait_headers()
            assert received == {
                "/s/0": b"first",
                **{f"/s/{n}": sent[n] for n in (1, 2, 3)},
            }


async def test_what_a_writer_hands_back_is_sent_though_the_connections_flush_had_started() -> None:
    """A writer whose turn ends hands what is still queued to the connection's own flush. That
    flush may have started already and found the writer busy; it still sends what it is handed,
    on a connection where nothing else is sent. (Before, those frames waited for the next
    write, and a quiet connection has none.) The interleaving depends on trio's order within a
    scheduler pass, so it is tried 20 times; over a socket pair, whose writes take one pass as
    a real connection's do."""
    arrived: dict[str, bytearray] = {}

    async def record(stream: H2Stream) -> None:
        got = arrived.setdefault(path_of(stream), bytearray())
        while chunk := await stream.receive_some():
            got += chunk
        await stream.send_headers(OK, end_stream=True)

    gates: list[GatedStream] = []

    def gated(transport: trio.abc.Stream) -> trio.abc.Stream:
        gates.append(GatedStream(transport))
        return gates[-1]

    async with open_pair(record, wrap_client_transport=gated, sockets=True) as pair:
        gate, client = gates[0], pair.client

        def in_write(passed: int) -> bool:
            """`passed` writes went through and the next one is held."""
            return gate.passed == passed and gate.held == 1

        for trial in range(20):
            writer = await client.open_stream(request(f"/{trial}/writer", b"POST"))
            other = await client.open_stream(request(f"/{trial}/other", b"POST"))
            with trio.fail_after(30):
                gate.gated = True
                before = gate.passed
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(writer.send_data, b"w")
                    await wait_until(lambda: gate.held == 1)
                    for writes in range(1, WRITES_PER_TURN):
                        await other.send_data(b"y")  # returns at once: the writer sends it
                        gate.allow()
                        await wait_until(partial(in_write, before + writes))
                    # The writer is in the last write of its turn, and more is queued: it
                    # will hand that back. In this same pass the connection's own flush starts,
                    # as a send whose caller is cancelled at that moment starts it.
                    await other.send_data(b"z")
                    gate.allow(2)
                    client._flush_later()
                await trio.testing.wait_all_tasks_blocked()
                assert bytes(arrived[f"/{trial}/other"]) == b"yyyz", f"trial {trial}: z not sent"
                gate.open()
                for stream in (writer, other):
                    await stream.end()
                    await stream.wait_headers()
            assert bytes(arrived[f"/{trial}/writer"]) == b"w"


# -- flow control --


class PartsRecorder(WrappedStream):
    """Takes writes as pieces (as our TLS stream does), and keeps them."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        super().__init__(inner)
        self.parts: list[object] = []

    async def send_parts(self, parts: list[bytes]) -> None:
        self.parts.extend(parts)
        await self.inner.send_all(b"".join(parts))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.parts.append(data)
        await self.inner.send_all(data)


async def test_a_large_payload_reaches_a_transport_taking_pieces_uncopied() -> None:
    body = payload(64 * 1024)
    recorders: list[PartsRecorder] = []

    def record(transport: trio.abc.Stream) -> trio.abc.Stream:
        recorders.append(PartsRecorder(transport))
        return recorders[-1]

    async def echo(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        await stream.send_data(await stream.read_all(MiB), end_stream=True)

    async with open_pair(echo, wrap_client_transport=record) as pair:
        # Once the server's SETTINGS are in (its PING answer follows them), frames may be as
        # large as it allows; before, 16 KiB frames are cut from the payload.
        await pair.client.ping()
        stream = await pair.client.open_stream(request("/echo", b"POST"))
        await stream.send_data(body, end_stream=True)
        await stream.wait_headers()
        assert await stream.read_all(MiB) == body
    assert any(part is body for part in recorders[0].parts)


async def test_a_slow_reader_holds_one_window_and_does_not_stall_a_fast_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = {"/slow": payload(4 * SMALL.stream_window_bytes, 1), "/fast": payload(8 * MiB, 2)}

    async def send_body(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        await stream.send_data(body[path_of(stream)], end_stream=True)

    async with open_pair(send_body, settings=SMALL) as pair:
        slow = await pair.client.open_stream(request("/slow"), end_stream=True)
        fast = await pair.client.open_stream(request("/fast"), end_stream=True)
        await slow.wait_headers()
        await fast.wait_headers()

        digest = hashlib.sha256()
        with trio.fail_after(30):
            while chunk := await fast.receive_some():
                digest.update(chunk)
                # Nobody reads the slow stream: it buffers no more than its window.
                assert slow.buffered_bytes <= SMALL.stream_window_bytes
                assert pair.client.statistics().bytes_buffered <= 2 * SMALL.stream_window_bytes
        assert digest.digest() == hashlib.sha256(body["/fast"]).digest()

        # The fast stream finished while the slow one sat on a full window.
        await trio.testing.wait_all_tasks_blocked()
        assert slow.buffered_bytes == SMALL.stream_window_bytes
        assert pair.client.statistics().bytes_buffered == SMALL.stream_window_bytes

        # And reading it now brings the rest.
        with trio.fail_after(30):
            assert await slow.read_all(len(body["/slow"])) == body["/slow"]


async def test_reads_smaller_than_a_frame_return_each_byte_once_and_give_the_window_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Four times the connection window, in 16 KiB frames read 1,000 or 7,000 bytes at a time:
    # a window given back short stalls the sender, a byte repeated or lost changes the digest.
    body = payload(4 * SMALL.connection_window_bytes, 3)

    async def send_body(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        await stream.send_data(body, end_stream=True)

    async with open_pair(send_body, settings=SMALL) as pair:
        stream = await pair.client.open_stream(request("/bulk"), end_stream=True)
        await stream.wait_headers()
        received = bytearray()
        with trio.fail_after(30):
            while chunk := await stream.receive_some(1000 if len(received) % 2 else 7000):
                assert len(chunk) <= 7000
                received += chunk
        assert hashlib.sha256(received).digest() == hashlib.sha256(body).digest()
        assert pair.client.statistics().bytes_buffered == 0


async def test_a_reset_stream_gives_its_connection_window_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One stream can take the whole connection window.
    settings = Http2Settings(stream_window_bytes=256 * 1024, connection_window_bytes=256 * 1024)

    async def serve(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        if path_of(stream) == "/endless":
            while True:
                await stream.send_data(b"\0" * 10_000)
        await stream.send_data(payload(4 * 256 * 1024), end_stream=True)

    async with open_pair(serve, settings=settings) as pair:
        endless = await pair.client.open_stream(request("/endless"), end_stream=True)
        await endless.wait_headers()
        assert len(await endless.receive_some(1000)) == 1000
        await trio.testing.wait_all_tasks_blocked()
        # The server is stuck on a full window, nearly all of it unread at the client.
        assert endless.buffered_bytes >= settings.connection_window_bytes - 20_000

        await endless.reset(h2.errors.ErrorCodes.CANCEL)
        with trio.fail_after(30):
            stream = await pair.client.open_stream(request("/bulk"), end_stream=True)
            await stream.wait_headers()
            assert await stream.read_all(4 * 256 * 1024) == payload(4 * 256 * 1024)
        assert pair.client.statistics().bytes_buffered == 0


async def test_a_handler_ignoring_a_complete_body_does_not_shrink_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A handler that answers without reading the body (an auth failure, say)."""
    settings = Http2Settings(stream_window_bytes=65_535, connection_window_bytes=65_535)

    async def refuse(stream: H2Stream) -> None:
        # By now the whole request body has arrived (everything else is blocked).
        await trio.testing.wait_all_tasks_blocked()
        await stream.send_headers([(b":status", b"401")], end_stream=True)

    async with open_pair(refuse, settings=settings) as pair:
        # Ten times the connection window in all.
        with trio.fail_after(30):
            for _ in range(20):
                stream = await pair.client.open_stream(request("/v1/upload", b"POST"))
                await stream.send_data(b"\0" * 32_000, end_stream=True)
                assert header_value(await stream.wait_headers(), b":status") == b"401"


async def test_closing_tunnels_with_unread_data_does_not_shrink_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = Http2Settings(stream_window_bytes=65_535, connection_window_bytes=65_535)

    async def say_and_leave(stream: H2Stream) -> None:
        tunnel = H2ByteStream(stream)
        await stream.send_headers(OK)
        await tunnel.send_all(b"\0" * 32_000)
        await tunnel.aclose()  # END_STREAM, then RST_STREAM: it reads nothing more

    async with open_pair(say_and_leave, settings=settings) as pair:
        with trio.fail_after(30):
            for _ in range(20):
                stream = await pair.client.open_stream(CONNECT)
                await stream.wait_headers()
                await wait_until(partial(all_arrived, stream, 32_000))
                await H2ByteStream(stream).aclose()


async def test_a_complete_response_stays_readable_after_the_connection_closes() -> None:
    """A body the peer ended is not truncated by the connection closing before it is read."""
    body = payload(200_000)

    async def answer_then_hang(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        await stream.send_data(body, end_stream=True)
        await trio.sleep_forever()

    async with open_pair(answer_then_hang) as pair:
        # Our side stays open (an upload still going, a tunnel), so the stream is still live.
        stream = await pair.client.open_stream(request("/v1/upload", b"POST"))
        await wait_until(lambda: stream.buffered_bytes == len(body))
        await pair.server.aclose()
        await pair.client.wait_closed()
        assert await stream.read_all(len(body)) == body
        with pytest.raises(ConnectionLost):
            await stream.send_data(b"more")


async def test_a_client_forgetting_unread_responses_does_not_shrink_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = Http2Settings(stream_window_bytes=65_535, connection_window_bytes=65_535)

    async def answer(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        await stream.send_data(b"\0" * 32_000, end_stream=True)

    async with open_pair(answer, settings=settings) as pair:
        with trio.fail_after(30):
            for _ in range(20):
                stream = await pair.client.open_stream(request("/v1/blob"), end_stream=True)
                await stream.wait_headers()
                await wait_until(partial(all_arrived, stream, 32_000))
                pair.client.forget(stream)  # the caller only wanted the status


# -- liveness --


class MuteStream(WrappedStream):
    """Passes bytes both ways until `mute()`; after that swallows everything it is sent.
    Counts the writes it is given."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        super().__init__(inner)
        self.muted = False
        self.writes = 0

    def mute(self) -> None:
        self.muted = True

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        if self.muted:
            await trio.lowlevel.checkpoint()
            return
        await self.inner.send_all(data)


def muting(streams: list[MuteStream]) -> Callable[[trio.abc.Stream], trio.abc.Stream]:
    def wrap(transport: trio.abc.Stream) -> trio.abc.Stream:
        streams.append(MuteStream(transport))
        return streams[-1]

    return wrap


async def hang(stream: H2Stream) -> None:
    await trio.sleep_forever()


KEEPALIVE = KeepaliveConfig(ping_interval_s=15.0, ping_timeout_s=10.0)


async def test_a_peer_that_stops_answering_is_declared_dead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    muted: list[MuteStream] = []
    async with open_pair(
        hang, client_keepalive=KEEPALIVE, wrap_server_transport=muting(muted)
    ) as pair:
        stream = await pair.client.open_stream(request("/wait"), end_stream=True)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        muted[0].mute()  # the server still reads, but nothing it sends arrives
        await pair.client.wait_closed()

        assert trio.current_time() - start == pytest.approx(
            KEEPALIVE.ping_interval_s + KEEPALIVE.ping_timeout_s
        )
        assert "PING unanswered" in (pair.client.close_reason or "")
        with pytest.raises(ConnectionLost, match="PING unanswered"):
            await stream.wait_headers()
        with pytest.raises(ConnectionLost):
            await pair.client.open_stream(request("/next"))


async def test_an_answering_peer_is_kept_however_long_it_is_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_pair(hang, client_keepalive=KEEPALIVE) as pair:
        stream = await pair.client.open_stream(request("/wait"), end_stream=True)
        await trio.sleep(100 * KEEPALIVE.ping_interval_s)
        assert not pair.client.closed and not pair.server.closed
        assert pair.client.statistics().last_rtt_s is not None
        assert pair.client.statistics().open_streams == 1
        assert stream.headers is None  # still waiting, undisturbed


async def test_ping_measures_the_round_trip(autojump_clock: trio.testing.MockClock) -> None:
    async with open_pair(None) as pair:
        assert await pair.client.ping() >= 0
        assert await pair.server.ping() >= 0


# -- graceful shutdown --


async def test_drain_lets_the_stream_in_flight_finish_and_refuses_new_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    go_on = trio.Event()
    upload = payload(3 * SMALL.stream_window_bytes, 1)
    download = payload(3 * SMALL.stream_window_bytes, 2)

    async def slow_echo(stream: H2Stream) -> None:
        await go_on.wait()
        received = await stream.read_all(len(upload))
        await stream.send_headers(OK)
        await stream.send_data(hashlib.sha256(received).digest() + download, end_stream=True)

    async with open_pair(slow_echo, settings=SMALL) as pair, trio.open_nursery() as nursery:
        in_flight = await pair.client.open_stream(request("/v1/upload", b"POST"))
        await wait_until(lambda: pair.server.statistics().open_streams == 1)

        drained = trio.Event()

        async def drain() -> None:
            await pair.server.drain()
            drained.set()

        nursery.start_soon(drain)
        await wait_until(lambda: pair.client.draining)
        assert not pair.client.usable
        with pytest.raises(StreamRefused):
            await pair.client.open_stream(request("/v1/new"), end_stream=True)
        assert not drained.is_set()

        # The stream in flight still moves several windows of data both ways.
        go_on.set()
        with trio.fail_after(30):
            await in_flight.send_data(upload, end_stream=True)
            await in_flight.wait_headers()
            answer = await in_flight.read_all(32 + len(download))
            await drained.wait()
        assert answer == hashlib.sha256(upload).digest() + download
        assert not pair.server.closed and not pair.client.closed


class HeldStream(WrappedStream):
    """Holds back what it receives while `held` (a peer, or a network, that is slow to deliver)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        super().__init__(inner)
        self._gate = trio.Event()
        self._gate.set()

    def hold(self) -> None:
        self._gate = trio.Event()

    def release(self) -> None:
        self._gate.set()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        await self._gate.wait()
        return data


async def test_a_stream_opened_as_the_server_drains_is_refused() -> None:
    first_seen = trio.Event()

    async def hold(stream: H2Stream) -> None:
        first_seen.set()
        await trio.sleep_forever()

    held: list[HeldStream] = []

    def wrap(transport: trio.abc.Stream) -> trio.abc.Stream:
        held.append(HeldStream(transport))
        return held[0]

    async with open_pair(hold, wrap_client_transport=wrap) as pair, trio.open_nursery() as nursery:
        first = await pair.client.open_stream(request("/first"), end_stream=True)
        await first_seen.wait()
        # The GOAWAY is on its way but the client has not read it when it opens a stream.
        held[0].hold()
        nursery.start_soon(pair.server.drain)
        await trio.testing.wait_all_tasks_blocked()
        assert pair.client.usable
        late = await pair.client.open_stream(request("/late"), end_stream=True)
        await trio.testing.wait_all_tasks_blocked()
        held[0].release()
        with pytest.raises(StreamRefused):
            await late.wait_headers()
        assert pair.server.statistics().streams_opened == 1
        # The first stream is still served.
        assert not pair.client.closed
        assert first.headers is None
        nursery.cancel_scope.cancel()


# -- misbehaving peers --


async def test_garbage_from_the_client_closes_the_connection_and_cancels_handlers() -> None:
    handler_cancelled = trio.Event()
    started = trio.Event()

    async def hang(stream: H2Stream) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            handler_cancelled.set()
            raise

    async with open_pair(hang) as pair:
        stream = await pair.client.open_stream(request("/hang"), end_stream=True)
        await started.wait()
        await pair.client_transport.send_all(b"\xff" * 64)
        with trio.fail_after(5):
            await pair.server.wait_closed()
            await handler_cancelled.wait()
            await pair.client.wait_closed()
        assert "frame" in (pair.server.close_reason or "")
        assert "FRAME_SIZE_ERROR" in (pair.client.close_reason or "")
        with pytest.raises(ConnectionLost):
            await stream.wait_headers()


async def test_an_http1_answer_closes_a_client_at_once(nursery: trio.Nursery) -> None:
    client_end, peer = trio.testing.memory_stream_pair()
    client = Http2Connection(client_end, client_side=True)
    await nursery.start(client.run)
    stream = await client.open_stream(request("/"), end_stream=True)
    assert (await peer.receive_some()).startswith(b"PRI * HTTP/2.0")
    await peer.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    with trio.fail_after(5):
        await client.wait_closed()
    assert "frame" in (client.close_reason or "")
    with pytest.raises(ConnectionLost):
        await stream.wait_headers()


async def test_garbage_instead_of_a_preface_closes_the_server(nursery: trio.Nursery) -> None:
    async def never_called(stream: H2Stream) -> None:
        raise AssertionError("no stream should reach the handler")

    server_end, peer = trio.testing.memory_stream_pair()
    server = Http2Connection(server_end, client_side=False, handler=never_called)
    await nursery.start(server.run)
    await peer.send_all(b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n")
    with trio.fail_after(5):
        await server.wait_closed()
    assert "HTTP/2" in (server.close_reason or "")
    assert server.statistics().streams_opened == 0


async def test_the_peer_closing_mid_stream_fails_open_streams_with_connection_lost() -> None:
    sending = trio.Event()

    async def half_answer(stream: H2Stream) -> None:
        await stream.send_headers(OK)
        await stream.send_data(b"part of it")
        sending.set()
        await trio.sleep_forever()

    async with open_pair(half_answer) as pair:
        upload = await pair.client.open_stream(request("/up", b"POST"))
        download = await pair.client.open_stream(request("/down"), end_stream=True)
        await download.wait_headers()
        await sending.wait()
        await pair.server_transport.aclose()
        with trio.fail_after(5):
            await pair.client.wait_closed()
        assert pair.client.close_reason == "peer closed the connection"
        with pytest.raises(ConnectionLost):
            await download.read_all(1024)
        with pytest.raises(ConnectionLost):
            await upload.send_data(b"more")
        with pytest.raises(ConnectionLost):
            await upload.read_all(1024)
        with pytest.raises(ConnectionLost):
            await pair.client.open_stream(request("/again"))


class BreakableStream(WrappedStream):
    """Passes bytes both ways until `break_writes()`; after that every send fails."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        super().__init__(inner)
        self.broken = False

    def break_writes(self) -> None:
        self.broken = True

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        if self.broken:
            raise trio.BrokenResourceError("connection reset by peer")
        await self.inner.send_all(data)


async def test_a_transport_failing_on_write_closes_the_connection_cleanly() -> None:
    breakable: list[BreakableStream] = []

    def wrap(transport: trio.abc.Stream) -> trio.abc.Stream:
        breakable.append(BreakableStream(transport))
        return breakable[0]

    async with open_pair(None, wrap_server_transport=wrap) as pair:
        breakable[0].break_writes()
        # The server must answer this PING, and its write fails.
        with pytest.raises(ConnectionLost), trio.fail_after(5):
            await pair.client.ping()
        assert "transport broke" in (pair.server.close_reason or "")


async def test_a_peer_that_stops_reading_is_closed_after_the_write_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A lockstep pair: every send waits for the peer to read, and this peer never does.
    ours, _peer = trio.testing.lockstep_stream_pair()
    conn = Http2Connection(ours, client_side=False, write_timeout_s=5.0)
    started = trio.current_time()
    # Its preface never went out, so the connection never got ready: whoever started it is
    # told so with ConnectionLost (the error callers retry), not left waiting.
    with trio.fail_after(60), pytest.raises(ConnectionLost):
        await conn.run()
    assert conn.closed
    assert "stopped reading" in (conn.close_reason or "")
    assert 5.0 <= trio.current_time() - started < 10.0
