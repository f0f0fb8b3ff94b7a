"""Direct mode: a TLS listener on the node's address with a certificate made at start, whose
fingerprint the controlplane pins.
"""

from __future__ import annotations

import contextlib
import logging

import trio

from agent.daemon.config import AgentConfig
from agent.wire.connection import ConnectionLost, Http2Connection
from agent.wire.service import Service
from agent.wire.tls import (
    CertKey,
    TLSStream,
    server_context,
)

log = logging.getLogger("levers9.agent")


async def serve_direct(
    config: AgentConfig,
    service: Service,
    cert_key: CertKey,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """TLS listener; every accepted connection is one HTTP/2 connection to the service."""
    context = server_context(cert_key, alpn=("h2",))
    listeners = await trio.open_tcp_listeners(config.listen_port, host=config.listen_host)
    port = int(listeners[0].socket.getsockname()[1])

    async def handle(tcp: trio.SocketStream) -> None:
        peer = _peer(tcp)
        tls = TLSStream(tcp, context, server_side=True)
        try:
            with trio.fail_after(config.handshake_timeout_s):
                await tls.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
            log.warning(
                "TLS handshake from %s failed: %s",
                peer,
                reason,
                extra={"worker": config.worker_id, "peer": peer, "reason": reason},
            )
            await tls.aclose()
            return
        if tls.selected_alpn_protocol() != "h2":
            log.warning(
                "connection from %s did not negotiate h2; closing",
                peer,
                extra={"worker": config.worker_id, "peer": peer},
            )
            await tls.aclose()
            return
        conn = Http2Connection(
            tls, client_side=False, settings=config.http2, handler=service, name=peer
        )
        with contextlib.suppress(ConnectionLost):
            # Gone before it was ready (reset right after the handshake): nothing to serve.
            await conn.run()
        if conn.close_reason and not conn.closed_by_peer:
            log.info(
                "connection from %s closed: %s",
                peer,
                conn.close_reason,
                extra={"worker": config.worker_id, "peer": peer, "reason": conn.close_reason},
            )

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(port)


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "unknown peer"
