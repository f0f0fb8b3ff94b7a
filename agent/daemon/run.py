"""The agent daemon: one worker API service, reached directly or through the tunnel.

`run_agent` builds the service once and then either listens (direct mode: TLS with a key and
certificate made at start, registered with the controlplane by their fingerprint so it can pin
them) or keeps ONE outbound tunnel to the controlplane (tunnel mode: a WebSocket over TLS,
HTTP/2 inside with the controlplane as the client). The service is the same object in both
modes; only how its connections arrive differs.

Tunnel upkeep lives here too: reconnect with capped, jittered exponential backoff reset after
a stable period; a maximum tunnel age, or a GOAWAY from the controlplane (a replica stopping),
after which the next tunnel is opened first and the old one drained, so requests in flight
finish and new ones take the new tunnel.

With LEVERS9_METRICS_PORT set, a `/metrics` listener for Prometheus (`agent.daemon.metrics`)
runs beside the service in the same nursery, in either mode.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Mapping

import trio

from agent.daemon.config import AgentConfig
from agent.daemon.direct import serve_direct
from agent.daemon.health import CardHealthWatch
from agent.daemon.metrics import serve_agent_metrics
from agent.daemon.register import (
    RegisterNudge,
    cert_hosts,
    deregister_once,
    failure_reason,
    register_loop,
    registration,
)
from agent.daemon.routes import WorkerState, build_router
from agent.daemon.tunnel import run_tunnel
from agent.gpus.claim import Claim, GpuConfig, GpuSetupError, claim_cards
from agent.gpus.edits import discover_node_files
from agent.gpus.health import all_our_pids
from agent.gpus.ledger import CardLedger
from agent.gpus.podresources import PodResourcesError
from agent.runtime.manager import ContainerManager, open_container_manager
from agent.runtime.records import Gpus
from agent.runtime.routes import add_container_routes, resolve_container
from agent.store.routes import add_object_routes
from nvml import NvmlError
from wire.errors import ApiError, ErrorCode
from wire.service import ConnectPolicy, Service, bearer_auth
from wire.tls import (
    make_self_signed,
)
from workerapi.models import CardInfo

log = logging.getLogger("levers9.agent")
IDLE_POLL_S = 5.0


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
        program="worker",
        authenticate=bearer_auth(config.token),
        connect_policy=ConnectPolicy(
            loopback=config.loopback_connect, setting="LEVERS9_LOOPBACK_CONNECT=on"
        ),
        resolve_name=resolve_name,
        name=f"worker {config.worker_id}",
    )


async def run_agent(
    config: AgentConfig, *, task_status: trio.TaskStatus[int | None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled. `started()` gives the direct listener's port (None in tunnel)."""
    from wire.admission import raise_open_files_limit

    raise_open_files_limit(config.connections.max_total)
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
            if config.metrics is not None:
                await nursery.start(
                    functools.partial(
                        serve_agent_metrics,
                        config.metrics,
                        worker=config.worker_id,
                        mode=config.mode,
                        claim=None if claim is None else (lambda: state.cards),
                        manager=manager,
                    )
                )
            nudge = RegisterNudge()
            if claim is not None:
                await nursery.start(
                    CardHealthWatch(
                        config.health,
                        state,
                        nudge,
                        ledger=None
                        if manager is None or manager.gpus is None
                        else manager.gpus.ledger,
                        manager=manager,
                        driver_dir=GpuConfig.from_environ(os.environ).driver_dir,
                    ).run
                )
            if manager is not None and config.idle_s is not None:
                nursery.start_soon(
                    _exit_when_idle, config, manager, config.idle_s, nursery.cancel_scope
                )
            await _serve_with(config, state, service, nudge, task_status)


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
        active = sum(1 for c in manager.all() if not c.state.finished)
        since = idle_for(active, since, now)
        if since is not None and now - since >= idle_s:
            fields = {"worker": config.worker_id, "node": config.node}
            try:
                await deregister_once(config)
            except ApiError as exc:
                if exc.code is ErrorCode.FAILED_PRECONDITION:
                    log.info(
                        "not winding down: %s",
                        exc.message,
                        extra={**fields, "reason": exc.message, "error_code": exc.code.name},
                    )
                    since = None
                    continue
                log.warning(
                    "deregistering failed (%s); winding down anyway",
                    exc.message,
                    extra={**fields, "reason": exc.message, "error_code": exc.code.name},
                )
            except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                reason = failure_reason(exc)
                log.warning(
                    "deregistering failed (%s); winding down anyway",
                    reason,
                    extra={**fields, "reason": reason},
                )
            log.info(
                "no container for %.0f s: the worker winds down",
                now - since,
                extra={**fields, "idle_s": round(now - since, 3)},
            )
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
    nudge: RegisterNudge,
    task_status: trio.TaskStatus[int | None],
) -> None:
    async with trio.open_nursery() as nursery:
        if config.mode == "direct":
            # A worker id is its Job's name, up to 63 characters on a GKE node's long name; a
            # certificate's common name holds 64 and is only a label (peers pin the fingerprint).
            common_name = f"levers9-worker-{config.worker_id}"[:64]
            cert_key = make_self_signed(common_name, cert_hosts(config))
            port = await nursery.start(serve_direct, config, service, cert_key)
            nursery.start_soon(
                register_loop,
                config,
                functools.partial(registration, config, state, cert_key.fingerprint, port),
                nudge,
            )
            log.info(
                "worker %s serving directly on %s:%d",
                config.worker_id,
                config.listen_host,
                port,
                extra={
                    "worker": config.worker_id,
                    "node": config.node,
                    "mode": config.mode,
                    "listen_host": config.listen_host,
                    "port": port,
                    "fingerprint": cert_key.fingerprint,
                },
            )
            task_status.started(port)
        else:
            nursery.start_soon(run_tunnel, config, service)
            nursery.start_soon(
                register_loop, config, functools.partial(registration, config, state), nudge
            )
            task_status.started(None)


async def claim_into(state: WorkerState, environ: Mapping[str, str]) -> Claim | None:
    """Claim the cards Kubernetes gave this pod and record them (and any problem) in `state`.

    A node without a working driver still gets a worker that answers, reporting no cards and
    why, so the controlplane and the operator see the reason rather than a crash loop.
    """
    fields = {"worker": state.worker_id, "node": state.node}
    try:
        # After an agent restart our containers still run on their cards: their processes
        # are ours (by cgroup), not a reason to refuse the card.
        own_pids = await trio.to_thread.run_sync(all_our_pids)
        claim = await claim_cards(GpuConfig.from_environ(environ), environ, own_pids)
    except (NvmlError, PodResourcesError, GpuSetupError) as exc:
        state.gpu_problems = (f"no cards claimed: {exc}",)
        log.warning("no cards claimed: %s", exc, extra={**fields, "reason": str(exc)})
        return None
    state.driver_version = claim.driver_version
    state.cards = tuple(
        CardInfo(
            uuid=card.uuid,
            index=card.index,
            model=card.model,
            memory_total_bytes=card.memory_total_bytes,
            state=card.state,
            reason=card.reason,
        )
        for card in claim.cards
    )
    state.gpu_problems = claim.problems()
    for problem in state.gpu_problems:
        log.warning("%s", problem, extra=fields)
    log.info(
        "claimed %d of %d card(s) (from %s)",
        len(claim.serving),
        len(claim.cards),
        claim.source,
        extra={
            **fields,
            "cards_serving": len(claim.serving),
            "cards_total": len(claim.cards),
            "source": claim.source,
        },
    )
    return claim
