"""The worker API's routes: what the controlplane can ask a worker.

The routes are registered on one `Router`; later capabilities (cards, containers, objects,
volumes) add theirs here. Handlers are thin: they read the worker's state and answer with
models from `agent.models`.
"""

from __future__ import annotations

import time

import attrs

from agent import __version__
from agent.h2websocket import H2WebSocket, WebSocketClosed
from agent.models import CardInfo, Health, WorkerInfo
from agent.service import Request, Router


@attrs.define
class WorkerState:
    """What the worker knows about itself."""

    worker_id: str
    mode: str
    node: str | None = None
    driver_version: str | None = None
    cards: tuple[CardInfo, ...] = ()
    gpu_problems: tuple[str, ...] = ()
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

    router.add("GET", "/v1/health", health)
    router.add("GET", "/v1/worker", worker)
    router.add_websocket("/v1/echo", echo)
    return router
