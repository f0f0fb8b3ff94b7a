"""Writing several buffers as one write, without joining them first.

An HTTP/2 connection queues a large DATA payload as the bytes object it came as, beside its
9-byte frame header (`agent.wire.http2`). Joining the two to write them would copy the payload
once more; the streams under the connection that can take the pieces as they are (our TLS
stream, and our WebSocket stream over it) say so by having `send_parts`, and the payload then
reaches the cipher, or the WebSocket mask, uncopied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import trio

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class PartsSender(Protocol):
    """A stream whose `send_parts(parts)` is `send_all(b"".join(parts))` without the join."""

    async def send_parts(self, parts: Sequence[Buffer]) -> None: ...


async def send_parts(stream: trio.abc.SendStream, parts: Sequence[Buffer]) -> None:
    """Send `parts` in order as one write: as they are where `stream` can, else joined."""
    if len(parts) == 1:
        await stream.send_all(parts[0])
    elif isinstance(stream, PartsSender):
        await stream.send_parts(parts)
    else:
        await stream.send_all(b"".join(parts))
