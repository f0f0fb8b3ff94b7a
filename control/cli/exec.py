"""`levers9 exec`: a process in a task's container, with a terminal when asked."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import (
    AsyncIterable,
    Iterator,
)

import trio

from control.cli.client import ControlClient
from control.cli.common import (
    STDIN_CHUNK_BYTES,
    Interrupted,
    client_from_args,
    interruptible,
)
from control.cli.output import Console, has_fileno, isatty
from control.cli.usage import EXIT_INTERRUPTED, UsageError
from workerapi.models import ExecRequest, ExecResize


class FdReader:
    """A file descriptor's bytes as an async iterator, each read in a worker thread (blocking
    reads work for terminals, pipes and files alike; the descriptor's mode is left alone). A
    read still waiting when the exec ends is abandoned: the process exits right after."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._ended = False

    def __aiter__(self) -> FdReader:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        data = await trio.to_thread.run_sync(
            os.read, self.fd, STDIN_CHUNK_BYTES, abandon_on_cancel=True
        )
        if not data:
            self._ended = True
            raise StopAsyncIteration
        return data


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """The terminal on `fd` in raw mode (keys go to the remote process as typed, Ctrl-C
    included), restored however the body ends."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _terminal_size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    if size.lines <= 0 or size.columns <= 0:  # a terminal that never set its size
        return 24, 80
    return size.lines, size.columns


async def exec_session(
    client: ControlClient,
    task_id: str,
    request: ExecRequest,
    console: Console,
    *,
    stdin: AsyncIterable[bytes] | None,
    watch_resizes: bool,
) -> int:
    """Run `request` in the task, carrying stdio (and, on a terminal, its size)."""

    async def on_output(channel: int, data: bytes) -> None:
        console.write_bytes(channel, data)

    if not watch_resizes:
        return await client.exec_in_task(task_id, request, on_output=on_output, stdin=stdin)
    send, receive = trio.open_memory_channel[ExecResize](16)
    with trio.open_signal_receiver(signal.SIGWINCH) as winches:
        async with trio.open_nursery() as nursery:

            async def forward_resizes() -> None:
                async with send:
                    async for _ in winches:
                        rows, cols = _terminal_size(sys.stdout.fileno())
                        await send.send(ExecResize(rows=rows, cols=cols))

            nursery.start_soon(forward_resizes)
            code = await client.exec_in_task(
                task_id, request, on_output=on_output, stdin=stdin, resizes=receive
            )
            nursery.cancel_scope.cancel()
    return code


async def cmd_exec(args: argparse.Namespace) -> int:
    if not args.command:
        raise UsageError("exec needs a command after '--': levers9 exec TASK -- CMD...")
    stdin_tty, stdout_tty = isatty(sys.stdin), isatty(sys.stdout)
    tty = args.tty if args.tty is not None else (stdin_tty and stdout_tty)
    rows, cols = _terminal_size(sys.stdout.fileno()) if tty and stdout_tty else (24, 80)
    request = ExecRequest(command=tuple(args.command), tty=tty, rows=rows, cols=cols)
    console = Console.from_sys()
    main_thread = threading.current_thread() is threading.main_thread()
    async with client_from_args(args) as client:
        stdin = FdReader(sys.stdin.fileno()) if has_fileno(sys.stdin) else None
        raw = raw_terminal(sys.stdin.fileno()) if tty and stdin_tty else contextlib.nullcontext()
        with raw:
            result = await interruptible(
                lambda: exec_session(
                    client,
                    args.task_id,
                    request,
                    console,
                    stdin=stdin,
                    watch_resizes=tty and stdout_tty and main_thread,
                )
            )
    if isinstance(result, Interrupted):
        return EXIT_INTERRUPTED
    return result if 0 <= result <= 255 else 1
