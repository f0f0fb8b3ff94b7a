"""One hop between replicas: a request for a worker whose tunnel is on another replica.

The sending replica keeps one HTTP/2 connection to each peer it needs (`Peers`), dialed over
TLS with the peer's certificate pinned to the fingerprint it published in the directory, and
sends the worker's requests on it unchanged except for two headers: the bearer is the replica
secret (`config.replication.secret`), and `levers9-worker` names the worker. The owning replica
(`relay`) checks the secret, swaps in the worker's own token, opens the same request on the
worker's connection (its tunnel, or its direct connection) and copies both ways: request body,
response head, response body and trailers, resets. Every kind of call rides this one path,
plain CONNECT (ports, endpoints) and extended CONNECT (exec) included, with HTTP/2 flow control
end to end, since each side reads only as fast as the other side takes.

A forwarded request is never forwarded again: the owner serves it from its own connection to
the worker or answers UNAVAILABLE, and the sender looks the owner up again.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import h2.errors
import trio

from control.workers.directory import OwnerAddress
from wire.connection import (
    ConnectionLost,
    H2Stream,
    Headers,
    Http2Connection,
    KeepaliveConfig,
    StreamError,
    StreamReset,
)
from wire.errors import ApiError, ErrorCode, dumps
from wire.http2 import Http2Settings
from wire.tls import PinMismatchError, TLSStream, pinned_client_context
from wire.untrusted import clip
from workerapi.client import WorkerClient

__all__ = [
    "WORKER_HEADER",
    "Peers",
    "dial_pinned",
    "is_forwarded",
    "open_peers",
    "refuse",
    "relay",
    "replica_secret_matches",
    "serve_forwarded",
]

log = logging.getLogger("levers9.replicas")

WORKER_HEADER = b"levers9-worker"
"""Names the worker a forwarded request is for."""
RELAY_CHUNK_BYTES = 256 * 1024


async def dial_pinned(address: str, fingerprint: str, where: str, source: str) -> TLSStream:
    """TLS to `address` (HOST:PORT) offering h2, the peer's certificate pinned to
    `fingerprint`; every failure an UNAVAILABLE naming `where` (a direct worker, another
    replica), whose certificate `source` says how we learnt ("registered", "published")."""
    host, _, port = address.rpartition(":")
    try:
        tcp = await trio.open_tcp_stream(host.strip("[]"), int(port))
    except OSError as exc:
        raise ApiError(
            ErrorCode.UNAVAILABLE, f"{where} is unreachable: {exc.strerror or exc}"
        ) from None
    tls = TLSStream(
        tcp,
        pinned_client_context(alpn=("h2",)),
        server_side=False,
        expected_fingerprint=fingerprint,
    )
    try:
        await tls.do_handshake()
    except PinMismatchError:
        await tls.aclose()
        raise ApiError(
            ErrorCode.UNAVAILABLE,
            f"{where} presented a certificate other than the one it {source}; refusing to "
            "talk to it",
        ) from None
    except trio.BrokenResourceError as exc:
        await tls.aclose()
        raise ApiError(ErrorCode.UNAVAILABLE, f"TLS with {where} failed: {exc}") from None
    return tls


def is_forwarded(headers: Headers) -> bytes | None:
    """The worker a forwarded request is for, or None for any other request."""
    for key, value in headers:
        if key == WORKER_HEADER:
            return value
    return None


def replica_secret_matches(headers: Headers, secret: str | None) -> bool:
    """Constant time; never true without a configured secret."""
    given = b""
    for key, value in headers:
        if key == b"authorization":
            given = value
    expected = f"Bearer {secret or ''}".encode()
    return secret is not None and hmac.compare_digest(given, expected)


def outbound_headers(headers: Headers, token: str) -> Headers:
    """The request as the worker gets it: its own token, no forwarding header."""
    kept = [(k, v) for k, v in headers if k not in (b"authorization", WORKER_HEADER)]
    return [*kept, (b"authorization", f"Bearer {token}".encode())]


LocalWorker = Callable[[str], Awaitable[tuple[WorkerClient, str]]]
"""worker id → this replica's own client for it and the worker's token (ApiError if none)."""


async def serve_forwarded(
    stream: H2Stream, worker_id: str, secret: str | None, local: LocalWorker
) -> None:
    """A request another replica forwarded: the replica secret checked, then relayed on this
    replica's own connection to the worker, never forwarded again."""
    if not replica_secret_matches(stream.headers or [], secret):
        log.warning(
            "a forwarded request for worker %s was refused: wrong replica secret",
            clip(worker_id),
            extra={"worker": clip(worker_id)},
        )
        await refuse(stream, ApiError(ErrorCode.UNAUTHENTICATED, "wrong replica secret"))
        return
    try:
        client, token = await local(worker_id)
        await relay(stream, client, token)
    except ApiError as exc:
        await refuse(stream, exc)


async def relay(inbound: H2Stream, worker: WorkerClient, token: str) -> None:
    """Serve a forwarded stream from the worker's connection; resets follow resets."""
    assert inbound.headers is not None
    # A request without a body (most: GETs, HEADs) ends with its headers, as it came.
    bodiless = inbound.ended
    try:
        outbound = await worker.conn.open_stream(
            outbound_headers(inbound.headers, token), end_stream=bodiless
        )
    except StreamError as exc:
        raise ApiError(
            ErrorCode.UNAVAILABLE, f"worker {worker.authority} unreachable from its owner: {exc}"
        ) from None
    try:
        async with trio.open_nursery() as nursery:
            if not bodiless:
                nursery.start_soon(_request_body, inbound, outbound, nursery.cancel_scope)
            nursery.start_soon(_pass_reset, inbound, outbound, nursery.cancel_scope)
            await _response(outbound, inbound)
            if not _is_connect(inbound.headers):
                # The answer is complete: a request body still coming is not wanted, and a
                # reset now changes nothing. (A CONNECT stream's other direction goes on
                # until it ends too: a byte stream may be half-closed.)
                nursery.cancel_scope.cancel()
    except* StreamError as group:
        # The worker's side broke (its tunnel cut, the stream reset): so does the client's,
        # with the same code, as a direct request's would.
        first = group.exceptions[0]
        code = first.error_code if isinstance(first, StreamReset) else h2.errors.ErrorCodes.CANCEL
        with contextlib.suppress(StreamError, trio.BrokenResourceError):
            await inbound.reset(code)
        with contextlib.suppress(StreamError, trio.BrokenResourceError):
            await outbound.reset(code)
    finally:
        worker.conn.forget(outbound)


async def _request_body(src: H2Stream, dst: H2Stream, scope: trio.CancelScope) -> None:
    try:
        while data := await src.receive_some(RELAY_CHUNK_BYTES):
            await dst.send_data(data)
        await dst.end()
    except (StreamError, trio.ClosedResourceError):
        # The client gave up (a reset): so does the worker's side.
        with contextlib.suppress(StreamError, trio.BrokenResourceError):
            await dst.reset(h2.errors.ErrorCodes.CANCEL)
        scope.cancel()


def _is_connect(headers: Headers) -> bool:
    return any(key == b":method" and value == b"CONNECT" for key, value in headers)


async def _pass_reset(inbound: H2Stream, outbound: H2Stream, scope: trio.CancelScope) -> None:
    """The client reset its stream (it gave up, say on a log follow): so does the worker's."""
    failure = await inbound.wait_failed()
    code = failure.error_code if isinstance(failure, StreamReset) else h2.errors.ErrorCodes.CANCEL
    with contextlib.suppress(StreamError, trio.BrokenResourceError):
        await outbound.reset(code)
    scope.cancel()


async def _response(src: H2Stream, dst: H2Stream) -> None:
    head = await src.wait_headers()
    await dst.send_headers(list(head))
    while data := await src.receive_some(RELAY_CHUNK_BYTES):
        await dst.send_data(data)
    if src.trailers is not None:
        await dst.send_trailers(list(src.trailers))
    else:
        await dst.end()


async def refuse(stream: H2Stream, exc: ApiError) -> None:
    """Answer a forwarded request with an error, as the worker API would."""
    body = dumps(exc.to_body())
    with contextlib.suppress(StreamError, trio.BrokenResourceError):
        await stream.send_headers(
            [
                (b":status", str(exc.code.status).encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
        )
        await stream.send_data(body, end_stream=True)


@asynccontextmanager
async def open_peers(
    secret: str,
    *,
    settings: Http2Settings | None = None,
    keepalive: KeepaliveConfig | None = None,
) -> AsyncIterator[Peers]:
    """`Peers` whose connections run in a nursery of its own, closed as the block ends."""
    async with trio.open_nursery() as nursery:
        yield Peers(nursery, secret, settings=settings, keepalive=keepalive)
        nursery.cancel_scope.cancel()


class Peers:
    """One connection to each other replica this one forwards to, dialed when first needed
    and again once it broke. Opened by `open_peers`, which runs those connections."""

    def __init__(
        self,
        nursery: trio.Nursery,
        secret: str,
        *,
        settings: Http2Settings | None = None,
        keepalive: KeepaliveConfig | None = None,
    ) -> None:
        self._nursery = nursery
        self._secret = secret
        self._settings = settings
        self._keepalive = keepalive
        self._conns: dict[str, tuple[OwnerAddress, Http2Connection]] = {}
        self._locks: dict[str, trio.Lock] = {}

    def client(self, owner: OwnerAddress, conn: Http2Connection, worker_id: str) -> WorkerClient:
        return WorkerClient(
            conn,
            token=self._secret,
            authority=worker_id,
            extra_headers=[(WORKER_HEADER, worker_id.encode())],
        )

    async def client_for(self, owner: OwnerAddress, worker_id: str) -> WorkerClient:
        """A client for `worker_id` whose requests go to `owner`, which forwards them."""
        return self.client(owner, await self._connection(owner), worker_id)

    async def _connection(self, owner: OwnerAddress) -> Http2Connection:
        lock = self._locks.setdefault(owner.replica, trio.Lock())
        async with lock:
            known = self._conns.get(owner.replica)
            if known is not None and known[0] == owner and known[1].usable:
                return known[1]
            if known is not None:
                self._nursery.start_soon(known[1].aclose)
            conn = await self._dial(owner)
            self._conns[owner.replica] = (owner, conn)
            return conn

    async def _dial(self, owner: OwnerAddress) -> Http2Connection:
        where = f"replica {owner.replica} at {owner.address}"
        tls = await dial_pinned(owner.address, owner.fingerprint, where, "published")
        conn = Http2Connection(
            tls,
            client_side=True,
            settings=self._settings,
            keepalive=self._keepalive,
            name=f"peer {owner.replica}",
        )
        try:
            await self._nursery.start(conn.run)
        except ConnectionLost as exc:
            raise ApiError(ErrorCode.UNAVAILABLE, f"{where} closed at once: {exc}") from None
        log.info("connected to %s", where, extra={"replica": owner.replica})
        return conn

    async def forget(self, replica: str) -> None:
        known = self._conns.pop(replica, None)
        if known is not None:
            await known[1].aclose()

    async def aclose(self) -> None:
        for _, conn in list(self._conns.values()):
            await conn.aclose()
        self._conns.clear()
