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
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from wire.errors import ApiError, ErrorBody, ErrorCode, dumps, loads
from wire.h2websocket import H2WebSocket, WebSocketClosed
from workerapi.models import ExecExit, ExecRequest, ExecResize

if TYPE_CHECKING:
    pass


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
    request = loads(message.encode(), ExecRequest)
    if not request.command:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, "command must not be empty", field="command")
    return request


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
    await ws.send_message(dumps(request).decode())
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
                await ws.send_message(dumps(resize).decode())

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
        return loads(message.encode(), ExecExit).exit_code
    except ApiError:
        body = loads(message.encode(), ErrorBody)
        return ApiError(ErrorCode[body.code], body.message, field=body.field)


async def _quietly(fn: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(WebSocketClosed, trio.BrokenResourceError, trio.ClosedResourceError):
        await fn()
