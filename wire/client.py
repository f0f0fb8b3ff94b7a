"""`ApiClient`: JSON and streaming calls to one HTTP/2 API over any trio Stream.

Both programs use it: the controlplane's CLI client and the worker client build on it. A
broken connection becomes `WorkerUnavailable`, which says whether the request is known not to
have run.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import h2.errors
import trio

from wire.connection import (
    ConnectionLost,
    H2ByteStream,
    H2Stream,
    Headers,
    Http2Connection,
    KeepaliveConfig,
    StreamError,
    StreamRefused,
    StreamReset,
    header_value,
    open_http2_connection,
)
from wire.errors import ApiError, ErrorBody, ErrorCode, dumps, loads, structure
from wire.http2 import Http2Settings

if TYPE_CHECKING:
    from wire.h2websocket import H2WebSocket

T = TypeVar("T")
MAX_RESPONSE_BYTES = 64 * 1024 * 1024


class WorkerUnavailable(ApiError):
    """The worker could not be reached or the connection broke; `retryable` says whether the
    request is known not to have run (safe to send again, e.g. on the next tunnel)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)
        self.retryable = retryable


class Response:
    """A response whose body is read as it arrives."""

    def __init__(self, client: ApiClient, stream: H2Stream, headers: Headers) -> None:
        self._client = client
        self.stream = stream
        self.status = int((header_value(headers, b":status") or b"0").decode())
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}

    async def read(self, limit_bytes: int = MAX_RESPONSE_BYTES) -> bytes:
        try:
            return await self.stream.read_all(limit_bytes)
        except StreamError as exc:
            raise self._client._unavailable(exc) from None

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await self.stream.receive_some():
                yield chunk
        except StreamError as exc:
            raise self._client._unavailable(exc) from None

    async def raise_for_status(self) -> None:
        if self.status < 400:
            return
        body = await self.read(1024 * 1024)
        raise error_from_body(self.status, body)

    async def aclose(self) -> None:
        if not self.stream.ended:
            await self.stream.reset(h2.errors.ErrorCodes.CANCEL)
        self._client.conn.forget(self.stream)


def error_from_body(status: int, body: bytes) -> ApiError:
    """Rebuild the server's ApiError from its JSON error body."""
    try:
        data = json.loads(body)
        err = structure(data, ErrorBody)
        code = ErrorCode[err.code]
        return ApiError(code, err.message, field=err.field)
    except (ValueError, KeyError, ApiError):
        return ApiError(ErrorCode.from_status(status), f"HTTP {status}: {body[:200]!r}")


class OpeningStream(H2ByteStream):
    """A CONNECT stream before its answer (`ApiClient.connect_early`): sends go out at once,
    receives wait for the answer, and a refusal breaks the stream."""

    def __init__(self, stream: H2Stream, client: ApiClient) -> None:
        super().__init__(stream)
        self._client = client
        self._answered = False
        self._refusal: ApiError | None = None
        self._answer_lock = trio.Lock()

    async def wait_open(self) -> None:
        """Return once the server has connected; raise its refusal (an `ApiError`) if it did
        not. Bytes already sent on a refused stream were discarded by the server."""
        async with self._answer_lock:
            if not self._answered:
                try:
                    await self._client._tunnel_answer(self.stream)
                except ApiError as exc:
                    self._refusal = exc
                self._answered = True
        if self._refusal is not None:
            raise self._refusal

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._answered:
            try:
                await self.wait_open()
            except ApiError as exc:
                raise trio.BrokenResourceError(f"the CONNECT was refused: {exc}") from exc
        return await super().receive_some(max_bytes)


class ApiClient:
    """JSON and streaming calls to one HTTP/2 API (a worker's, or the controlplane's)."""

    peer: ClassVar[str] = "server"
    """What the far end is, as an error names it: a subclass for one program names it
    ("worker"), so that no message calls the controlplane a worker."""

    def __init__(
        self,
        conn: Http2Connection,
        *,
        token: str,
        authority: str,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self.conn = conn
        self._token = token
        self.authority = authority
        self._extra = list(extra_headers)
        """Sent with every request (a replica forwarding to another names the worker so)."""

    def _credentials(self) -> Headers:
        return [(b"authorization", f"Bearer {self._token}".encode()), *self._extra]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(authority={self.authority!r}, usable={self.conn.usable})"

    def _unavailable(self, exc: BaseException) -> WorkerUnavailable:
        return WorkerUnavailable(
            f"{self.peer} {self.authority} unreachable: {exc}",
            retryable=isinstance(exc, StreamRefused),
        )

    def _base_headers(self, method: str, path: str) -> Headers:
        return [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self.authority.encode()),
            (b":path", path.encode()),
            *self._credentials(),
        ]

    async def open(
        self, method: str, path: str, body: bytes | None = None, *, content_type: str = ""
    ) -> Response:
        """Send a request and wait for the response headers; the body is read by the caller."""
        headers = self._base_headers(method, path)
        if content_type:
            headers.append((b"content-type", content_type.encode()))
        if body is not None:
            headers.append((b"content-length", str(len(body)).encode()))
        try:
            stream = await self.conn.open_stream(headers, end_stream=not body)
            if body:
                try:
                    await stream.send_data(body, end_stream=True)
                except StreamReset as exc:
                    # A server may answer before reading the whole body and then reset with
                    # NO_ERROR (RFC 9113 8.1): its answer stands.
                    if exc.error_code != h2.errors.ErrorCodes.NO_ERROR or stream.headers is None:
                        raise
            response_headers = await stream.wait_headers()
        except StreamError as exc:
            raise self._unavailable(exc) from None
        return Response(self, stream, response_headers)

    @asynccontextmanager
    async def stream(
        self, method: str, path: str, body: bytes | None = None
    ) -> AsyncIterator[Response]:
        """A streamed response (logs, downloads); the stream is cancelled if left early."""
        response = await self.open(method, path, body)
        try:
            await response.raise_for_status()
            yield response
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()

    async def call(
        self, method: str, path: str, body: Any = None, response_type: type[T] | None = None
    ) -> T | None:
        """A JSON request; returns `response_type` structured, raises ApiError on errors."""
        payload = dumps(body) if body is not None else None
        response = await self.open(
            method, path, payload, content_type="application/json" if payload else ""
        )
        try:
            data = await response.read()
        finally:
            response.stream._conn.forget(response.stream)
        if response.status >= 400:
            raise error_from_body(response.status, data)
        if response_type is None:
            return None
        return loads(data, response_type)

    async def ping(self) -> float:
        try:
            return await self.conn.ping()
        except ConnectionLost as exc:
            raise self._unavailable(exc) from None

    async def connect(self, authority: str, *, first: bytes = b"") -> H2ByteStream:
        """A plain CONNECT to `authority`: a two-way byte stream (RFC 9113 8.5). `first`: bytes
        to send at once, in the same write as the request (an HTTP request's head), instead
        of a round trip later; the server passes them on only once it has connected, and a
        refusal discards them, so a refused CONNECT may be tried again with the same."""
        return await self._open_tunnel(self._connect_headers(authority), first)

    async def connect_early(self, authority: str) -> OpeningStream:
        """A plain CONNECT to `authority` that is usable before the server answers: bytes sent
        on it go out at once (the server passes them on once it has connected, or discards
        them with its refusal), and what comes back is read once the answer is in. Saves a
        round trip for every client that speaks first. `OpeningStream.wait_open` gives the
        answer, the server's refusal raised as its own error."""
        try:
            stream = await self.conn.open_stream(self._connect_headers(authority))
        except StreamError as exc:
            raise self._unavailable(exc) from None
        return OpeningStream(stream, self)

    def _connect_headers(self, authority: str) -> Headers:
        return [
            (b":method", b"CONNECT"),
            (b":authority", authority.encode()),
            *self._credentials(),
        ]

    async def open_websocket(self, path: str) -> H2WebSocket:
        """A WebSocket to a route over RFC 8441 extended CONNECT (exec uses it)."""
        headers: Headers = [
            (b":method", b"CONNECT"),
            (b":protocol", b"websocket"),
            (b":scheme", b"https"),
            (b":path", path.encode()),
            (b":authority", self.authority.encode()),
            *self._credentials(),
            (b"sec-websocket-version", b"13"),
        ]
        from wire.h2websocket import H2WebSocket  # wsproto, for exec only

        return H2WebSocket(await self._open_tunnel(headers), client_side=True)

    async def _open_tunnel(self, headers: Headers, first: bytes = b"") -> H2ByteStream:
        try:
            stream = await self.conn.open_stream(headers, flush=not first)
            if first:
                await stream.send_data(first)
        except StreamError as exc:
            raise self._unavailable(exc) from None
        await self._tunnel_answer(stream)
        return H2ByteStream(stream)

    async def _tunnel_answer(self, stream: H2Stream) -> None:
        """Wait for a CONNECT's answer; anything but 200 is raised as the server's error."""
        try:
            response_headers = await stream.wait_headers()
        except StreamError as exc:
            raise self._unavailable(exc) from None
        status = int((header_value(response_headers, b":status") or b"0").decode())
        if status != 200:
            try:
                body = await stream.read_all(1024 * 1024)
            except StreamError:
                body = b""
            self.conn.forget(stream)
            raise error_from_body(status, body)

    async def ndjson(self, path: str, cls: type[T]) -> AsyncGenerator[T, None]:
        """A streamed GET of newline-delimited JSON, one `cls` per line as it arrives."""
        async with self.stream("GET", path) as response:
            pending = b""
            async for chunk in response.iter_chunks():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield loads(line, cls)
            if pending.strip():
                yield loads(pending, cls)

    async def _typed(self, method: str, path: str, body: Any, cls: type[T]) -> T:
        result = await self.call(method, path, body, cls)
        assert result is not None
        return result

    async def aclose(self) -> None:
        await self.conn.aclose()


C = TypeVar("C", bound=ApiClient)


@asynccontextmanager
async def open_api_client(
    transport: trio.abc.Stream,
    client_class: type[C],
    *,
    token: str,
    authority: str,
    settings: Http2Settings | None = None,
    keepalive: KeepaliveConfig | None = None,
) -> AsyncIterator[C]:
    """Run an HTTP/2 client connection over `transport` for the body of the `async with`.

    A connection that ends before it is ready raises `ConnectionLost` itself, not inside an
    ExceptionGroup of this function's nursery, so callers retry it as they would any other."""
    async with open_http2_connection(
        transport, client_side=True, settings=settings, keepalive=keepalive, name=authority
    ) as conn:
        yield client_class(conn, token=token, authority=authority)
