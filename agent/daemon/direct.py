"""Direct mode: a TLS listener on the node's address with a certificate made at start, whose
fingerprint the controlplane pins.

Every accepted connection is first counted against `config.connections` (per source address
and in total) and closed at once, before any TLS, when over a limit; an admitted one has
`handshake_timeout_s` for TLS and `first_request_timeout_s` for its first request.
"""

from __future__ import annotations

import contextlib
import logging

import trio

from agent.daemon.config import AgentConfig
from wire.admission import Admissions, ConnectionLog, Refusal, source_address
from wire.connection import ConnectionLost, Http2Connection
from wire.service import Service
from wire.tls import (
    CertKey,
    TLSStream,
    server_context,
)
from wire.untrusted import clip

log = logging.getLogger("levers9.agent")


async def serve_direct(
    config: AgentConfig,
    service: Service,
    cert_key: CertKey,
    *,
    admissions: Admissions | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """TLS listener; every accepted connection is one HTTP/2 connection to the service.
    `admissions` counts the open connections (one made from `config.connections` if None)."""
    limits = config.connections
    gate = Admissions(limits) if admissions is None else admissions
    fields: dict[str, object] = {"worker": config.worker_id, "node": config.node}
    early = ConnectionLog(fields)
    context = server_context(cert_key, alpn=("h2",))
    listeners = await trio.open_tcp_listeners(config.listen_port, host=config.listen_host)
    port = int(listeners[0].socket.getsockname()[1])

    async def handle(tcp: trio.SocketStream) -> None:
        # Nothing awaits before the decision: a refused connection costs an accept and a close.
        source = _source(tcp)
        admission = gate.admit(source)
        if isinstance(admission, Refusal):
            early.refused(admission, trio.current_time())
            await tcp.aclose()
            return
        try:
            await serve_one(tcp, source)
        finally:
            gate.release(admission)

    async def serve_one(tcp: trio.SocketStream, source: str) -> None:
        peer = _peer(tcp)
        tls = TLSStream(tcp, context, server_side=True)
        try:
            with trio.fail_after(limits.handshake_timeout_s):
                await tls.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
            early.failed(peer, source, f"TLS handshake failed: {reason}", trio.current_time())
            await tls.aclose()
            return
        if tls.selected_alpn_protocol() != "h2":
            early.failed(peer, source, "it did not negotiate h2", trio.current_time())
            await tls.aclose()
            return
        conn = Http2Connection(
            tls,
            client_side=False,
            settings=config.http2,
            handler=service,
            name=peer,
            first_request_timeout_s=limits.first_request_timeout_s,
            idle_timeout_s=limits.idle_timeout_s,
        )
        with contextlib.suppress(ConnectionLost):
            # Gone before it was ready (reset right after the handshake): nothing to serve.
            await conn.run()
        if not conn.close_reason or conn.closed_by_peer:
            return
        if conn.statistics().streams_opened == 0:
            early.failed(peer, source, conn.close_reason, trio.current_time())
            return
        reason = clip(conn.close_reason)  # it may quote what the peer sent
        log.info(
            "connection from %s closed: %s",
            peer,
            reason,
            extra={**fields, "peer": peer, "reason": reason},
        )

    async with trio.open_nursery() as nursery:
        # serve_listeners runs each connection in a task of its own, so the accept loop never
        # waits on a handshake; on EMFILE it logs, sleeps and accepts again.
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(port)


def _source(stream: trio.SocketStream) -> str:
    try:
        return source_address(stream.socket.getpeername())
    except OSError:
        return "unknown"


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "unknown peer"
