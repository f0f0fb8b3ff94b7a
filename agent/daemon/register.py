"""Registration with the controlplane: the worker's capacity and address, sent at start and
as a heartbeat, retried with capped, jittered backoff.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import psutil
import trio

from agent.daemon.config import AgentConfig
from agent.daemon.routes import WorkerState
from wire.backoff import (
    Backoff,
    BackoffState,
    next_delay,
    record_failure,
)
from wire.client import ApiClient, open_api_client
from wire.errors import ApiError
from wire.tls import (
    PinMismatchError,
    TLSStream,
    verifying_client_context,
)
from wire.wsstream import ConnectionRejected, HandshakeError
from workerapi import __version__
from workerapi.models import Registration

log = logging.getLogger("levers9.agent")


class TunnelRejected(Exception):
    """The controlplane refused the tunnel handshake (wrong token, unknown worker)."""


def cert_hosts(config: AgentConfig) -> list[str]:
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
        failed: ApiError | trio.BrokenResourceError | OSError | None = None
        async with open_api_client(
            tls, ApiClient, token=config.token, authority=config.controlplane_host
        ) as client:
            try:
                await client.call("POST", path, body)
            except (ApiError, trio.BrokenResourceError, OSError) as exc:
                # Raised again outside the client's nursery, so callers get the error itself
                # (a refusal, a connection lost mid-call), not an ExceptionGroup around it.
                failed = exc
        if failed is not None:
            raise failed


async def register_once(config: AgentConfig, registration: Registration) -> None:
    await _call_controlplane(config, f"/v1/workers/{config.worker_id}/register", registration)


async def deregister_once(config: AgentConfig) -> None:
    """Tell the controlplane this worker is going away (it takes no more tasks)."""
    await _call_controlplane(config, f"/v1/workers/{config.worker_id}/deregister", {})


class RegisterNudge:
    """Wakes the register loop early: a card changed state and the controlplane must hear it
    now, not at the next heartbeat. Nudges that come while one is pending make one."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[None](1)

    def nudge(self) -> None:
        with contextlib.suppress(trio.WouldBlock):
            self._send.send_nowait(None)

    async def wait(self) -> None:
        await self._receive.receive()


async def _wait_next(config: AgentConfig, seconds: float, nudge: RegisterNudge | None) -> None:
    with trio.move_on_after(seconds):
        if nudge is None:
            await trio.sleep_forever()
        await nudge.wait()


async def register_loop(
    config: AgentConfig,
    registration: Registration | Callable[[], Registration],
    nudge: RegisterNudge | None = None,
) -> None:
    """Tell the controlplane how to reach us and what we have, and keep telling it: the
    registration is the heartbeat (and the controlplane may have restarted). A callable
    `registration` is asked anew each time; `nudge` sends one at once."""
    policy = Backoff(cap_s=min(config.tunnel.backoff_cap_s, config.register_interval_s))
    state = BackoffState()
    while True:
        current = registration() if callable(registration) else registration
        try:
            await register_once(config, current)
        except (OSError, trio.BrokenResourceError, trio.TooSlowError, ApiError) as exc:
            record_failure(state)
            delay = next_delay(policy, state, random.random())
            reason = failure_reason(exc)
            log.warning(
                "registering with the controlplane failed (%s); retrying in %.1f s",
                reason,
                delay,
                extra={"worker": config.worker_id, "reason": reason, "delay_s": round(delay, 3)},
            )
            await _wait_next(config, delay, nudge)
            continue
        state.failures = 0
        await _wait_next(config, config.register_interval_s, nudge)


TUNNEL_FAILURES = (
    OSError,
    trio.BrokenResourceError,
    trio.TooSlowError,
    TunnelRejected,
    HandshakeError,
)


def _cause_chain(exc: BaseException) -> list[BaseException]:
    """`exc`, what it was raised from, and so on: `TLSStream` raises BrokenResourceError from
    OpenSSL's error (and, once the stream is broken, from that first error again)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__
    return chain


def failure_reason(exc: BaseException) -> str:
    """One line for a log or a check: what went wrong talking to the controlplane, sorted by
    the exception's type (and its causes'), never by its message."""
    if isinstance(exc, ConnectionRejected):
        hint = " (check the worker token)" if exc.status_code in (401, 403) else ""
        return f"the controlplane refused the tunnel with HTTP {exc.status_code}{hint}"
    for cause in _cause_chain(exc):
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"the controlplane's certificate did not verify: {cause}"
        if isinstance(cause, PinMismatchError):
            return str(cause)
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    return str(exc) or type(exc).__name__
