"""The fault proxy (`sim.faultproxy`): what passes and what it holds, as a client and a backend
on either side of it see.

`Faults` (what may pass) is checked on its own; the proxy is checked with real loopback
sockets. The quiet periods are real time (`QUIET_S`): whether bytes crossed the kernel's
loopback is not on trio's clock.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable

import attrs
import pytest
import trio

from sim.faultproxy import FaultProxy, Faults, Meter
from tests.hash_service import check_through_hash_service, open_hash_service
from tests.streams import exchange

QUIET_S = 0.3
"""How long a stream that must stay silent is listened to."""
TIMEOUT_S = 5.0


@attrs.define
class Backend:
    """A loopback TCP server; what it saw."""

    port: int = 0
    received: bytearray = attrs.field(factory=bytearray)
    accepted: int = 0
    open: int = 0
    resets: int = 0


async def serve(nursery: trio.Nursery, answer: bytes | None = None) -> Backend:
    """A backend that echoes what it is sent (ending its side after the client's end) or,
    with `answer`, sends `answer` at once and then echoes."""
    backend = Backend()

    async def handle(stream: trio.SocketStream) -> None:
        backend.accepted += 1
        backend.open += 1
        try:
            async with stream:
                if answer is not None:
                    await stream.send_all(answer)
                while data := await stream.receive_some():
                    backend.received += data
                    await stream.send_all(data)
                await stream.send_eof()
        except trio.BrokenResourceError:
            backend.resets += 1
        finally:
            backend.open -= 1

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    backend.port = int(listeners[0].socket.getsockname()[1])
    return backend


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def receive_exactly(stream: trio.SocketStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        assert chunk, f"the stream ended after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


async def assert_quiet(stream: trio.SocketStream) -> None:
    with trio.move_on_after(QUIET_S):
        got = await stream.receive_some()
        pytest.fail(f"{len(got)} bytes came through: {got[:40]!r}")


async def wait_until(condition: Callable[[], bool]) -> None:
    """Until `condition()` holds: what it reads is changed by tasks on socket events, which
    signal nothing."""
    with trio.fail_after(TIMEOUT_S):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def assert_reset(stream: trio.SocketStream) -> None:
    with trio.fail_after(TIMEOUT_S), pytest.raises(trio.BrokenResourceError):
        await stream.receive_some()


async def assert_ended(stream: trio.SocketStream) -> None:
    """The far end went away: end of stream or a reset."""
    with trio.fail_after(TIMEOUT_S):
        try:
            assert await stream.receive_some() == b""
        except trio.BrokenResourceError:
            pass


# -- what may pass (sans-IO)


def test_a_stall_admits_nothing_either_way_until_resumed() -> None:
    faults = Faults()
    up, down = Meter(downstream=False), Meter(downstream=True)
    assert (faults.admit(up, 10), faults.admit(down, 10)) == (10, 10)
    faults.stall()
    assert (faults.admit(up, 10), faults.admit(down, 10)) == (0, 0)
    assert faults.holds(up) and faults.holds(down)
    faults.resume()
    assert (faults.admit(up, 10), faults.admit(down, 10)) == (10, 10)
    assert not faults.holds(down)


def test_stall_after_stops_the_first_downstream_over_the_count_only() -> None:
    faults = Faults()
    early, other, up = Meter(downstream=True), Meter(downstream=True), Meter(downstream=False)
    assert faults.admit(early, 500) == 500  # before arming: not counted
    faults.stall_after(100)
    assert faults.admit(up, 1000) == 1000  # client → backend is never counted
    assert faults.admit(early, 60) == 60
    assert faults.admit(other, 60) == 60
    assert faults.admit(early, 60) == 40  # over the count: exactly 100 passed, then held
    assert faults.admit(early, 20) == 0
    assert faults.holds(early)
    # One stream took it: the others go on.
    assert faults.admit(other, 1000) == 1000
    assert faults.admit(Meter(downstream=True), 1000) == 1000
    # Arming again does not free the held stream; only resume does.
    faults.stall_after(10)
    assert faults.admit(early, 20) == 0
    faults.resume()
    assert faults.admit(early, 20) == 20  # resume disarmed the second one too
    assert faults.admit(other, 1000) == 1000
    with pytest.raises(ValueError, match="nbytes"):
        faults.stall_after(-1)


def test_a_stream_at_exactly_the_count_passes_and_the_next_byte_holds() -> None:
    faults = Faults()
    meter = Meter(downstream=True)
    faults.stall_after(8)
    assert faults.admit(meter, 8) == 8
    assert not faults.holds(meter)
    assert faults.admit(meter, 1) == 0
    assert faults.holds(meter)


# -- the proxy on loopback


async def test_bytes_pass_both_ways_with_the_end_of_stream(nursery: trio.Nursery) -> None:
    backend = await serve(nursery)
    proxy = FaultProxy([backend.port])
    port = await proxy.start(nursery)
    assert port == proxy.port != 0
    with trio.fail_after(TIMEOUT_S):
        # `exchange` half-closes and reads to the end: the echo ends only once our end of
        # stream came through, and its own end must come back.
        assert await exchange(await trio.open_tcp_stream("127.0.0.1", port), b"hello") == b"hello"
        assert bytes(backend.received) == b"hello"
        # Many chunks' worth, each byte once and in order: the hash service's answer says so.
        proxy.backends[:] = [await open_hash_service(nursery)]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        assert await check_through_hash_service(stream, 16 << 20)
    assert proxy.connections == 2


async def test_connections_go_round_robin_skipping_a_backend_that_refuses(
    nursery: trio.Nursery,
) -> None:
    a, b = await serve(nursery, b"a"), await serve(nursery, b"b")
    proxy = FaultProxy([a.port, refused_port(), b.port])
    port = await proxy.start(nursery)
    answers = []
    with trio.fail_after(TIMEOUT_S):
        for _ in range(4):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                answers.append(await receive_exactly(stream, 1))
    assert answers == [b"a", b"b", b"a", b"b"]
    assert (a.accepted, b.accepted, proxy.connections) == (2, 2, 4)
    # The backends may change under it; with none that accepts, the client is turned away.
    proxy.backends[:] = [refused_port()]
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await assert_ended(stream)
    assert proxy.connections == 4


async def test_cut_resets_every_open_connection_and_new_ones_still_work(
    nursery: trio.Nursery,
) -> None:
    backend = await serve(nursery)
    proxy = FaultProxy([backend.port])
    port = await proxy.start(nursery)
    with trio.fail_after(TIMEOUT_S):
        streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        for stream in streams:
            await stream.send_all(b"ping")
            assert await receive_exactly(stream, 4) == b"ping"
        assert (proxy.open_connections, backend.open) == (2, 2)
    assert proxy.cut() == 2
    assert proxy.open_connections == 0
    for stream in streams:
        await assert_reset(stream)
        await stream.aclose()
    await wait_until(lambda: backend.open == 0)  # the backend's side was dropped too
    assert backend.resets == 2
    with trio.fail_after(TIMEOUT_S):
        assert await exchange(await trio.open_tcp_stream("127.0.0.1", port), b"again") == b"again"
    # A connection both sides ended is no longer open.
    await wait_until(lambda: proxy.open_connections == 0)
    assert proxy.cut() == 0
    assert proxy.connections == 3


async def test_a_stall_holds_bytes_both_ways_and_resume_delivers_them_in_order(
    nursery: trio.Nursery,
) -> None:
    backend = await serve(nursery)
    proxy = FaultProxy([backend.port])
    port = await proxy.start(nursery)
    with trio.fail_after(TIMEOUT_S):
        before = await trio.open_tcp_stream("127.0.0.1", port)
        await before.send_all(b"warm")
        assert await receive_exactly(before, 4) == b"warm"
    proxy.stall()
    for part in (b"one ", b"two ", b"three"):
        await before.send_all(part)
    # Opened within the stall: accepted and connected, but carrying nothing, not even the
    # end of stream.
    during = await trio.open_tcp_stream("127.0.0.1", port)
    await during.send_eof()
    await wait_until(lambda: (proxy.open_connections, backend.accepted) == (2, 2))
    await assert_quiet(before)
    await assert_quiet(during)
    assert bytes(backend.received) == b"warm"
    assert backend.open == 2
    proxy.resume()
    with trio.fail_after(TIMEOUT_S):
        assert await receive_exactly(before, 13) == b"one two three"
        assert await during.receive_some() == b""  # the echo ended once our end came
    assert proxy.connections == 2
    await before.aclose()
    await during.aclose()


async def test_stall_after_passes_exactly_that_much_of_one_response_until_resume(
    nursery: trio.Nursery,
) -> None:
    blob = os.urandom(2 << 20)
    backend = await serve(nursery, blob)
    proxy = FaultProxy([backend.port])
    port = await proxy.start(nursery)
    proxy.stall_after(100_000)
    stalled = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(TIMEOUT_S):
        head = await receive_exactly(stalled, 100_000)
    await assert_quiet(stalled)
    # One-shot: the next connection gets its whole answer.
    with trio.fail_after(TIMEOUT_S):
        other = await trio.open_tcp_stream("127.0.0.1", port)
        assert await receive_exactly(other, len(blob)) == blob
    await other.aclose()
    await assert_quiet(stalled)
    proxy.resume()
    with trio.fail_after(TIMEOUT_S):
        rest = await receive_exactly(stalled, len(blob) - len(head))
    assert head + rest == blob
    await stalled.aclose()


async def test_the_proxy_ends_with_its_nursery_and_closes_what_it_forwarded() -> None:
    async with trio.open_nursery() as outer:
        backend = await serve(outer)
        with trio.fail_after(TIMEOUT_S):
            async with trio.open_nursery() as own:
                proxy = FaultProxy([backend.port])
                port = await proxy.start(own)
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(b"ping")
                assert await receive_exactly(stream, 4) == b"ping"
                proxy.stall()  # a held connection ends as well
                await stream.send_all(b"held")
                own.cancel_scope.cancel()
            # The nursery exited: every task of the proxy ended.
            await assert_ended(stream)
            await stream.aclose()
            with pytest.raises(OSError):
                await trio.open_tcp_stream("127.0.0.1", port)
            await wait_until(lambda: backend.open == 0)
        outer.cancel_scope.cancel()
