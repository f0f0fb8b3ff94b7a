"""A worker's tunnel, as the public endpoint accepts it (ALPN `http/1.1`).

The WebSocket upgrade to `/v1/workers/<id>/tunnel` is authenticated with that worker's token
BEFORE it is accepted (401 otherwise, 404 for any other path, and no HTTP/2 is ever spoken);
then HTTP/2 runs inside the WebSocket with the controlplane as the client, and the registry
hands that client out for the worker until the tunnel closes. A tunnel is counted among the
endpoint's connections (a drain sends it a GOAWAY, and so does one that began before it
landed), and its worker is asked about itself once it landed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import trio

from control.api.workers import WORKER_CALL_TIMEOUT_S
from control.workers.registry import WorkerRegistry
from wire.admission import Admission, Admissions, ConnectionLog
from wire.connection import ConnectionLost, Http2Connection, KeepaliveConfig
from wire.errors import ApiError
from wire.http2 import Http2Settings
from wire.service import bearer_token
from wire.tls import TLSStream
from wire.untrusted import clip
from wire.wsstream import HandshakeError, UpgradeRequest, WebSocketStream, read_upgrade
from workerapi.client import WorkerClient

log = logging.getLogger("levers9.control")


class TunnelAcceptor:
    """Accepts tunnels for the workers of `registry`. The endpoint's `admissions` vouch for a
    source once its tunnel is accepted, `early` logs a connection that failed before it was
    useful, `connections` is the endpoint's set of live connections (a tunnel is in it while
    it lives) and `draining` says whether the endpoint began to drain."""

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        settings: Http2Settings,
        keepalive: KeepaliveConfig,
        first_request_timeout_s: float,
        admissions: Admissions,
        early: ConnectionLog,
        connections: set[Http2Connection],
        draining: Callable[[], bool],
    ) -> None:
        self.registry = registry
        self._settings = settings
        self._keepalive = keepalive
        self._first_request_timeout_s = first_request_timeout_s
        self._admissions = admissions
        self._early = early
        self._connections = connections
        self._draining = draining

    async def accept(self, tls: TLSStream, peer: str, admission: Admission) -> None:
        """Serve the connection `tls` (from `peer`, admitted as `admission`) as a tunnel until
        it closes; refused or closed at once when it is not one."""
        async with trio.open_nursery() as nursery:
            try:
                found = await self._upgrade(tls, peer, admission)
                if found is None:
                    return
                worker_id, token, version, ws = found
                self._admissions.vouch(admission)
                conn = Http2Connection(
                    ws,
                    client_side=True,
                    settings=self._settings,
                    keepalive=self._keepalive,
                    name=f"tunnel {worker_id}",
                )
                try:
                    await nursery.start(conn.run)
                except ConnectionLost as exc:
                    # The WebSocket closed before HTTP/2 inside it was ready: the agent retries.
                    self._failed(peer, admission, f"tunnel closed at once: {exc}")
                    return
                client = WorkerClient(conn, token=token, authority=worker_id)
                await self._serve(nursery, worker_id, client, version)
            finally:
                nursery.cancel_scope.cancel()

    async def _upgrade(
        self, tls: TLSStream, peer: str, admission: Admission
    ) -> tuple[str, str, str | None, WebSocketStream] | None:
        """The worker, its token and version, and the accepted WebSocket; None (the
        connection closed) when the upgrade is not a worker's tunnel with its token."""
        try:
            # The upgrade request is the connection's first: it comes at once or not at all.
            # Once it is in, the tunnel lives as long as its PINGs are answered.
            with trio.fail_after(self._first_request_timeout_s):
                request = await read_upgrade(tls)
        except (trio.BrokenResourceError, trio.TooSlowError, HandshakeError) as exc:
            if isinstance(exc, trio.TooSlowError):
                reason = f"no request within {self._first_request_timeout_s:g} s"
            else:
                reason = f"WebSocket handshake failed: {clip(str(exc))}"
            self._failed(peer, admission, reason)
            await tls.aclose()
            return None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        token = bearer_token(headers)
        worker_id = await self._refusal(request, token)
        if worker_id is None or token is None:
            await tls.aclose()
            return None
        try:
            ws = await request.accept()
        except trio.BrokenResourceError as exc:
            self._failed(peer, admission, f"tunnel closed while accepted: {exc}")
            return None
        return worker_id, token, headers.get("x-levers9-version"), ws

    async def _refusal(self, request: UpgradeRequest, token: str | None) -> str | None:
        """The worker whose tunnel this is; None once the upgrade was refused (404 for
        another path, 401 for a wrong or missing token)."""
        parts = request.path.split("?")[0].strip("/").split("/")
        if len(parts) != 4 or parts[:2] != ["v1", "workers"] or parts[3] != "tunnel":
            await request.reject(404, body=b"no such endpoint\n")
            return None
        worker_id = parts[2]
        if token is None or not self.registry.check_token(worker_id, token):
            log.warning(
                "tunnel for worker %s refused: wrong or missing token",
                clip(worker_id),
                extra={"worker": clip(worker_id)},
            )
            await request.reject(401, body=b"wrong or missing worker token\n")
            return None
        return worker_id

    async def _serve(
        self, nursery: trio.Nursery, worker_id: str, client: WorkerClient, version: str | None
    ) -> None:
        conn = client.conn
        # Counted before anything awaits: a drain that begins meanwhile sends it a GOAWAY.
        self._connections.add(conn)
        try:
            try:
                await self.registry.attach_tunnel(worker_id, client, version=version)
            except ApiError as exc:
                # Its claim could not be recorded (the database is away): closed, so the
                # agent opens its next tunnel, here or at another replica, in a moment.
                log.warning(
                    "tunnel of worker %s closed: %s",
                    worker_id,
                    exc.message,
                    extra={"worker": worker_id, "code": exc.code.name},
                )
                await conn.aclose()
                return
            log.info(
                "worker %s connected through its tunnel", worker_id, extra={"worker": worker_id}
            )
            if self._draining():
                nursery.start_soon(drain_quietly, conn)
            nursery.start_soon(self._learn, worker_id, client)
            await conn.wait_closed()
        finally:
            self._connections.discard(conn)
            self.registry.detach_tunnel(worker_id, client)
            log.info(
                "tunnel of worker %s closed: %s",
                worker_id,
                conn.close_reason,
                extra={"worker": worker_id, "reason": conn.close_reason or "closed"},
            )

    async def _learn(self, worker_id: str, client: WorkerClient) -> None:
        """Ask a newly tunnelled worker about itself (its cards, node, version)."""
        with trio.move_on_after(WORKER_CALL_TIMEOUT_S):
            try:
                info = await client.worker()
            except ApiError as exc:
                log.info(
                    "could not ask worker %s about itself: %s",
                    worker_id,
                    exc.message,
                    extra={"worker": worker_id, "code": exc.code.name},
                )
                return
            self.registry.learn(info)

    def _failed(self, peer: str, admission: Admission, reason: str) -> None:
        self._early.failed(peer, admission.source, reason, trio.current_time())


async def drain_quietly(conn: Http2Connection) -> None:
    """GOAWAY on `conn`, and wait for its streams to end; a connection already gone is done."""
    with contextlib.suppress(trio.BrokenResourceError, ConnectionLost):
        await conn.drain()
