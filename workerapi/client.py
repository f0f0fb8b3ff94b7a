"""The client the controlplane uses to call one worker's API, over any trio Stream.

One `WorkerClient` per worker connection. It knows nothing of how the connection came to be:
the controlplane dials the worker (direct mode, TLS with the worker's certificate pinned) or
accepts the worker's tunnel and runs HTTP/2 inside it with the roles reversed; either way
it hands a stream to `open_worker_client`. Typed methods return the models of `workerapi.models`;
every failure is an `ApiError` with a stable code (UNAVAILABLE when the worker can't be
reached, so callers can retry elsewhere).
"""

from __future__ import annotations

import contextlib
import hashlib
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

import h2.errors
import trio

from wire.client import (
    ApiClient,
    OpeningStream,
    Response,
    WorkerUnavailable,
    error_from_body,
    open_api_client,
)
from wire.connection import (
    H2ByteStream,
    H2Stream,
    KeepaliveConfig,
    StreamError,
    StreamReset,
)
from wire.errors import ApiError, ErrorCode, loads
from wire.http2 import Http2Settings
from workerapi.digests import DIGEST_PREFIX, DigestMismatch, StoredObject, parse_digest
from workerapi.models import (
    ContainerList,
    ContainerSpec,
    ContainerStatus,
    Health,
    LogLine,
    SnapshotInfo,
    StopRequest,
    WorkerInfo,
)

if TYPE_CHECKING:
    from wire.h2websocket import H2WebSocket  # wsproto, loaded for exec only


class ObjectSink(Protocol):
    """Where `fetch_object` puts what it fetched: a local object store (`agent.store`), which
    verifies the content against its digest."""

    async def ingest(
        self, chunks: AsyncIterable[bytes], *, digest: str | None = None
    ) -> StoredObject: ...


class WorkerClient(ApiClient):
    """Typed calls to one worker's API."""

    peer = "worker"

    async def health(self) -> Health:
        result = await self.call("GET", "/v1/health", response_type=Health)
        assert result is not None
        return result

    async def worker(self) -> WorkerInfo:
        result = await self.call("GET", "/v1/worker", response_type=WorkerInfo)
        assert result is not None
        return result

    async def connect_tcp(self, host: str, port: int, *, first: bytes = b"") -> H2ByteStream:
        """A byte stream to `host:port` on the worker's side (endpoint and box-port traffic);
        `first` goes with the CONNECT (`ApiClient.connect`)."""
        return await self.connect(_authority(host, port), first=first)

    async def connect_tcp_early(self, host: str, port: int) -> OpeningStream:
        """`connect_tcp`, usable before the worker has connected (`ApiClient.connect_early`):
        a forwarded connection's first bytes need not wait for that round trip."""
        return await self.connect_early(_authority(host, port))

    # -- objects (the worker's node-local store, agent.store.objects) --

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

    async def fetch_object(self, digest: str, store: ObjectSink) -> StoredObject:
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
        return loads(body, StoredObject)

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

    async def open_exec(self, container_id: str) -> H2WebSocket:
        """The container's exec WebSocket, opened: the caller speaks `workerapi.exec` on it
        (`run_exec`) or relays it (the controlplane's task exec), and closes it."""
        return await self.open_websocket(_container_path(container_id, "exec"))


def _object_path(digest: str) -> str:
    return f"/v1/objects/{digest}"


def _container_path(container_id: str, *rest: str) -> str:
    return "/".join(("/v1/containers", urllib.parse.quote(container_id, safe=""), *rest))


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


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
