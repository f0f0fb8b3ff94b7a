"""The worker's side of exec: one exec'd process (`ExecSession`, over runc's `ExecProcess`)
carried over a WebSocket until it exits. The framing is `workerapi.exec`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Awaitable, Callable

import trio

from agent.runtime.runc import ExecProcess
from wire.errors import ApiError, dumps, loads
from wire.h2websocket import H2WebSocket, WebSocketClosed
from workerapi.exec import CHUNK_BYTES, STDERR, STDIN, STDOUT, frame, parse_request, unframe
from workerapi.models import ExecExit, ExecRequest, ExecResize

StartExec = Callable[[ExecRequest], Awaitable["ExecSession"]]


async def serve_exec(start: StartExec, ws: H2WebSocket) -> None:
    """The worker's side: read the request, start the process with `start` (the container
    manager's), and carry its stdio until it exits."""
    try:
        request = parse_request(await ws.receive_message())
        process = await start(request)
    except ApiError as exc:
        await ws.send_message(dumps(exc.to_body()).decode())
        await ws.aclose(1008, exc.message[:120])
        return
    except WebSocketClosed:
        return
    code: int | None = None
    async with process:
        async with trio.open_nursery() as nursery:

            async def pump_in() -> None:
                try:
                    while True:
                        message = await ws.receive_message()
                        if isinstance(message, str):
                            resize = loads(message.encode(), ExecResize)
                            process.resize(resize.rows, resize.cols)
                            continue
                        channel, data = unframe(message)
                        if channel != STDIN:
                            continue
                        if not data:
                            await process.close_stdin()
                        else:
                            await process.write_stdin(data)
                except (WebSocketClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                    # The client went away: the process gets a hangup like a closed terminal.
                    if code is None:
                        process.hangup()

            async def pump_out(channel: int, source: trio.abc.ReceiveStream) -> None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await source.receive_some(CHUNK_BYTES):
                        await ws.send_message(frame(channel, bytes(data)))

            nursery.start_soon(pump_in)
            async with trio.open_nursery() as outputs:
                for channel, source in process.outputs():
                    outputs.start_soon(pump_out, channel, source)
            code = await process.wait()
            with contextlib.suppress(WebSocketClosed):
                await ws.send_message(dumps(ExecExit(exit_code=code)).decode())
            nursery.cancel_scope.cancel()


class ExecSession:
    """One exec'd process as `serve_exec` drives it, over runc's `ExecProcess` (pipes, or one
    pseudo-terminal carrying both directions)."""

    def __init__(self, process: ExecProcess) -> None:
        self.process = process

    async def __aenter__(self) -> ExecSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.process.aclose()

    def outputs(self) -> list[tuple[int, trio.abc.ReceiveStream]]:
        if self.process.terminal is not None:
            return [(STDOUT, self.process.terminal)]
        found: list[tuple[int, trio.abc.ReceiveStream]] = []
        if self.process.stdout is not None:
            found.append((STDOUT, self.process.stdout))
        if self.process.stderr is not None:
            found.append((STDERR, self.process.stderr))
        return found

    async def write_stdin(self, data: bytes) -> None:
        if self.process.terminal is not None:
            await self.process.terminal.send_all(data)
        elif self.process.stdin is not None:
            await self.process.stdin.send_all(data)

    async def close_stdin(self) -> None:
        if self.process.terminal is not None:
            # A terminal has no half-close; end of input is the EOF character, as typed.
            await self.process.terminal.send_all(b"\x04")
        elif self.process.stdin is not None:
            await self.process.stdin.aclose()

    def resize(self, rows: int, cols: int) -> None:
        if self.process.terminal is not None:
            self.process.terminal.resize(rows, cols)

    def hangup(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGHUP)

    async def wait(self) -> int:
        return await self.process.wait()
