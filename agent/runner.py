"""The agent daemon: one worker API service, reached directly or through the tunnel.

`run_agent` builds the service once and then either listens (direct mode: TLS with a key and
certificate made at start, registered with the controlplane by their fingerprint so it can pin
them) or keeps ONE outbound tunnel to the controlplane (tunnel mode: a WebSocket over TLS,
HTTP/2 inside with the controlplane as the client). The service is the same object in both
modes; only how its connections arrive differs.

Tunnel upkeep lives here too: reconnect with capped, jittered exponential backoff reset after
a stable period; a maximum tunnel age after which the next tunnel is opened first and the old
one drained with GOAWAY, so requests in flight finish and new ones take the new tunnel.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import socket
import ssl
from collections.abc import Mapping
from pathlib import Path

import psutil
import trio
import trio_websocket

from agent import __version__
from agent.api import WorkerState, build_router
from agent.backoff import (
    Backoff,
    BackoffState,
    next_delay,
    record_connected,
    record_disconnect,
    record_failure,
)
from agent.client import ApiClient, open_api_client
from agent.config import AgentConfig
from agent.connection import Http2Connection
from agent.container_routes import add_container_routes, resolve_container
from agent.containers import ContainerManager, Gpus, open_container_manager
from agent.gpus import (
    CardLedger,
    Claim,
    GpuConfig,
    GpuSetupError,
    claim_cards,
    discover_node_files,
)
from agent.models import ApiError, CardInfo, ErrorCode, Registration
from agent.object_routes import add_object_routes
from agent.podresources import PodResourcesError
from agent.service import ConnectPolicy, Service, bearer_auth
from agent.tls import (
    CertKey,
    TLSStream,
    make_self_signed,
    server_context,
    verifying_client_context,
)
from agent.wsstream import WebSocketStream, wrap_client
from nvml import NvmlError

log = logging.getLogger("levers9.agent")

IDLE_POLL_S = 5.0


class TunnelRejected(Exception):
    """The controlplane refused the tunnel handshake (wrong token, unknown worker)."""


def build_service(
    config: AgentConfig, state: WorkerState, manager: ContainerManager | None = None
) -> Service:
    router = build_router(state)
    resolve_name = None
    if manager is not None:
        add_object_routes(router, manager.store)
        add_container_routes(router, manager)
        resolve_name = functools.partial(resolve_container, manager)
    return Service(
        router,
        authenticate=bearer_auth(config.token),
        connect_policy=ConnectPolicy(),
        resolve_name=resolve_name,
        name=f"worker {config.worker_id}",
    )


async def run_agent(
    config: AgentConfig, *, task_status: trio.TaskStatus[int | None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled. `started()` gives the direct listener's port (None in tunnel)."""
    state = WorkerState(worker_id=config.worker_id, mode=config.mode, node=config.node)
    root = logging.getLogger()
    root.addHandler(state.logs)
    try:
        await _serve(config, state, task_status)
    finally:
        root.removeHandler(state.logs)


async def _serve(
    config: AgentConfig, state: WorkerState, task_status: trio.TaskStatus[int | None]
) -> None:
    claim = await claim_into(state, os.environ)
    async with contextlib.AsyncExitStack() as stack:
        manager = None
        if config.containers is not None:
            manager = await stack.enter_async_context(
                open_container_manager(config.containers, gpus=_gpus(claim, os.environ))
            )
        service = build_service(config, state, manager)
        async with trio.open_nursery() as nursery:
            if manager is not None and config.idle_s is not None:
                nursery.start_soon(
                    _exit_when_idle, config, manager, config.idle_s, nursery.cancel_scope
                )
            await _serve_with(config, state, service, task_status)


def idle_for(active: int, idle_since: float | None, now: float) -> float | None:
    """When the worker became idle: None while a container is active, else since when (the
    moment it was first seen with none). Pure."""
    if active:
        return None
    return now if idle_since is None else idle_since


async def _exit_when_idle(
    config: AgentConfig, manager: ContainerManager, idle_s: float, scope: trio.CancelScope
) -> None:
    """A worker with no container for `idle_s` deregisters and ends cleanly (exit 0): its Job
    completes and the next reconcile may start a worker that takes every card free by then.
    The controlplane refuses the deregistration while it is placing a task here; the worker
    then stays and counts its idle time again."""
    since: float | None = None
    while True:
        now = trio.current_time()
        active = sum(1 for c in manager.all() if c.state not in ("exited", "failed"))
        since = idle_for(active, since, now)
        if since is not None and now - since >= idle_s:
            try:
                await deregister_once(config)
            except ApiError as exc:
                if exc.code is ErrorCode.FAILED_PRECONDITION:
                    log.info("not winding down: %s", exc.message)
                    since = None
                    continue
                log.warning("deregistering failed (%s); winding down anyway", exc.message)
            except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                log.warning("deregistering failed (%s); winding down anyway", failure_reason(exc))
            log.info("no container for %.0f s: the worker winds down", now - since)
            scope.cancel()
            return
        await trio.sleep(min(IDLE_POLL_S, idle_s))


def _gpus(claim: Claim | None, environ: Mapping[str, str]) -> Gpus | None:
    if claim is None or not claim.serving:
        return None
    gpu_config = GpuConfig.from_environ(environ)
    return Gpus(
        ledger=CardLedger.for_claim(claim), files=discover_node_files(gpu_config), config=gpu_config
    )


async def _serve_with(
    config: AgentConfig,
    state: WorkerState,
    service: Service,
    task_status: trio.TaskStatus[int | None],
) -> None:
    async with trio.open_nursery() as nursery:
        if config.mode == "direct":
            cert_key = make_self_signed(f"levers9-worker-{config.worker_id}", _cert_hosts(config))
            port = await nursery.start(serve_direct, config, service, cert_key)
            nursery.start_soon(
                register_loop, config, registration(config, state, cert_key.fingerprint, port)
            )
            log.info(
                "worker %s serving directly on %s:%d",
                config.worker_id,
                config.listen_host,
                port,
                extra={"fingerprint": cert_key.fingerprint},
            )
            task_status.started(port)
        else:
            nursery.start_soon(run_tunnel, config, service)
            nursery.start_soon(register_loop, config, registration(config, state))
            task_status.started(None)


async def claim_into(state: WorkerState, environ: Mapping[str, str]) -> Claim | None:
    """Claim the cards Kubernetes gave this pod and record them (and any problem) in `state`.

    A node without a working driver still gets a worker that answers, reporting no cards and
    why, so the controlplane and the operator see the reason rather than a crash loop.
    """
    try:
        claim = await claim_cards(GpuConfig.from_environ(environ), environ)
    except (NvmlError, PodResourcesError, GpuSetupError) as exc:
        state.gpu_problems = (f"no cards claimed: {exc}",)
        log.warning("no cards claimed: %s", exc)
        return None
    state.driver_version = claim.driver_version
    state.cards = tuple(
        CardInfo(
            uuid=card.uuid,
            index=card.index,
            model=card.model,
            memory_total_bytes=card.memory_total_bytes,
            state=card.state.value,
            reason=card.reason,
        )
        for card in claim.cards
    )
    state.gpu_problems = claim.problems()
    for problem in state.gpu_problems:
        log.warning("%s", problem)
    log.info(
        "claimed %d of %d card(s) (from %s)",
        len(claim.serving),
        len(claim.cards),
        claim.source,
    )
    return claim


def _cert_hosts(config: AgentConfig) -> list[str]:
    hosts = ["127.0.0.1", "localhost"]
    for host in (config.advertise_host, config.listen_host):
        if host and host not in hosts and host not in ("0.0.0.0", "::"):
            hosts.append(host)
    return hosts


def advertised_address(config: AgentConfig, port: int) -> str:
    host = config.advertise_host
    if host is None:
        host = config.listen_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- direct mode --


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


def _controlplane_context(config: AgentConfig, alpn: tuple[str, ...]) -> ssl.SSLContext:
    return verifying_client_context(cafile=config.controlplane_ca_file, alpn=alpn)


async def open_controlplane_tls(config: AgentConfig, alpn: tuple[str, ...]) -> TLSStream:
    """A TLS connection to the controlplane, its certificate verified."""
    tcp = await trio.open_tcp_stream(config.controlplane_host, config.controlplane_port)
    tls = TLSStream(
        tcp,
        _controlplane_context(config, alpn),
        server_side=False,
        server_hostname=config.controlplane_host,
    )
    try:
        await tls.do_handshake()
    except BaseException:
        await tls.aclose()
        raise
    return tls


def capacity() -> tuple[int, int]:
    """CPU (thousandths of a core) and memory (bytes) this worker may give its containers:
    its cgroup's limits where it has them, else the node's."""
    cpu = (os.cpu_count() or 1) * 1000
    memory = int(psutil.virtual_memory().total)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpu = min(cpu, int(int(quota) * 1000 / int(period)))
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            memory = min(memory, int(limit))
    except (OSError, ValueError):
        pass
    return cpu, memory


def registration(
    config: AgentConfig, state: WorkerState, fingerprint: str | None = None, port: int = 0
) -> Registration:
    """What this worker tells the controlplane about itself at every heartbeat."""
    cpu, memory = capacity()
    return Registration(
        worker_id=config.worker_id,
        version=__version__,
        mode=config.mode,
        address=advertised_address(config, port) if config.mode == "direct" else None,
        fingerprint=fingerprint,
        node=config.node,
        cards=state.cards,
        cpu_millis=cpu,
        memory_bytes=memory,
        containers=config.containers is not None,
    )


async def _call_controlplane(config: AgentConfig, path: str, body: object) -> None:
    with trio.fail_after(config.handshake_timeout_s):
        tls = await open_controlplane_tls(config, ("h2",))
        refused: ApiError | None = None
        async with open_api_client(
            tls, ApiClient, token=config.token, authority=config.controlplane_host
        ) as client:
            try:
                await client.call("POST", path, body)
            except ApiError as exc:
                refused = exc  # raised outside the client's nursery: not in an ExceptionGroup
        if refused is not None:
            raise refused


async def register_once(config: AgentConfig, registration: Registration) -> None:
    await _call_controlplane(config, f"/v1/workers/{config.worker_id}/register", registration)


async def deregister_once(config: AgentConfig) -> None:
    """Tell the controlplane this worker is going away (it takes no more tasks)."""
    await _call_controlplane(config, f"/v1/workers/{config.worker_id}/deregister", {})


async def register_loop(config: AgentConfig, registration: Registration) -> None:
    """Tell the controlplane how to reach us and what we have, and keep telling it: the
    registration is the heartbeat (and the controlplane may have restarted)."""
    policy = Backoff(cap_s=min(config.tunnel.backoff_cap_s, config.register_interval_s))
    state = BackoffState()
    while True:
        try:
            await register_once(config, registration)
        except (OSError, trio.BrokenResourceError, trio.TooSlowError, ApiError) as exc:
            record_failure(state)
            delay = next_delay(policy, state, random.random())
            log.warning(
                "registering with the controlplane failed (%s); retrying in %.1f s",
                failure_reason(exc),
                delay,
            )
            await trio.sleep(delay)
            continue
        state.failures = 0
        await trio.sleep(config.register_interval_s)


TUNNEL_FAILURES = (
    OSError,
    trio.BrokenResourceError,
    trio.TooSlowError,
    TunnelRejected,
    trio_websocket.HandshakeError,
)


def exception_leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(exception_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, trio_websocket.ConnectionRejected):
        hint = " (check the worker token)" if exc.status_code in (401, 403) else ""
        return f"the controlplane refused the tunnel with HTTP {exc.status_code}{hint}"
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY" in str(exc):
        return f"the controlplane's certificate did not verify: {exc}"
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    return str(exc) or type(exc).__name__


# -- tunnel mode --


async def run_tunnel(config: AgentConfig, service: Service) -> None:
    """Keep one tunnel up forever: reconnect with backoff, roll it over at its maximum age."""
    tc = config.tunnel
    policy = Backoff(
        initial_s=tc.backoff_initial_s, cap_s=tc.backoff_cap_s, stable_s=tc.backoff_stable_s
    )
    state = BackoffState()
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
                )
                await trio.sleep(delay)
                continue
            record_connected(state, trio.current_time())
            log.info("tunnel to %s is up", config.controlplane_url)
            with trio.move_on_after(tc.max_age_s):
                await conn.wait_closed()
            if not conn.closed:
                # Maximum age: the next tunnel opens first, then this one drains.
                log.info("tunnel reached its maximum age; opening the next and draining this one")
                nursery.start_soon(_drain, conn, tc.drain_s)
                continue
            record_disconnect(policy, state, trio.current_time())
            delay = next_delay(policy, state, random.random()) if state.failures else 0.0
            log.warning("tunnel closed (%s); reconnecting in %.1f s", conn.close_reason, delay)
            await trio.sleep(delay)


async def _drain(conn: Http2Connection, drain_s: float) -> None:
    with trio.move_on_after(drain_s):
        await conn.drain()
    await conn.aclose()


async def upgrade_to_tunnel(
    config: AgentConfig, nursery: trio.Nursery, tls: TLSStream
) -> trio_websocket.WebSocketConnection:
    """The tunnel's WebSocket upgrade on `tls`, presenting the worker token (the agent's own
    tunnel and the self-check's handshake both open it here); its reader runs in `nursery`."""
    return await wrap_client(
        nursery,
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
            ws = await upgrade_to_tunnel(config, ws_nursery, tls)
        except trio_websocket.ConnectionRejected as exc:
            await tls.aclose()
            raise TunnelRejected(
                f"the controlplane refused the tunnel with HTTP {exc.status_code}"
                + (" (check the worker token)" if exc.status_code in (401, 403) else "")
            ) from None
        except trio_websocket.HandshakeError as exc:
            await tls.aclose()
            raise trio.BrokenResourceError(f"tunnel handshake failed: {exc}") from None
        conn = Http2Connection(
            WebSocketStream(ws, tls),
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
