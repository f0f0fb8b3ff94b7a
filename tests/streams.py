"""Byte-stream exchanges the tests share: send, half-close, read to the end."""

from __future__ import annotations

import trio


async def exchange(stream: trio.abc.HalfCloseableStream, data: bytes) -> bytes:
    """Send `data`, end our side, and return everything the far end sends until it ends its
    own; closes the stream."""
    try:
        await stream.send_all(data)
        await stream.send_eof()
        received = b""
        while chunk := await stream.receive_some():
            received += chunk
        return received
    finally:
        await stream.aclose()
