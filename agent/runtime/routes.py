"""The worker API's container routes: create, get, list, logs, exec, stop, delete, snapshot.

Handlers are thin: they parse the request into a model, call the `ContainerManager`, and answer
with models from `workerapi.models`. Creation belongs to the manager, so a client that gives up
waiting (`wait=false`, or a deadline) leaves the container being created; `GET` tells how far
it got. A container's declared ports are reached by CONNECT to `<container id>:<port>`
(see `resolve_container`), exec is a WebSocket (`workerapi.exec`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

from agent.runtime.exec import ExecSession, serve_exec
from agent.runtime.manager import ContainerManager
from wire.errors import ApiError, ErrorCode, dumps, loads
from wire.h2websocket import H2WebSocket
from wire.service import JsonResponse, Request, Router, StreamResponse
from workerapi.models import (
    ContainerList,
    ContainerSpec,
    ContainerStatus,
    ExecRequest,
    SnapshotInfo,
    StopRequest,
)


def _flag(request: Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ApiError(ErrorCode.INVALID_ARGUMENT, f"query {name!r} must be true or false", field=name)


def add_container_routes(router: Router, manager: ContainerManager) -> None:
    async def create(request: Request) -> JsonResponse:
        spec = await request.json(ContainerSpec)
        container = await manager.create(spec)
        if _flag(request, "wait", True):
            await manager.wait_settled(container)
        return JsonResponse(container.status(), status=201)

    async def list_containers(request: Request) -> ContainerList:
        return ContainerList(containers=tuple(c.status() for c in manager.all()))

    async def get(request: Request) -> ContainerStatus:
        return manager.get(request.params["id"]).status()

    async def wait(request: Request) -> ContainerStatus:
        container = manager.get(request.params["id"])
        await container.finished.wait()
        return container.status()

    async def stop(request: Request) -> ContainerStatus:
        body = await request.body()
        grace = loads(body, StopRequest).grace_s if body else None
        if grace is not None and grace < 0:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, "graceS must be 0 or more", field="graceS")
        return (await manager.stop(request.params["id"], grace_s=grace)).status()

    async def delete(request: Request) -> JsonResponse:
        await manager.delete(request.params["id"])
        return JsonResponse({})

    async def snapshot(request: Request) -> JsonResponse:
        info: SnapshotInfo = await manager.snapshot(request.params["id"])
        return JsonResponse(info, status=201)

    async def logs(request: Request) -> StreamResponse:
        container_id = request.params["id"]
        manager.get(container_id)
        follow = _flag(request, "follow", False)

        async def lines() -> AsyncGenerator[bytes, None]:
            batch: list[bytes] = []
            async with contextlib.aclosing(
                manager.log_lines(container_id, follow=follow)
            ) as source:
                async for line in source:
                    batch.append(dumps(line) + b"\n")
                    if len(batch) >= 256 or follow:
                        yield b"".join(batch)
                        batch.clear()
            if batch:
                yield b"".join(batch)

        return StreamResponse(lines, content_type="application/x-ndjson")

    async def exec_(request: Request, ws: H2WebSocket) -> None:
        container_id = request.params["id"]

        async def start(exec_request: ExecRequest) -> ExecSession:
            return await manager.exec(container_id, exec_request)

        await serve_exec(start, ws)

    router.add("POST", "/v1/containers", create)
    router.add("GET", "/v1/containers", list_containers)
    router.add("GET", "/v1/containers/{id}", get)
    router.add("DELETE", "/v1/containers/{id}", delete)
    router.add("GET", "/v1/containers/{id}/wait", wait)
    router.add("POST", "/v1/containers/{id}/stop", stop)
    router.add("POST", "/v1/containers/{id}/snapshot", snapshot)
    router.add("GET", "/v1/containers/{id}/logs", logs)
    router.add_websocket("/v1/containers/{id}/exec", exec_)


def resolve_container(manager: ContainerManager, host: str, port: int) -> str:
    """CONNECT `<container id>:<port>` → the running container's address on its veth, for a
    port the container declared (PERMISSION_DENIED naming its ports otherwise)."""
    return manager.address_of(host, port)
