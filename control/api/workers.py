"""The worker routes: a worker registers and deregisters itself, an operator lists the workers
and asks one about itself.

A worker calls with its own token (`worker:ID`) and only for its own id; one with tasks placed
on it may not deregister (it stays until they are done). Asking a worker about itself goes to
the worker, through its tunnel or its direct connection, under `WORKER_CALL_TIMEOUT_S`.
"""

from __future__ import annotations

import logging

import trio

from control.api.access import require_api, require_worker
from control.models import WorkerList
from control.tasks.dispatch import Dispatcher
from control.workers.registry import WorkerRegistry
from wire.errors import ApiError, ErrorCode
from wire.service import JsonResponse, Request, Router
from workerapi.models import Registration, WorkerInfo, WorkerSummary

WORKER_CALL_TIMEOUT_S = 30.0
"""How long a call the controlplane makes to a worker (its view of itself) may take."""

log = logging.getLogger("levers9.control")


class WorkerRoutes:
    """`/v1/workers...`, answered from `registry`; `dispatcher` says which workers hold
    tasks."""

    def __init__(self, registry: WorkerRegistry, dispatcher: Dispatcher) -> None:
        self.registry = registry
        self.dispatcher = dispatcher

    def add_to(self, router: Router) -> None:
        router.add("POST", "/v1/workers/{worker_id}/register", self.register)
        router.add("POST", "/v1/workers/{worker_id}/deregister", self.deregister)
        router.add("GET", "/v1/workers", self.list_workers)
        router.add("GET", "/v1/workers/{worker_id}", self.get_worker)

    async def register(self, request: Request) -> WorkerSummary:
        worker_id = request.params["worker_id"]
        require_worker(request, worker_id, "register")
        registration = await request.json(Registration)
        if registration.worker_id != worker_id:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"workerId {registration.worker_id!r} does not match the path's {worker_id!r}",
                field="workerId",
            )
        await self.registry.register(registration)
        return next(w for w in self.registry.list() if w.worker_id == worker_id)

    async def deregister(self, request: Request) -> JsonResponse:
        worker_id = request.params["worker_id"]
        require_worker(request, worker_id, "deregister")
        if self.dispatcher.has_tasks(worker_id):
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"worker {worker_id} has tasks placed on it; it stays",
            )
        await self.registry.deregister(worker_id)
        log.info("worker %s deregistered: it winds down", worker_id, extra={"worker": worker_id})
        return JsonResponse({})

    async def list_workers(self, request: Request) -> WorkerList:
        require_api(request)
        return WorkerList(tuple(self.registry.list()))

    async def get_worker(self, request: Request) -> WorkerInfo:
        require_api(request)
        worker_id = request.params["worker_id"]
        with trio.move_on_after(WORKER_CALL_TIMEOUT_S) as scope:
            client = await self.registry.client_for(worker_id)
            return await client.worker()
        assert scope.cancelled_caught
        raise ApiError(
            ErrorCode.DEADLINE_EXCEEDED,
            f"worker {worker_id} did not answer within {WORKER_CALL_TIMEOUT_S:g} s",
        )
