"""`ConflictDetector`: the guard trio's own streams use so that two tasks never send (or
receive) on one half of a stream at once; the second gets `trio.BusyResourceError` at once
instead of interleaving bytes. The TLS stream and the WebSocket byte stream share it."""

from __future__ import annotations

from types import TracebackType

import trio


class ConflictDetector:
    """Raises `trio.BusyResourceError` when two tasks use the same half of a stream at once."""

    __slots__ = ("_held", "_message")

    def __init__(self, message: str) -> None:
        self._message = message
        self._held = False

    def __enter__(self) -> None:
        if self._held:
            raise trio.BusyResourceError(self._message)
        self._held = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._held = False
