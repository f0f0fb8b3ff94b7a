"""What every command shares: the client from the global options (or the contexts file),
bounded calls, Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
from collections.abc import (
    Awaitable,
    Callable,
    Mapping,
)
from typing import Any, TypeVar

import trio

from control.cli.client import ControlClient, open_control_client
from control.cli.contexts import Given, Target, config_path, load, resolve_target
from control.cli.output import isatty
from control.cli.usage import CALL_TIMEOUT_S

T = TypeVar("T")
POLL_INTERVAL_S = 0.25
"""How often `levers9 run` asks for a starting task's state (for its progress line)."""
STDIN_CHUNK_BYTES = 64 * 1024


def target_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Target:
    """The controlplane, token and CA a command uses: its flags, then `environ`, then the
    contexts file (`control.cli.contexts`)."""
    given = Given.of(
        controlplane=args.controlplane,
        token=args.token,
        ca=args.ca,
        context=args.use_context,
        environ=environ,
    )
    return resolve_target(given, lambda: load(config_path(environ)))


def client_from_args(
    args: argparse.Namespace,
) -> contextlib.AbstractAsyncContextManager[ControlClient]:
    target = target_from_args(args, os.environ)
    return open_control_client(
        target.controlplane, target.token, target.ca_file, ca_pem=target.ca_pem
    )


TOKEN_FLAG_WARNING = (
    "--token puts the token in the process list and shell history; "
    "use `levers9 login` or LEVERS9_TOKEN"
)


def token_flag_warning(args: argparse.Namespace, stdin: Any, stderr: Any) -> str | None:
    """The line to print when `--token` was typed where a person is (stdin or stderr a
    terminal); scripts with a pipe on both keep quiet."""
    if getattr(args, "token", None) and (isatty(stdin) or isatty(stderr)):
        return TOKEN_FLAG_WARNING
    return None


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
