"""A TCP service that answers the SHA-256 of what it was sent: the far end of byte-stream
tests through a worker (box ports, CONNECT streams)."""

from __future__ import annotations

import hashlib
import os

import trio


async def open_hash_service(nursery: trio.Nursery) -> int:
    """A TCP service on loopback (the workers' side) that answers the SHA-256 of everything
    it was sent; returns its port."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream: trio.SocketStream) -> None:
        digest = hashlib.sha256()
        async with stream:
            while data := await stream.receive_some(1 << 20):
                digest.update(data)
            await stream.send_all(digest.hexdigest().encode())

    await nursery.start(trio.serve_listeners, handle, listeners)
    return int(listeners[0].socket.getsockname()[1])


async def check_through_hash_service(
    stream: trio.abc.HalfCloseableStream, total_bytes: int
) -> bool:
    """Send `total_bytes` of random data to the hash service over `stream`, then compare
    the SHA-256 it answers with our own; closes the stream."""
    block = os.urandom(1 << 20)
    expected = hashlib.sha256()
    for _ in range(total_bytes // len(block)):
        await stream.send_all(block)
        expected.update(block)
    await stream.send_eof()
    answer = b""
    while data := await stream.receive_some():
        answer += data
    await stream.aclose()
    return answer.decode() == expected.hexdigest()
