"""The worker API's object routes: HEAD, GET and PUT of `/v1/objects/{digest}`.

They expose the node's object store (`agent.store.objects`) so the controlplane can copy objects
between workers (a snapshot made on one, started from on another) and check what a worker
holds. Bodies stream both ways in the store's chunks; nothing holds a whole object in memory.

A download is only as good as its end: the store hashes an object while it streams it and
holds its last chunk back until the digest checks out. A corrupt object therefore never
reaches its end: the route's stream fails, the service leaves the HTTP/2 stream unfinished,
and the connection resets it (INTERNAL_ERROR), so the client sees an error, never a complete
wrong body. A body longer or shorter than the `content-length` sent is refused the same
way, since the peer's HTTP/2 layer would otherwise fail the whole connection over it.

HEAD answers carry no body, errors included (a body would break the peer's HTTP/2 framing);
the status says what happened.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from agent.store.objects import ObjectStore
from wire.errors import ApiError, ErrorCode
from wire.service import JsonResponse, Request, Router, StreamResponse
from workerapi.digests import StoredObject, parse_digest

OBJECT_CONTENT_TYPE = "application/octet-stream"
READ_CHUNK_BYTES = 1024 * 1024
"""The chunks a download is sent in: the worker API's largest HTTP/2 frame."""


def add_object_routes(router: Router, store: ObjectStore) -> None:
    """Register HEAD, GET and PUT `/v1/objects/{digest}` on `router`, served from `store`."""

    async def head_object(request: Request) -> StreamResponse:
        try:
            digest = parse_digest(request.params["digest"])
        except ApiError as exc:
            return _bodiless(exc.code.status)
        size = store.size_of(digest)
        if size is None:
            return _bodiless(ErrorCode.NOT_FOUND.status)
        return _bodiless(200, content_length=size)

    async def get_object(request: Request) -> StreamResponse:
        digest = parse_digest(request.params["digest"])
        size = store.size_of(digest)
        if size is None:
            raise _not_found(digest)

        async def chunks() -> AsyncGenerator[bytes, None]:
            sent = 0
            async for chunk in store.read(digest, chunk_bytes=READ_CHUNK_BYTES):
                sent += len(chunk)
                if sent > size:
                    raise _changed(digest)
                yield chunk
            if sent != size:
                raise _changed(digest)

        return StreamResponse(
            chunks,
            content_type=OBJECT_CONTENT_TYPE,
            headers=[("content-length", str(size))],
        )

    async def put_object(request: Request) -> JsonResponse:
        digest = parse_digest(request.params["digest"])
        size = _content_length(request)
        known = store.size_of(digest)
        if known is not None and (size is None or size == known):
            # Already here: the body is not read (the service refuses the rest of it).
            store.touch(digest)
            return JsonResponse(StoredObject(digest, known), status=200)

        async def body() -> AsyncGenerator[bytes, None]:
            while chunk := await request.stream.receive_some():
                yield chunk

        stored = await store.ingest(body(), digest=digest, size=size)
        return JsonResponse(stored, status=201)

    router.add("HEAD", "/v1/objects/{digest}", head_object)
    router.add("GET", "/v1/objects/{digest}", get_object)
    router.add("PUT", "/v1/objects/{digest}", put_object)


def _bodiless(status: int, *, content_length: int | None = None) -> StreamResponse:
    async def nothing() -> AsyncGenerator[bytes, None]:
        return
        yield b""  # pragma: no cover - makes this an async generator

    headers = [] if content_length is None else [("content-length", str(content_length))]
    return StreamResponse(nothing, content_type=OBJECT_CONTENT_TYPE, status=status, headers=headers)


def _content_length(request: Request) -> int | None:
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    if not raw.isdigit():
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"content-length must be a whole number of bytes, not {raw[:40]!r}",
            field="content-length",
        )
    return int(raw)


def _not_found(digest: str) -> ApiError:
    return ApiError(
        ErrorCode.NOT_FOUND,
        f"object {digest} is not on this worker; PUT it to /v1/objects/{digest} first",
        field="digest",
    )


def _changed(digest: str) -> ApiError:
    return ApiError(
        ErrorCode.INTERNAL,
        f"object {digest} changed size while it was being sent; fetch it again",
        field="digest",
    )


__all__ = ["add_object_routes"]
