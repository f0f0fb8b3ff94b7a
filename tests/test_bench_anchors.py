"""The tunnel benchmark's anchors measure real bytes on real paths, and leave nothing running.

Integration tests: the sink runs as its own process, sshd and ssh are OpenSSH's. They check that
each measurement moves what it claims to; how fast is bench/'s business.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import trio
import trio.testing

from bench.anchors import (
    find_sshd,
    measure_connects,
    measure_download,
    measure_round_trips,
    measure_stream,
    measure_upload,
    open_sink_process,
    open_ssh_reverse_tunnel,
    open_sshd,
    percentile,
    receive_exactly,
    tcp_opener,
)

SMALL_BYTES = 8 << 20


def _descendant_pids() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _still_running(pids: set[int]) -> set[int]:
    running = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.add(pid)
        except psutil.NoSuchProcess:
            pass
    return running


@pytest.fixture
def no_leftover_processes() -> Iterator[set[int]]:
    """Collects (via the test) the pids it started; after the test none may still run. What
    ran before the test (a session fixture's registry, say) is not the test's."""
    before = _descendant_pids()
    started: set[int] = set()
    yield started
    assert not _still_running(started - before), "processes left running after the test"


async def test_direct_tcp_measurements_move_real_bytes(no_leftover_processes: set[int]) -> None:
    async with open_sink_process() as port:
        no_leftover_processes |= _descendant_pids()
        assert no_leftover_processes, "the sink runs in a process of its own"
        open_stream = tcp_opener(port)
        assert await measure_upload(open_stream, streams=2, total_bytes=SMALL_BYTES) > 0
        assert await measure_download(open_stream, streams=2, total_bytes=SMALL_BYTES) > 0
        round_trips = await measure_round_trips(open_stream, count=20)
        connects = await measure_connects(open_stream, count=5)
        early = await measure_connects(open_stream, count=5, early=True)
    assert len(round_trips) == 20
    assert min(round_trips) > 0
    assert len(connects) == 5
    assert min(connects) > 0
    assert len(early) == 5  # the echo checked: the message sent with the opening came back


async def test_sink_acknowledges_only_after_every_byte() -> None:
    async with open_sink_process() as port:
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"S" + struct.pack(">Q", 10) + b"12345")
            await stream.send_eof()
            assert await stream.receive_some(1) == b"", "acknowledged 5 of 10 bytes"
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"S" + struct.pack(">Q", 10) + b"1234567890")
            assert await receive_exactly(stream, 1) == b"K"


async def test_sink_process_is_killed_when_the_body_fails(
    no_leftover_processes: set[int],
) -> None:
    with pytest.raises(RuntimeError, match="body failed"):
        async with open_sink_process():
            no_leftover_processes |= _descendant_pids()
            raise RuntimeError("body failed")


@pytest.mark.skipif(
    find_sshd() is None or not shutil.which("ssh") or not shutil.which("ssh-keygen"),
    reason="needs OpenSSH: sshd (openssh-server), ssh and ssh-keygen (openssh-client)",
)
@pytest.mark.root
async def test_ssh_reverse_tunnel_measurements_move_real_bytes(
    tmp_path: Path, no_leftover_processes: set[int]
) -> None:
    async with (
        open_sink_process() as sink_port,
        open_sshd(tmp_path) as sshd,
        open_ssh_reverse_tunnel(sshd, sink_port) as public_port,
    ):
        assert public_port not in (sink_port, sshd.port)
        open_stream = tcp_opener(public_port)
        assert await measure_upload(open_stream, streams=2, total_bytes=SMALL_BYTES) > 0
        round_trips = await measure_round_trips(open_stream, count=20)
        connects = await measure_connects(open_stream, count=5)
        # sink, sshd, its session processes and ssh, all of which must be gone afterwards
        no_leftover_processes |= _descendant_pids()
    assert len(no_leftover_processes) >= 4
    assert len(round_trips) == 20
    assert min(round_trips) > 0
    assert len(connects) == 5
    assert min(connects) > 0


def test_percentile_interpolates_between_ranks() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 50) == 2.5
    assert percentile(samples, 100) == 4.0
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


class _StallingStream(trio.abc.Stream):
    """A stream whose sender is held up `stall_s` once, at its `stall_at`-th send."""

    def __init__(self, inner: trio.abc.Stream, stall_at: int, stall_s: float) -> None:
        self.inner, self.stall_at, self.stall_s, self.sends = inner, stall_at, stall_s, 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sends += 1
        if self.sends == self.stall_at:
            await trio.sleep(self.stall_s)
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_stalled_sender_shows_in_every_late_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # At 1 kHz the sender is held up 0.2 s at its 20th message, so the 200 due meanwhile go out
    # late together. Timed from when each was due, they all show it (about 100 of them by 0.1 s
    # or more); timed from when each was sent, only the one held up would (coordinated omission).
    client, server = trio.testing.memory_stream_pair()

    async def echo() -> None:
        assert await receive_exactly(server, 1) == b"E"
        while data := await server.receive_some():
            await server.send_all(data)

    async def open_stream(first: bytes = b"") -> trio.abc.Stream:
        return _StallingStream(client, stall_at=2 + 20, stall_s=0.2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo)
        samples = await measure_stream(open_stream, count=400, rate_hz=1000.0)
        nursery.cancel_scope.cancel()
    assert len(samples) == 400
    assert max(samples) == pytest.approx(0.2)
    assert 95 <= sum(1 for s in samples if s >= 0.1) <= 105
