"""The worker API's routes: what the controlplane can ask a worker.

The routes are registered on one `Router`; later capabilities (cards, containers, objects,
volumes) add theirs here. Handlers are thin: they read the worker's state and answer with
models from `workerapi.models`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

import attrs
import trio

from proc.logs import RecentLogs
from wire.errors import ApiError, ErrorCode
from wire.h2websocket import H2WebSocket, WebSocketClosed
from wire.service import Request, Router, StreamResponse
from workerapi import __version__
from workerapi.models import CardInfo, Health, WorkerInfo

LOG_POLL_S = 0.2


@attrs.define
class WorkerState:
    """What the worker knows about itself."""

    worker_id: str
    mode: str
    node: str | None = None
    driver_version: str | None = None
    cards: tuple[CardInfo, ...] = ()
    gpu_problems: tuple[str, ...] = ()
    logs: RecentLogs = attrs.field(factory=RecentLogs)
    started_at: float = attrs.field(factory=time.time)
    started_monotonic: float = attrs.field(factory=time.monotonic)


def build_router(state: WorkerState) -> Router:
    router = Router()

    async def health(request: Request) -> Health:
        return Health(status="ok", worker_id=state.worker_id)

    async def worker(request: Request) -> WorkerInfo:
        return WorkerInfo(
            worker_id=state.worker_id,
            version=__version__,
            mode=state.mode,
            started_at=state.started_at,
            uptime_s=round(time.monotonic() - state.started_monotonic, 3),
            node=state.node,
            driver_version=state.driver_version,
            cards=state.cards,
            gpu_problems=state.gpu_problems,
        )

    async def echo(request: Request, ws: H2WebSocket) -> None:
        # A diagnostic WebSocket route: proves the extended-CONNECT path end to end.
        try:
            while True:
                await ws.send_message(await ws.receive_message())
        except WebSocketClosed:
            return

    async def agent_logs(request: Request) -> StreamResponse:
        follow = request.query.get("follow", "false").lower() in ("1", "true", "yes")
        try:
            start = int(request.query.get("since", "0"))
        except ValueError:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT, "query 'since' must be a line number", field="since"
            ) from None

        async def lines() -> AsyncGenerator[bytes, None]:
            sequence = start
            while True:
                batch, sequence = state.logs.since(sequence)
                if batch:
                    yield ("\n".join(batch) + "\n").encode()
                if not follow:
                    return
                await trio.sleep(LOG_POLL_S)

        return StreamResponse(lines, content_type="application/x-ndjson")

    router.add("GET", "/v1/health", health)
    router.add("GET", "/v1/agent/logs", agent_logs)
    router.add("GET", "/v1/worker", worker)
    router.add_websocket("/v1/echo", echo)
    return router
