"""What every command shares: the client from the global options, bounded calls, Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import (
    Awaitable,
    Callable,
)
from typing import TypeVar

import trio

from control.cli.client import ControlClient, open_control_client

T = TypeVar("T")
CALL_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.25
"""How often `levers9 run` asks for a starting task's state (for its progress line)."""
DEFAULT_WAIT_S = 60.0
EXIT_USAGE = 2
EXIT_DEADLINE = 124
EXIT_INTERRUPTED = 130
STDIN_CHUNK_BYTES = 64 * 1024


def client_from_args(
    args: argparse.Namespace,
) -> contextlib.AbstractAsyncContextManager[ControlClient]:
    return open_control_client(args.controlplane, args.token, args.ca)


async def timed(call: Awaitable[T]) -> T:
    with trio.fail_after(CALL_TIMEOUT_S):
        return await call


class Interrupted:
    """What `interruptible` returns when Ctrl-C stopped the work."""


INTERRUPTED = Interrupted()


async def interruptible(work: Callable[[], Awaitable[T]]) -> T | Interrupted:
    """Run `work` until it returns or Ctrl-C (SIGINT) cancels it. Signals reach only the main
    thread; elsewhere (tests calling `main` in a thread) `work` simply runs."""
    if threading.current_thread() is not threading.main_thread():
        return await work()
    result: T | Interrupted = INTERRUPTED
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            result = await work()
            nursery.cancel_scope.cancel()
    return result
