"""Writing several buffers as one write, without joining them first.

An HTTP/2 connection queues a large DATA payload as the bytes object it came as, beside its
9-byte frame header (`wire.http2`). Joining the two to write them would copy the payload
once more; the streams under the connection that can take the pieces as they are (our TLS
stream, and our WebSocket stream over it) say so by having `send_parts`, and the payload then
reaches the cipher, or the WebSocket mask, uncopied.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

Buffer = bytes | bytearray | memoryview


async def send_parts(stream: trio.abc.SendStream, parts: Sequence[Buffer]) -> None:
    """Send `parts` in order as one write: as they are where `stream` has `send_parts(parts)`
    (`send_all(b"".join(parts))` without the join), else joined."""
    if len(parts) == 1:
        await stream.send_all(parts[0])
        return
    # Looked up, not checked with isinstance against a runtime-checkable Protocol: that walks
    # the protocol's members each time, 3.6 us against 0.07 us, on every write of a connection.
    send: Callable[[Sequence[Buffer]], Awaitable[None]] | None = getattr(stream, "send_parts", None)
    if send is not None:
        await send(parts)
    else:
        await stream.send_all(b"".join(parts))
