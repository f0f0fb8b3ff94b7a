"""The client the controlplane uses to call one worker's API, over any trio Stream.

One `WorkerClient` per worker connection. It knows nothing of how the connection came to be:
the controlplane dials the worker (direct mode, TLS with the worker's certificate pinned) or
accepts the worker's tunnel and runs HTTP/2 inside it with the roles reversed; either way
it hands a stream to `open_worker_client`. Typed methods return the models of `agent.models`;
every failure is an `ApiError` with a stable code (UNAVAILABLE when the worker can't be
reached, so callers can retry elsewhere).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import h2.errors
import trio

from agent import models
from agent.connection import (
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
)
from agent.h2websocket import H2WebSocket
from agent.http2 import Http2Settings
from agent.models import (
    ApiError,
    ContainerList,
    ContainerSpec,
    ContainerStatus,
    ErrorCode,
    ExecRequest,
    Health,
    LogLine,
    SnapshotInfo,
    StopRequest,
    WorkerInfo,
)
from agent.objects import DIGEST_PREFIX, DigestMismatch, ObjectStore, StoredObject, parse_digest

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
        err = models.structure(data, models.ErrorBody)
        code = ErrorCode[err.code]
        return ApiError(code, err.message, field=err.field)
    except (ValueError, KeyError, ApiError):
        return ApiError(ErrorCode.from_status(status), f"HTTP {status}: {body[:200]!r}")


class ApiClient:
    """JSON and streaming calls to one HTTP/2 API (a worker's, or the controlplane's)."""

    def __init__(self, conn: Http2Connection, *, token: str, authority: str = "worker") -> None:
        self.conn = conn
        self._token = token
        self.authority = authority

    def __repr__(self) -> str:
        return f"{type(self).__name__}(authority={self.authority!r}, usable={self.conn.usable})"

    def _unavailable(self, exc: BaseException) -> WorkerUnavailable:
        return WorkerUnavailable(
            f"worker {self.authority} unreachable: {exc}",
            retryable=isinstance(exc, StreamRefused),
        )

    def _base_headers(self, method: str, path: str) -> Headers:
        return [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self.authority.encode()),
            (b":path", path.encode()),
            (b"authorization", f"Bearer {self._token}".encode()),
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
        payload = models.dumps(body) if body is not None else None
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
        return models.loads(data, response_type)

    async def ping(self) -> float:
        try:
            return await self.conn.ping()
        except ConnectionLost as exc:
            raise self._unavailable(exc) from None

    async def connect(self, authority: str) -> H2ByteStream:
        """A plain CONNECT to `authority`: a two-way byte stream (RFC 9113 8.5)."""
        headers: Headers = [
            (b":method", b"CONNECT"),
            (b":authority", authority.encode()),
            (b"authorization", f"Bearer {self._token}".encode()),
        ]
        return await self._open_tunnel(headers)

    async def open_websocket(self, path: str) -> H2WebSocket:
        """A WebSocket to a route over RFC 8441 extended CONNECT (exec uses it)."""
        headers: Headers = [
            (b":method", b"CONNECT"),
            (b":protocol", b"websocket"),
            (b":scheme", b"https"),
            (b":path", path.encode()),
            (b":authority", self.authority.encode()),
            (b"authorization", f"Bearer {self._token}".encode()),
            (b"sec-websocket-version", b"13"),
        ]
        return H2WebSocket(await self._open_tunnel(headers), client_side=True)

    async def _open_tunnel(self, headers: Headers) -> H2ByteStream:
        try:
            stream = await self.conn.open_stream(headers)
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
        return H2ByteStream(stream)

    async def ndjson(self, path: str, cls: type[T]) -> AsyncGenerator[T, None]:
        """A streamed GET of newline-delimited JSON, one `cls` per line as it arrives."""
        async with self.stream("GET", path) as response:
            pending = b""
            async for chunk in response.iter_chunks():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield models.loads(line, cls)
            if pending.strip():
                yield models.loads(pending, cls)

    async def _typed(self, method: str, path: str, body: Any, cls: type[T]) -> T:
        result = await self.call(method, path, body, cls)
        assert result is not None
        return result

    async def aclose(self) -> None:
        await self.conn.aclose()


class WorkerClient(ApiClient):
    """Typed calls to one worker's API."""

    async def health(self) -> Health:
        result = await self.call("GET", "/v1/health", response_type=Health)
        assert result is not None
        return result

    async def worker(self) -> WorkerInfo:
        result = await self.call("GET", "/v1/worker", response_type=WorkerInfo)
        assert result is not None
        return result

    async def connect_tcp(self, host: str, port: int) -> H2ByteStream:
        """A byte stream to `host:port` on the worker's side (endpoint and box-port traffic)."""
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return await self.connect(authority)

    # -- objects (the worker's node-local store, agent.objects) --

    async def has_object(self, digest: str) -> int | None:
        """The object's size if the worker holds it, else None."""
        digest = parse_digest(digest)
        response = await self.open("HEAD", _object_path(digest))
        try:
            await response.read(0)
        finally:
            self.conn.forget(response.stream)
        if response.status == 200:
            return int(response.headers.get("content-length", "0"))
        if response.status == 404:
            return None
        raise ApiError(
            ErrorCode.from_status(response.status),
            f"worker {self.authority} answered HTTP {response.status} to HEAD of object {digest}",
        )

    async def get_object(self, digest: str, *, verify: bool = True) -> AsyncGenerator[bytes, None]:
        """The object's content as it arrives. With `verify`, it is hashed on the way and the
        last chunk held back until the digest checks out (`DigestMismatch` otherwise). A
        worker that stops before the end (it found the object corrupt, or went away) raises
        `WorkerUnavailable`: treat what arrived as tentative until the iteration ends."""
        digest = parse_digest(digest)
        async with self.stream("GET", _object_path(digest)) as response:
            hasher = hashlib.sha256() if verify else None
            held = b""
            try:
                while chunk := await response.stream.receive_some():
                    if hasher is not None:
                        hasher.update(chunk)
                    if held:
                        yield held
                    held = chunk
            except StreamError as exc:
                raise WorkerUnavailable(
                    f"worker {self.authority} stopped sending object {digest} before its end "
                    f"({exc}); fetch it again",
                    retryable=False,
                ) from None
            if hasher is not None and DIGEST_PREFIX + hasher.hexdigest() != digest:
                raise DigestMismatch(digest, DIGEST_PREFIX + hasher.hexdigest())
            if held:
                yield held

    async def fetch_object(self, digest: str, store: ObjectStore) -> StoredObject:
        """Copy the object from the worker into a local store (verified there by digest);
        nothing is fetched when the store already holds it."""
        digest = parse_digest(digest)
        async with contextlib.aclosing(self.get_object(digest, verify=False)) as chunks:
            return await store.ingest(chunks, digest=digest)

    async def put_object(
        self, digest: str, chunks: AsyncIterable[bytes], *, size: int | None = None
    ) -> StoredObject:
        """Stream content to the worker's store under `digest`, which the worker verifies
        (`DigestMismatch`'s INVALID_ARGUMENT if the content does not match; nothing is kept).
        A worker that already holds the object answers before reading the rest."""
        digest = parse_digest(digest)
        headers = self._base_headers("PUT", _object_path(digest))
        headers.append((b"content-type", b"application/octet-stream"))
        if size is not None:
            headers.append((b"content-length", str(size).encode()))
        try:
            stream = await self.conn.open_stream(headers)
        except StreamError as exc:
            raise self._unavailable(exc) from None
        try:
            answered = False
            async for chunk in chunks:
                if chunk and not await self._send_body(stream, chunk):
                    answered = True
                    break
            if not answered:
                await self._send_body(stream, b"", end=True)
            try:
                response_headers = await stream.wait_headers()
            except StreamError as exc:
                raise self._unavailable(exc) from None
            response = Response(self, stream, response_headers)
            body = await response.read(1024 * 1024)
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.reset(h2.errors.ErrorCodes.CANCEL)
            raise
        finally:
            self.conn.forget(stream)
        if response.status >= 400:
            raise error_from_body(response.status, body)
        return models.loads(body, StoredObject)

    async def _send_body(self, stream: H2Stream, data: bytes, *, end: bool = False) -> bool:
        """Send request body bytes; False once the server has answered early (it then
        resets the stream with NO_ERROR, RFC 9113 8.1, and its answer stands)."""
        try:
            if end:
                await stream.end()
            else:
                await stream.send_data(data)
        except StreamReset as exc:
            if exc.error_code == h2.errors.ErrorCodes.NO_ERROR and stream.headers is not None:
                return False
            raise self._unavailable(exc) from None
        except StreamError as exc:
            raise self._unavailable(exc) from None
        return True

    # -- containers --------------------------------------------------------------------------

    async def create_container(self, spec: ContainerSpec, *, wait: bool = True) -> ContainerStatus:
        """Create a container; with `wait`, returns once it runs (or raises why it could not)."""
        path = "/v1/containers" + ("" if wait else "?wait=false")
        return await self._typed("POST", path, spec, ContainerStatus)

    async def container(self, container_id: str) -> ContainerStatus:
        return await self._typed("GET", _container_path(container_id), None, ContainerStatus)

    async def containers(self) -> tuple[ContainerStatus, ...]:
        listing = await self._typed("GET", "/v1/containers", None, ContainerList)
        return listing.containers

    async def wait_container(self, container_id: str) -> ContainerStatus:
        path = _container_path(container_id, "wait")
        return await self._typed("GET", path, None, ContainerStatus)

    async def stop_container(
        self, container_id: str, *, grace_s: float | None = None
    ) -> ContainerStatus:
        path = _container_path(container_id, "stop")
        return await self._typed("POST", path, StopRequest(grace_s=grace_s), ContainerStatus)

    async def delete_container(self, container_id: str) -> None:
        await self.call("DELETE", _container_path(container_id))

    async def snapshot_container(self, container_id: str) -> SnapshotInfo:
        path = _container_path(container_id, "snapshot")
        return await self._typed("POST", path, None, SnapshotInfo)

    async def container_logs(
        self, container_id: str, *, follow: bool = False
    ) -> AsyncGenerator[LogLine, None]:
        """The container's log lines from the start; with `follow`, until it has ended."""
        path = _container_path(container_id, "logs") + f"?follow={'true' if follow else 'false'}"
        async with contextlib.aclosing(self.ndjson(path, LogLine)) as lines:
            async for line in lines:
                yield line

    async def exec_in_container(
        self,
        container_id: str,
        request: ExecRequest,
        *,
        on_output: Callable[[int, bytes], Awaitable[None]],
        stdin: AsyncIterable[bytes] | None = None,
    ) -> int:
        """Run a process in the container; its output goes to `on_output(channel, data)`
        (1 stdout, 2 stderr); returns its exit code."""
        from agent.exec import run_exec

        ws = await self.open_websocket(_container_path(container_id, "exec"))
        try:
            return await run_exec(ws, request, stdin=stdin, on_output=on_output)
        finally:
            await ws.aclose()


def _object_path(digest: str) -> str:
    return f"/v1/objects/{digest}"


def _container_path(container_id: str, *rest: str) -> str:
    return "/".join(("/v1/containers", urllib.parse.quote(container_id, safe=""), *rest))


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
    """Run an HTTP/2 client connection over `transport` for the body of the `async with`."""
    conn = Http2Connection(
        transport, client_side=True, settings=settings, keepalive=keepalive, name=authority
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(conn.run)
        try:
            yield client_class(conn, token=token, authority=authority)
        finally:
            await conn.aclose()
            nursery.cancel_scope.cancel()


def open_worker_client(
    transport: trio.abc.Stream,
    *,
    token: str,
    authority: str = "worker",
    settings: Http2Settings | None = None,
    keepalive: KeepaliveConfig | None = None,
) -> AbstractAsyncContextManager[WorkerClient]:
    """A `WorkerClient` over `transport` for the body of the `async with`."""
    return open_api_client(
        transport,
        WorkerClient,
        token=token,
        authority=authority,
        settings=settings,
        keepalive=keepalive,
    )
