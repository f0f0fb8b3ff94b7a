"""The pool and machine routes: what `levers9 pool list`, `cluster join` / `leave` and
`machine list` call.

The pools themselves run in `control.kube.runner`; these handlers read what it shows and
hand it a joined pool's block. A configured pool (a block of `config.worker.pools`) is changed
only in the values, never through the API. `machine_list` is the pure view of what each
pool's last pass saw.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from control.api.access import require_api, require_user
from control.kube.joined import JoinedPoolStore
from control.kube.loop import PoolStatus
from control.kube.planner import Machine
from control.kube.runner import PoolRunner
from control.models import (
    CardCounts,
    CardProblem,
    MachineList,
    MachineView,
    MachineWorker,
    PoolList,
    PoolPass,
    PoolView,
    SkippedNode,
    WorkerState,
)
from control.tasks.dispatch import Dispatcher
from wire.errors import ApiError, ErrorCode, decode_json
from wire.service import Request, Router
from workerapi.models import CardInfo, CardState

log = logging.getLogger("levers9.control")


class PoolRoutes:
    """`/v1/pools...` and `/v1/machines`, from the pools `runner` runs; `dispatcher` says
    which cards our tasks hold."""

    def __init__(self, runner: PoolRunner, dispatcher: Dispatcher) -> None:
        self.runner = runner
        self.dispatcher = dispatcher

    def add_to(self, router: Router) -> None:
        router.add("GET", "/v1/pools", self.list_pools)
        router.add("PUT", "/v1/pools/{name}", self.put_pool)
        router.add("DELETE", "/v1/pools/{name}", self.delete_pool)
        router.add("GET", "/v1/machines", self.list_machines)

    async def list_machines(self, request: Request) -> MachineList:
        require_user(request)
        return machine_list(
            [r.status for r in self.runner.pools],
            self.dispatcher.busy_cards(),
            self.dispatcher.registry.card_problems(),
        )

    async def list_pools(self, request: Request) -> PoolList:
        require_api(request)
        return PoolList(
            tuple(self.runner.pool_views()), joined_pools=self.runner.joined is not None
        )

    async def put_pool(self, request: Request) -> PoolView:
        require_api(request)
        name = request.params["name"]
        self._refuse_configured(name, "change it in the values, or join under another name")
        block = _json_mapping(await request.body())
        if block.get("name", name) != name:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"name {block.get('name')!r} does not match the path's {name!r}",
                field="name",
            )
        store = self._joined_store()
        kept = store.blocks.get(name, {}).get("kubernetes", {})
        given = block.get("kubernetes")
        if kept and isinstance(given, Mapping) and kept.get("endpoint") != given.get("endpoint"):
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"pool {name} is joined from {kept.get('endpoint')}; another cluster needs "
                f"another name, or `levers9 cluster leave {name}` first",
                field="kubernetes.endpoint",
            )
        pool = await self.runner.join(store, {**block, "name": name})
        log.info(
            "pool %s joined (%s)",
            name,
            pool.kubernetes.endpoint,
            extra={"pool": name, "endpoint": pool.kubernetes.endpoint},
        )
        return next(v for v in self.runner.pool_views() if v.name == name)

    async def delete_pool(self, request: Request) -> PoolView:
        require_api(request)
        name = request.params["name"]
        self._refuse_configured(name, "delete its block from the values and deploy")
        store = self._joined_store()
        views = [v for v in self.runner.pool_views() if v.name == name]
        if not views:
            raise ApiError(ErrorCode.NOT_FOUND, f"no joined pool named {name}")
        await self.runner.leave(store, name)
        log.info("pool %s left: its workers were removed", name, extra={"pool": name})
        return views[0]

    def _joined_store(self) -> JoinedPoolStore:
        if self.runner.joined is None:
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                "this controlplane keeps no joined pools (config.joinedPools is not set, "
                "or its store could not be read yet); add the pool's block to "
                "config.worker.pools instead",
            )
        return self.runner.joined

    def _refuse_configured(self, name: str, advice: str) -> None:
        if any(pool.name == name for pool in self.runner.config_pools):
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"pool {name} comes from config.worker.pools; {advice}",
                field="name",
            )


def machine_list(
    statuses: Sequence[PoolStatus],
    busy: Mapping[str, int] | None = None,
    problems: Mapping[str, Sequence[CardInfo]] | None = None,
) -> MachineList:
    """`GET /v1/machines` from what each pool's last pass saw, our cards split by `busy`
    (node → cards our tasks hold there) and `problems` (node → our worker's cards there that
    take no task, `WorkerRegistry.card_problems`). Pure."""
    busy = busy or {}
    problems = problems or {}
    return MachineList(
        machines=tuple(
            _machine_view(m, busy, status.refused.get(m.node), problems.get(m.node, ()))
            for status in statuses
            for m in status.machines
        ),
        pools=tuple(
            PoolPass(
                pool=status.pool,
                passed_at=status.passed_at,
                error=status.error,
                skipped=tuple(
                    SkippedNode(node=n.node, reason=n.reason, error=status.failed.get(n.node))
                    for n in status.skipped
                ),
            )
            for status in statuses
        ),
    )


def _machine_view(
    machine: Machine,
    busy: Mapping[str, int],
    refused: str | None = None,
    problems: Sequence[CardInfo] = (),
) -> MachineView:
    cards = machine.cards
    worker = machine.worker
    held = min(busy.get(machine.node, 0), cards.ours)
    bad = problems[: max(cards.ours - held, 0)] if worker is not None else ()
    states = [c.state for c in bad]
    return MachineView(
        pool=machine.pool,
        node=machine.node,
        gpu_model=machine.gpu_model,
        cards=CardCounts(
            total=cards.total,
            ours=cards.ours,
            others=cards.others,
            free=cards.free,
            busy=held,
            idle=cards.ours - held - len(bad),
            unhealthy=states.count(CardState.UNHEALTHY),
            occupied=states.count(CardState.OCCUPIED),
            refused=len(bad) - states.count(CardState.UNHEALTHY) - states.count(CardState.OCCUPIED),
        ),
        cpu_free_millis=machine.cpu_free_millis,
        memory_free_bytes=machine.memory_free_bytes,
        worker=None
        if worker is None
        else MachineWorker(state=WorkerState(worker.state), age_seconds=worker.age_seconds),
        error=machine.error,
        refused=refused,
        card_problems=tuple(
            CardProblem(index=c.index, uuid=c.uuid, state=str(c.state.value), reason=c.reason)
            for c in bad
        ),
    )


def _json_mapping(body: bytes) -> dict[str, Any]:
    data = decode_json(body) if body else None
    if not isinstance(data, dict):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT, "body must be a pool block (a JSON object with kubernetes)"
        )
    return data
