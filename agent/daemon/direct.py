"""Direct mode: a TLS listener on the node's address with a certificate made at start, whose
fingerprint the controlplane pins.
"""

from __future__ import annotations

import logging

import trio

from agent.daemon.config import AgentConfig
from agent.wire.connection import Http2Connection
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
            log.warning("TLS handshake from %s failed: %s", peer, exc)
            await tls.aclose()
            return
        if tls.selected_alpn_protocol() != "h2":
            log.warning("connection from %s did not negotiate h2; closing", peer)
            await tls.aclose()
            return
        conn = Http2Connection(
            tls, client_side=False, settings=config.http2, handler=service, name=peer
        )
        await conn.run()
        if conn.close_reason and "peer closed" not in conn.close_reason:
            log.info("connection from %s closed: %s", peer, conn.close_reason)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(port)


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "unknown peer"
