"""Run a daemon's main task until SIGTERM or SIGINT, then cancel it and return.

Kubernetes stops a pod with SIGTERM and waits its grace period; cancelling the main task is
how every owned task, stream and connection gets its bounded cleanup before the exit.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import trio


async def run_until_signalled(main: Callable[[], Awaitable[object]]) -> int:
    """Returns the signal number that stopped `main`, or 0 when it returned by itself."""
    received = 0
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal received
                async for signum in signals:
                    received = signum
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            await main()
            nursery.cancel_scope.cancel()
    return received
