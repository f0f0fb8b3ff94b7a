"""Tunnel mode: ONE outbound WebSocket to the controlplane, the worker API served inside it
with the roles reversed, kept alive, rolled over at its maximum age and re-dialed.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

import trio

from agent.daemon.config import AgentConfig
from agent.daemon.register import (
    TUNNEL_FAILURES,
    TunnelRejected,
    failure_reason,
    open_controlplane_tls,
)
from wire.backoff import (
    Backoff,
    BackoffState,
    next_delay,
    record_connected,
    record_disconnect,
    record_failure,
)
from wire.connection import Http2Connection
from wire.errors import exception_leaves
from wire.service import Service
from wire.tls import (
    TLSStream,
)
from wire.wsstream import ConnectionRejected, HandshakeError, WebSocketStream, open_websocket
from workerapi import __version__

log = logging.getLogger("levers9.agent")


async def run_tunnel(config: AgentConfig, service: Service) -> None:
    """Keep one tunnel up forever: reconnect with backoff, roll it over at its maximum age."""
    tc = config.tunnel
    policy = Backoff(
        initial_s=tc.backoff_initial_s, cap_s=tc.backoff_cap_s, stable_s=tc.backoff_stable_s
    )
    state = BackoffState()
    fields = {"worker": config.worker_id, "controlplane": config.controlplane_url}
    async with trio.open_nursery() as nursery:
        while True:
            failure: str | None = None
            try:
                with trio.fail_after(tc.handshake_timeout_s):
                    conn: Http2Connection = await nursery.start(serve_tunnel, config, service)
            except* TUNNEL_FAILURES as group:
                failure = "; ".join(failure_reason(e) for e in exception_leaves(group))
            if failure is not None:
                record_failure(state)
                delay = next_delay(policy, state, random.random())
                log.warning(
                    "tunnel to %s failed: %s; retrying in %.1f s",
                    config.controlplane_url,
                    failure,
                    delay,
                    extra={**fields, "reason": failure, "delay_s": round(delay, 3)},
                )
                await trio.sleep(delay)
                continue
            record_connected(state, trio.current_time())
            log.info("tunnel to %s is up", config.controlplane_url, extra=fields)
            with trio.move_on_after(tc.max_age_s):
                await _closed_or_going_away(conn)
            if not conn.closed:
                # Maximum age, or the controlplane replica is going away (it sent GOAWAY as
                # it stops): the next tunnel opens first (through the Service, to another
                # replica), then this one drains.
                going = conn.peer_going_away.is_set()
                log.info(
                    "the controlplane is going away; opening the next tunnel and draining this one"
                    if going
                    else "tunnel reached its maximum age; opening the next and draining this one",
                    extra={**fields, "max_age_s": tc.max_age_s, "going_away": going},
                )
                nursery.start_soon(_drain, conn, tc.drain_s)
                continue
            record_disconnect(policy, state, trio.current_time())
            delay = next_delay(policy, state, random.random()) if state.failures else 0.0
            log.warning(
                "tunnel closed (%s); reconnecting in %.1f s",
                conn.close_reason,
                delay,
                extra={**fields, "reason": conn.close_reason, "delay_s": round(delay, 3)},
            )
            await trio.sleep(delay)


async def _closed_or_going_away(conn: Http2Connection) -> None:
    async with trio.open_nursery() as nursery:

        async def first(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(first, conn.wait_closed)
        nursery.start_soon(first, conn.peer_going_away.wait)


async def _drain(conn: Http2Connection, drain_s: float) -> None:
    with trio.move_on_after(drain_s):
        await conn.drain()
    await conn.aclose()


async def upgrade_to_tunnel(config: AgentConfig, tls: TLSStream) -> WebSocketStream:
    """The tunnel's WebSocket upgrade on `tls`, presenting the worker token (the agent's own
    tunnel and the self-check's handshake both open it here)."""
    return await open_websocket(
        tls,
        config.controlplane_host,
        f"/v1/workers/{config.worker_id}/tunnel",
        headers=[
            (b"authorization", f"Bearer {config.token}".encode()),
            (b"x-levers9-version", __version__.encode()),
        ],
    )


async def serve_tunnel(
    config: AgentConfig,
    service: Service,
    *,
    task_status: trio.TaskStatus[Http2Connection] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Dial the controlplane, upgrade to WebSocket, then serve HTTP/2 inside it."""
    tls = await open_controlplane_tls(config, ("http/1.1",))
    async with trio.open_nursery() as ws_nursery:
        try:
            ws = await upgrade_to_tunnel(config, tls)
        except ConnectionRejected as exc:
            await tls.aclose()
            raise TunnelRejected(
                f"the controlplane refused the tunnel with HTTP {exc.status_code}"
                + (" (check the worker token)" if exc.status_code in (401, 403) else "")
            ) from None
        except HandshakeError as exc:
            await tls.aclose()
            raise trio.BrokenResourceError(f"tunnel handshake failed: {exc}") from None
        conn = Http2Connection(
            ws,
            client_side=False,
            settings=config.http2,
            keepalive=config.keepalive,
            handler=service,
            name=f"tunnel {config.worker_id}",
        )
        await ws_nursery.start(conn.run)
        task_status.started(conn)
        await conn.wait_closed()
        ws_nursery.cancel_scope.cancel()
