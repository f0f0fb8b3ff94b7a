"""Exec: a process in a running container, its stdio carried over one WebSocket.

The wire protocol is small and sans-IO (the functions at the top, tested without sockets):

- client → worker, first message (text): an `ExecRequest` (command, tty, env, workdir, size);
- binary messages carry stdio, the first byte naming the channel (0 stdin, 1 stdout, 2 stderr,
  as Kubernetes' channel protocol does); an empty stdin message is end of input;
- client → worker text messages after the first are `ExecResize` (TTY only);
- worker → client, last message (text): `ExecExit` with the exit code; then the close.

A TTY merges stdout and stderr (as a terminal does) and arrives on channel 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from agent import models
from agent.h2websocket import H2WebSocket, WebSocketClosed
from agent.models import ApiError, ErrorCode, ExecExit, ExecRequest, ExecResize
from agent.runc import ExecProcess

if TYPE_CHECKING:
    from agent.containers import ContainerManager

log = logging.getLogger("levers9.exec")

STDIN, STDOUT, STDERR = 0, 1, 2
CHUNK_BYTES = 64 * 1024


def frame(channel: int, data: bytes) -> bytes:
    return bytes([channel]) + data


def unframe(message: bytes) -> tuple[int, bytes]:
    if not message or message[0] not in (STDIN, STDOUT, STDERR):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            "exec binary messages start with a channel byte: 0 stdin, 1 stdout, 2 stderr",
        )
    return message[0], message[1:]


def parse_request(message: bytes | str) -> ExecRequest:
    if not isinstance(message, str):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT, "the first exec message must be a JSON ExecRequest (text)"
        )
    request = models.loads(message.encode(), ExecRequest)
    if not request.command:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, "command must not be empty", field="command")
    return request


async def serve_exec(manager: ContainerManager, container_id: str, ws: H2WebSocket) -> None:
    """The worker's side: run the process and carry its stdio until it exits."""
    try:
        request = parse_request(await ws.receive_message())
        process = await manager.exec(container_id, request)
    except ApiError as exc:
        await ws.send_message(models.dumps(exc.to_body()).decode())
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
                            resize = models.loads(message.encode(), ExecResize)
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
                await ws.send_message(models.dumps(ExecExit(exit_code=code)).decode())
            nursery.cancel_scope.cancel()


async def run_exec(
    ws: H2WebSocket,
    request: ExecRequest,
    *,
    stdin: AsyncIterable[bytes] | None = None,
    on_output: Callable[[int, bytes], Awaitable[None]],
    resizes: trio.MemoryReceiveChannel[ExecResize] | None = None,
) -> int:
    """The client's side: send the request and stdin, hand output to `on_output`, return the
    exit code."""
    await ws.send_message(models.dumps(request).decode())
    code: int | None = None
    async with trio.open_nursery() as nursery:

        async def send_stdin() -> None:
            if stdin is not None:
                async for data in stdin:
                    if data:
                        await ws.send_message(frame(STDIN, data))
            await ws.send_message(frame(STDIN, b""))

        async def send_resizes() -> None:
            assert resizes is not None
            async for resize in resizes:
                await ws.send_message(models.dumps(resize).decode())

        nursery.start_soon(_quietly, send_stdin)
        if resizes is not None:
            nursery.start_soon(_quietly, send_resizes)
        try:
            while code is None:
                message = await ws.receive_message()
                if isinstance(message, bytes):
                    channel, data = unframe(message)
                    await on_output(channel, data)
                    continue
                parsed = _parse_final(message)
                if isinstance(parsed, ApiError):
                    raise parsed
                code = parsed
        except WebSocketClosed as exc:
            raise ApiError(
                ErrorCode.UNAVAILABLE, f"exec ended without an exit code ({exc})"
            ) from None
        finally:
            nursery.cancel_scope.cancel()
    return code


def _parse_final(message: str) -> int | ApiError:
    try:
        return models.loads(message.encode(), ExecExit).exit_code
    except ApiError:
        body = models.loads(message.encode(), models.ErrorBody)
        return ApiError(ErrorCode[body.code], body.message, field=body.field)


async def _quietly(fn: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(WebSocketClosed, trio.BrokenResourceError, trio.ClosedResourceError):
        await fn()


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
