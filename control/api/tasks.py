"""The controlplane's task routes: what `levers9 run`, `task`, `exec` and `port` call.

Every handler first takes the workspace from the caller's token, then works only inside it: a
task id of another workspace is NOT_FOUND like an unknown one. The handlers are thin: records
come from the `TaskStore`, placement and the containers' lifecycle belong to the `Dispatcher`,
and the worker is reached through it (directly or through the tunnel, the same call either
way). Log streams, exec and port traffic are relayed, never buffered whole:

- logs follow a task from pending (the stream waits for it to start) through its worker's log
  to the end, then from the kept log once the container is gone, without repeating a line;
- exec relays the worker's exec WebSocket message by message;
- a box port is a CONNECT stream spliced with the worker's CONNECT to the container's port,
  one the task declared (refused here first, as the worker refuses any other);
- an endpoint request is forwarded as HTTP/1.1 over such a stream (`control.api.endpoints`).

Every route first takes a request from its token's bucket, a create checks the spec's size
and counts the workspace's tasks in its insert, and a watch takes one of the token's stream
slots (`control.limits`): one workspace cannot load the controlplane the others share.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

import attrs
import trio

from control.api.endpoints import EndpointProxy, upstream_target
from control.api.watch import watch_list, watch_value
from control.limits import TenantGuard, active_tasks_refusal, spec_refusal, token_key
from control.models import TaskList, TaskRequest, TaskSnapshot, TaskState, TaskView
from control.tasks.dispatch import CLEANUP_S, SCHEDULE_EVERY_S, Dispatcher, WorkerLost
from control.tasks.store import ACTIVE_ON_WORKER, TaskRecord, TaskSpec
from wire.errors import ApiError, ErrorCode, dumps
from wire.h2websocket import H2WebSocket, WebSocketClosed
from wire.service import (
    BytesResponse,
    Dialer,
    JsonResponse,
    Request,
    Router,
    StreamResponse,
    bearer_token,
)
from workerapi.models import VolumeSpec
from workerapi.reference import local_registry_refusal, parse_reference
from workerapi.validation import canonical_mount_path

log = logging.getLogger("levers9.tasks")

WORKSPACE_PREFIX = "ws:"
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
NOT_STARTED_RETRY_S = 0.05
R = TypeVar("R")


def _log_to_keep(record: TaskRecord) -> bool:
    """Whether the task's watcher keeps its log as it cleans up: its container ran, and its
    worker was not lost with it."""
    return record.running_at is not None and record.state is not TaskState.LOST


def workspace_of(request_principal: str) -> str:
    if not request_principal.startswith(WORKSPACE_PREFIX):
        raise ApiError(
            ErrorCode.PERMISSION_DENIED,
            "task calls need a workspace token (one of config.workspaces[].tokens)",
        )
    return request_principal[len(WORKSPACE_PREFIX) :]


def spec_of(
    request: TaskRequest, volumes: tuple[VolumeSpec, ...], *, allow_local_registries: bool = False
) -> TaskSpec:
    """The spec to store, or INVALID_ARGUMENT naming the field: the volumes at their canonical
    mount paths, and an image on a registry at a loopback or link-local address (written in the
    reference) refused unless the installation allows local registries (a name is resolved, and
    judged, by the worker). The rest is the shared check (`validate_spec`)."""
    try:
        reference = parse_reference(request.image)
    except ApiError as exc:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, exc.message, field="image") from None
    refused = None if allow_local_registries else local_registry_refusal(reference.registry)
    if refused is not None:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"field 'image': {refused}", field="image")
    return TaskSpec(
        image=request.image,
        command=request.command,
        args=request.args,
        env=dict(request.env),
        cards=request.cards,
        cpu_millis=request.cpu_millis,
        memory_bytes=request.memory_bytes,
        volumes=canonical_mounts(volumes),
        ports=request.ports,
        timeout_s=request.timeout_s,
        snapshot=request.snapshot,
    )


def canonical_mounts(volumes: tuple[VolumeSpec, ...]) -> tuple[VolumeSpec, ...]:
    """The volumes at their canonical mount paths (the spelling stored, checked and mounted
    at: `//etc/` is `/etc`), or INVALID_ARGUMENT naming `volumes[i].mountPath`."""
    out = []
    for i, volume in enumerate(volumes):
        try:
            path = canonical_mount_path(volume.mount_path)
        except ValueError as exc:
            field = f"volumes[{i}].mountPath"
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT, f"field {field!r}: {exc}", field=field
            ) from None
        out.append(attrs.evolve(volume, mount_path=path))
    return tuple(out)


def query_states(raw: str | None) -> list[TaskState] | None:
    if not raw:
        return None
    out = []
    for name in raw.split(","):
        try:
            out.append(TaskState(name.strip()))
        except ValueError:
            known = ", ".join(s.value for s in TaskState)
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"query 'state': {name!r} is not a task state; use {known}",
                field="state",
            ) from None
    return out


def query_limit(raw: str | None) -> int:
    if raw is None:
        return 100
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT, "query 'limit' must be a number 1-1000", field="limit"
        )
    return int(raw)


def _flag(request: Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("1", "true", "yes", "0", "false", "no"):
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"query {name!r} must be true or false")
    return raw in ("1", "true", "yes")


def _running(record: TaskRecord, what: str) -> str:
    """The worker of a running task, or why `what` cannot be done now. A starting task is let
    through to its worker, which knows best whether the container runs yet: its first output
    can reach a user before the record says running."""
    if record.state not in ACTIVE_ON_WORKER or record.worker is None:
        hint = "wait until it runs" if not record.state.terminal else "it has ended"
        raise ApiError(
            ErrorCode.FAILED_PRECONDITION,
            f"task {record.id} is {record.state.value}; {what} needs it running ({hint})",
        )
    return record.worker


def undeclared_port(
    task_id: str, ports: tuple[int, ...], port: int, port_text: str | None = None
) -> str | None:
    """Why `port` of the task may not be reached: it is not one of the `ports` its spec
    declared, which are all its worker lets through. None when it is. Pure."""
    if port in ports:
        return None
    declared = ", ".join(map(str, ports)) or "none"
    return (
        f"task {task_id} declares no port {port_text or port} (its ports: {declared}); "
        "declare it with --port when running the task"
    )


@attrs.define
class _LogCursor:
    """Where a log stream is: the lines sent, and what the worker's stream did last."""

    sent: int = 0
    whole: bool = False
    """The worker's stream ran to the end of the container's log: nothing is missing."""
    kept_by: float | None = None
    """Until when the kept log is waited for, once the task ended."""
    then: str = "streamed"
    """After a pass over the worker's stream: `streamed` (it ended), `again` (ask again) or
    `stop` (nothing more to send)."""


class TaskRoutes:
    """The task routes over `dispatcher` (its store, its workspaces, its workers); endpoint
    requests go through `proxy`. `allow_local_registries`: some pool pulls from registries on
    its nodes (images on loopback addresses pass here)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        proxy: EndpointProxy,
        *,
        allow_local_registries: bool = False,
    ) -> None:
        self.dispatcher = dispatcher
        self.store = dispatcher.store
        self.proxy = proxy
        self.allow_local_registries = allow_local_registries
        self.guard = TenantGuard()

    def add_to(self, router: Router) -> Dialer:
        """Adds the task routes; returns the CONNECT dialer for box ports."""
        limited = self._limited
        router.add("POST", "/v1/tasks", limited(self.create))
        router.add("GET", "/v1/tasks", limited(self.list_tasks))
        router.add("GET", "/v1/tasks/{id}", limited(self.get))
        router.add("GET", "/v1/tasks/{id}/wait", limited(self.wait))
        router.add("POST", "/v1/tasks/{id}/cancel", limited(self.cancel))
        router.add("POST", "/v1/tasks/{id}/snapshot", limited(self.snapshot))
        router.add("GET", "/v1/tasks/{id}/logs", limited(self.logs))
        router.add_websocket("/v1/tasks/{id}/exec", self.exec_)
        for method in HTTP_METHODS:
            router.add(method, "/v1/tasks/{id}/ports/{port}/{path...}", self.endpoint)
        return self.dial

    def _limited(
        self, handler: Callable[[Request], Awaitable[R]]
    ) -> Callable[[Request], Awaitable[R]]:
        """The handler, after the caller's token took a request from its bucket."""

        async def admitted(request: Request) -> R:
            workspace = workspace_of(request.principal)
            limits = self.dispatcher.workspaces.limits(workspace)
            self.guard.admit(_token_of(request), limits, trio.current_time())
            return await handler(request)

        return admitted

    async def create(self, request: Request) -> JsonResponse:
        workspace = workspace_of(request.principal)
        asked = await request.json(TaskRequest)
        volumes = self.dispatcher.workspaces.volumes(workspace, asked.volumes)
        spec = spec_of(asked, volumes, allow_local_registries=self.allow_local_registries)
        limits = self.dispatcher.workspaces.limits(workspace)
        refused = spec_refusal(spec, limits)
        if refused is not None:
            raise refused
        record = await self.store.create(
            workspace, spec, admit=lambda active: active_tasks_refusal(active, limits)
        )
        log.info(
            "task %s created in workspace %s (%s)",
            record.id,
            workspace,
            asked.image,
            extra={
                "task": record.id,
                "workspace": workspace,
                "image": asked.image,
                "cards": asked.cards,
            },
        )
        self.dispatcher.wake()
        return JsonResponse(self.dispatcher.view(record), status=201)

    async def list_tasks(self, request: Request) -> TaskList | StreamResponse:
        workspace = workspace_of(request.principal)
        states = query_states(request.query.get("state"))
        limit = query_limit(request.query.get("limit"))
        before = request.query.get("before") or None

        async def page() -> TaskList:
            records = await self.store.list(workspace, states, limit + 1, before)
            views = tuple(self.dispatcher.view(r) for r in records[:limit])
            return TaskList(views, next=views[-1].id if len(records) > limit else None)

        if _flag(request, "watch"):
            limits = self.dispatcher.workspaces.limits(workspace)
            slot = self.guard.watch(_token_of(request), limits)
            await page()  # a wrong cursor is refused before the stream starts
            return watch_list(page, self.dispatcher.wait_changed, slot)
        return await page()

    async def get(self, request: Request) -> TaskView | StreamResponse:
        workspace = workspace_of(request.principal)
        task_id = request.params["id"]

        async def one() -> TaskView:
            return self.dispatcher.view(await self.store.get(workspace, task_id))

        if _flag(request, "watch"):
            limits = self.dispatcher.workspaces.limits(workspace)
            slot = self.guard.watch(_token_of(request), limits)
            await one()  # NOT_FOUND before the stream starts
            return watch_value(
                one, self.dispatcher.wait_changed, lambda view: view.state.terminal, slot
            )
        return await one()

    async def wait(self, request: Request) -> TaskView:
        workspace = workspace_of(request.principal)
        ended = await self.dispatcher.wait_ended(workspace, request.params["id"])
        return self.dispatcher.view(ended)

    async def cancel(self, request: Request) -> TaskView:
        workspace = workspace_of(request.principal)
        return self.dispatcher.view(await self.dispatcher.cancel(workspace, request.params["id"]))

    async def snapshot(self, request: Request) -> JsonResponse:
        workspace = workspace_of(request.principal)
        taken: TaskSnapshot = await self.dispatcher.snapshot(workspace, request.params["id"])
        return JsonResponse(taken, status=201)

    async def logs(self, request: Request) -> StreamResponse:
        workspace = workspace_of(request.principal)
        task_id = request.params["id"]
        follow = _flag(request, "follow")
        await self.store.get(workspace, task_id)  # NOT_FOUND before the stream starts
        return StreamResponse(
            lambda: self._log_lines(workspace, task_id, follow),
            content_type="application/x-ndjson",
        )

    async def _log_lines(
        self, workspace: str, task_id: str, follow: bool
    ) -> AsyncGenerator[bytes, None]:
        """The task's log from its worker while it runs, then from the kept log, without
        repeating a line; followed through pending and to the end with `follow`."""
        cursor = _LogCursor()
        while True:
            record = await self.store.get(workspace, task_id)
            if record.state.terminal:
                rest = await self._kept_rest(record, cursor)
                if rest is None:
                    continue
                if rest:
                    yield rest
                return
            if record.state is TaskState.PENDING or record.worker is None:
                if not follow:
                    return
                with trio.move_on_after(SCHEDULE_EVERY_S):
                    await self.dispatcher.wait_changed()
                continue
            lines = self._worker_lines(record, record.worker, cursor, follow)
            async with contextlib.aclosing(lines):
                async for line in lines:
                    yield line
            if cursor.then == "again":
                continue
            if cursor.then == "stop" or not follow:
                return
            cursor.whole = True
            # The container ended; the kept log holds anything written after our stream.
            await self.dispatcher.wait_ended(workspace, task_id)

    async def _kept_rest(self, record: TaskRecord, cursor: _LogCursor) -> bytes | None:
        """The ended task's kept log past what was sent; None after waiting a moment for a
        log still being kept."""
        kept = await self.store.logs(record.workspace, record.id)
        if cursor.kept_by is None:
            cursor.kept_by = trio.current_time() + CLEANUP_S
        if kept is None and (
            self.dispatcher.watching(record.id)
            or (not cursor.whole and _log_to_keep(record) and trio.current_time() < cursor.kept_by)
        ):
            # Its watcher, here or on another replica, is still keeping the log (it is told
            # when it is kept); a stream that broke before the end takes the rest from it.
            with trio.move_on_after(SCHEDULE_EVERY_S):
                await self.dispatcher.wait_changed()
            return None
        return b"".join((kept or b"").splitlines(keepends=True)[cursor.sent :])

    async def _worker_lines(
        self, record: TaskRecord, worker: str, cursor: _LogCursor, follow: bool
    ) -> AsyncGenerator[bytes, None]:
        """One pass over the worker's log stream, skipping the lines already sent; sets
        `cursor.then`."""
        cursor.then = "again"
        try:
            with trio.fail_after(self.dispatcher.lost_after_s):
                client = await self.dispatcher.registry.client_for(worker)
            seen = 0
            async with contextlib.aclosing(
                client.container_logs(record.id, follow=follow)
            ) as source:
                async for line in source:
                    seen += 1
                    if seen <= cursor.sent:
                        continue
                    cursor.sent += 1
                    yield dumps(line) + b"\n"
        except ApiError as exc:
            if exc.code is ErrorCode.NOT_FOUND:
                # Not created yet, or already deleted once the task ended.
                if not follow and record.state is TaskState.STARTING:
                    cursor.then = "stop"
                    return
                # Asked again once the task moves (it is recorded running as soon as its
                # container runs), and at least this often.
                with trio.move_on_after(NOT_STARTED_RETRY_S):
                    await self.dispatcher.wait_changed()
                return
            if exc.code is not ErrorCode.UNAVAILABLE:
                raise
            await trio.sleep(NOT_STARTED_RETRY_S * 10)
            return
        except trio.TooSlowError:
            raise ApiError(
                ErrorCode.UNAVAILABLE,
                f"the worker of task {record.id} is unreachable; try again later",
            ) from None
        cursor.then = "streamed"

    async def exec_(self, request: Request, ws: H2WebSocket) -> None:
        try:
            workspace = workspace_of(request.principal)
            record = await self.store.get(workspace, request.params["id"])
            worker = _running(record, "exec")
            upstream = await self.dispatcher.on_worker(worker, lambda c: c.open_exec(record.id))
        except (ApiError, WorkerLost) as exc:
            error = exc if isinstance(exc, ApiError) else ApiError(ErrorCode.UNAVAILABLE, str(exc))
            with contextlib.suppress(WebSocketClosed):
                await ws.send_message(dumps(error.to_body()).decode())
                await ws.aclose(1008, error.message[:120])
            return
        try:
            await relay(ws, upstream)
        finally:
            await upstream.aclose()

    async def endpoint(self, request: Request) -> StreamResponse | BytesResponse:
        workspace = workspace_of(request.principal)
        record = await self.dispatcher.running_record(workspace, request.params["id"])
        port_text = request.params["port"]
        port = int(port_text) if port_text.isdigit() else 0
        refused = undeclared_port(record.id, record.spec.ports, port, port_text)
        if refused is not None:
            raise ApiError(ErrorCode.NOT_FOUND, refused)
        worker = _running(record, "its endpoint")
        raw = request.path + (f"?{request.raw_query}" if request.raw_query else "")
        target = upstream_target(raw, strip_segments=5)

        async def open_stream(first: bytes) -> trio.abc.HalfCloseableStream:
            try:
                return await self.dispatcher.on_worker(
                    worker, lambda c: c.connect_tcp(record.id, port, first=first)
                )
            except WorkerLost as exc:
                raise ApiError(ErrorCode.UNAVAILABLE, str(exc)) from None

        return await self.proxy.forward(
            request, key=(worker, record.id, port), target=target, open_stream=open_stream
        )

    async def dial(self, host: str, port: int, principal: str) -> trio.abc.HalfCloseableStream:
        """A box port: a CONNECT to `host` (the task id) and `port`, one the task declared."""
        workspace = workspace_of(principal)
        record = await self.dispatcher.running_record(workspace, host)
        refused = undeclared_port(record.id, record.spec.ports, port)
        if refused is not None:
            raise ApiError(ErrorCode.PERMISSION_DENIED, refused, field=":authority")
        worker = _running(record, "a port")
        try:
            return await self.dispatcher.on_worker(
                worker, lambda c: c.connect_tcp_early(record.id, port)
            )
        except WorkerLost as exc:
            raise ApiError(ErrorCode.UNAVAILABLE, str(exc)) from None


def _token_of(request: Request) -> str:
    # A dashboard session (no bearer token) counts under its workspace.
    return token_key(bearer_token(request.headers), request.principal)


async def relay(a: H2WebSocket, b: H2WebSocket) -> None:
    """Carry messages both ways until either side closes."""

    async def pump(src: H2WebSocket, dst: H2WebSocket) -> None:
        with contextlib.suppress(WebSocketClosed, trio.BrokenResourceError):
            while True:
                await dst.send_message(await src.receive_message())
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, a, b)
        nursery.start_soon(pump, b, a)
