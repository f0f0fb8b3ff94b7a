"""The controlplane's public endpoint: one TLS listener, two protocols chosen by ALPN.

- `h2`: the controlplane API (CLI, scripts, workers registering), served by the same
  `agent.service.Service` machinery the worker uses, with the controlplane's own routes.
- `http/1.1`: a worker's tunnel. The WebSocket upgrade to `/v1/workers/<id>/tunnel` is
  authenticated with that worker's token BEFORE it is accepted (401 otherwise, and no HTTP/2
  is ever spoken); then HTTP/2 runs inside the WebSocket with the controlplane as the client,
  and the registry hands that client out for the worker.
"""

from __future__ import annotations

import hmac
import logging
import ssl
from collections.abc import Mapping, Sequence

import attrs
import trio
import trio_websocket

from agent.client import WorkerClient
from agent.connection import Http2Connection, KeepaliveConfig
from agent.models import ApiError, ErrorCode, Registration, WorkerInfo, WorkerSummary
from agent.service import JsonResponse, Request, Router, Service, bearer_token
from agent.tls import TLSStream
from agent.wsstream import WebSocketStream, wrap_server
from control.config import ControlConfig
from control.dispatch import Dispatcher
from control.endpoints import EndpointProxy
from control.kube import open_kube_client
from control.pools import PoolConfig, load_pools
from control.reconciler import PoolReconciler
from control.registry import WorkerRegistry
from control.task_routes import WORKSPACE_PREFIX, add_task_routes
from control.tasks import open_task_store
from control.workspaces import Workspaces

REMOVE_POOL_S = 60.0
"""How long a removed pool's Jobs may take to delete before its loop stops anyway."""

log = logging.getLogger("levers9.control")

WORKER_CALL_TIMEOUT_S = 30.0


@attrs.frozen
class WorkerList:
    workers: tuple[WorkerSummary, ...]


def server_ssl_context(config: ControlConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.tls.cert_file, config.tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ApiError(
            ErrorCode.FAILED_PRECONDITION,
            f"cannot load config.tls.certFile/keyFile ({config.tls.cert_file}): {exc}",
        ) from None
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


class Controlplane:
    def __init__(
        self, config: ControlConfig, registry: WorkerRegistry, dispatcher: Dispatcher
    ) -> None:
        self.config = config
        self.registry = registry
        self.dispatcher = dispatcher
        self.workspaces = dispatcher.workspaces
        self.proxy = EndpointProxy()

        async def forget_connections(task_id: str) -> None:
            await self.proxy.forget_where(lambda key: isinstance(key, tuple) and key[1] == task_id)

        dispatcher.on_ended.append(forget_connections)
        self._api_tokens = {t.token: t.name for t in config.api_tokens}
        self._pools: dict[str, _PoolRun] = {}
        self._nursery: trio.Nursery | None = None
        self.pool_env: Mapping[str, str] | None = None
        router = self._router()
        dial = add_task_routes(router, dispatcher, self.proxy)
        self.service = Service(router, authenticate=self._authenticate, dial=dial, name="control")
        self.port = 0
        self.keepalive = KeepaliveConfig(
            ping_interval_s=config.tunnel.ping_interval_s,
            ping_timeout_s=config.tunnel.ping_timeout_s,
        )

    def _authenticate(self, headers: dict[str, str]) -> str | None:
        token = bearer_token(headers)
        if token is None:
            return None
        api = None
        for known, name in self._api_tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                api = name
        if api is not None:
            return f"api:{api}"
        workspace = self.workspaces.authenticate(token)
        if workspace is not None:
            return f"{WORKSPACE_PREFIX}{workspace}"
        worker = self.registry.authenticate_worker(token)
        return f"worker:{worker}" if worker is not None else None

    def _router(self) -> Router:
        router = Router()

        def require_api(request: Request) -> None:
            if not request.principal.startswith("api:"):
                raise ApiError(
                    ErrorCode.PERMISSION_DENIED, "this call needs an operator token (apiTokens)"
                )

        def require_user(request: Request) -> None:
            if not request.principal.startswith(("api:", WORKSPACE_PREFIX)):
                raise ApiError(ErrorCode.PERMISSION_DENIED, "this call needs an API token")

        async def register(request: Request) -> WorkerSummary:
            worker_id = request.params["worker_id"]
            if request.principal != f"worker:{worker_id}":
                raise ApiError(
                    ErrorCode.PERMISSION_DENIED, f"this token may not register worker {worker_id}"
                )
            registration = await request.json(Registration)
            if registration.worker_id != worker_id:
                raise ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"workerId {registration.worker_id!r} does not match the path's {worker_id!r}",
                    field="workerId",
                )
            self.registry.register(registration)
            return next(w for w in self.registry.list() if w.worker_id == worker_id)

        async def deregister(request: Request) -> JsonResponse:
            worker_id = request.params["worker_id"]
            if request.principal != f"worker:{worker_id}":
                raise ApiError(
                    ErrorCode.PERMISSION_DENIED,
                    f"this token may not deregister worker {worker_id}",
                )
            if self.dispatcher.has_tasks(worker_id):
                raise ApiError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"worker {worker_id} has tasks placed on it; it stays",
                )
            self.registry.deregister(worker_id)
            log.info("worker %s deregistered: it winds down", worker_id)
            return JsonResponse({})

        async def list_workers(request: Request) -> WorkerList:
            require_api(request)
            return WorkerList(tuple(self.registry.list()))

        async def get_worker(request: Request) -> WorkerInfo:
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

        async def list_machines(request: Request) -> JsonResponse:
            require_user(request)
            return JsonResponse(
                {
                    "machines": [m.to_json() for r in self.pools for m in r.status.machines],
                    "pools": [
                        {
                            "pool": r.status.pool,
                            "passedAt": r.status.passed_at,
                            "error": r.status.error,
                            "skipped": [
                                {"node": n.node, "reason": n.reason} for n in r.status.skipped
                            ],
                        }
                        for r in self.pools
                    ],
                }
            )

        router.add("GET", "/v1/machines", list_machines)
        router.add("POST", "/v1/workers/{worker_id}/register", register)
        router.add("POST", "/v1/workers/{worker_id}/deregister", deregister)
        router.add("GET", "/v1/workers", list_workers)
        router.add("GET", "/v1/workers/{worker_id}", get_worker)
        return router

    @property
    def pools(self) -> list[PoolReconciler]:
        return [run.reconciler for run in self._pools.values() if run.reconciler is not None]

    async def set_pools(self, pools: Sequence[PoolConfig]) -> None:
        """Reconcile exactly these pools from now on: a new block starts, a changed one
        restarts, and a removed one has its Jobs and Secrets deleted (never the namespace,
        never a node) before its loop stops."""
        assert self._nursery is not None
        wanted = {pool.name: pool for pool in pools}
        for name, run in list(self._pools.items()):
            if wanted.get(name) != run.pool:
                run.remove = name not in wanted
                run.scope.cancel()
                await run.done.wait()
                del self._pools[name]
        for name, pool in wanted.items():
            if name not in self._pools:
                await self._nursery.start(self._run_pool, pool)

    async def _run_pool(
        self, pool: PoolConfig, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        run = _PoolRun(pool=pool)
        self._pools[pool.name] = run
        try:
            async with open_kube_client(pool) as kube:
                run.reconciler = PoolReconciler(
                    pool,
                    kube,
                    self.registry,
                    controlplane_url=self.config.public_url,
                    extra_env=self.pool_env,
                    on_worker_gone=self.dispatcher.worker_gone,
                )
                with run.scope:
                    await run.reconciler.run(task_status=task_status)
                if run.remove:
                    with trio.CancelScope(shield=True), trio.move_on_after(REMOVE_POOL_S):
                        try:
                            await run.reconciler.remove_all()
                        except ApiError as exc:
                            log.warning(
                                "pool %s: its workers could not be removed: %s", pool.name, exc
                            )
                    log.info("pool %s removed", pool.name)
        finally:
            run.done.set()

    async def handle_connection(self, tcp: trio.SocketStream, context: ssl.SSLContext) -> None:
        tls = TLSStream(tcp, context, server_side=True)
        try:
            with trio.fail_after(self.config.tunnel.handshake_timeout_s):
                await tls.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            log.info("TLS handshake failed: %s", exc)
            await tls.aclose()
            return
        if tls.selected_alpn_protocol() == "h2":
            conn = Http2Connection(tls, client_side=False, handler=self.service, name="api")
            await conn.run()
            return
        await self._accept_tunnel(tls)

    async def _accept_tunnel(self, tls: TLSStream) -> None:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(self.config.tunnel.handshake_timeout_s):
                    request = await wrap_server(nursery, tls)
            except (trio.BrokenResourceError, trio.TooSlowError, trio_websocket.HandshakeError):
                nursery.cancel_scope.cancel()
                await tls.aclose()
                return
            parts = request.path.split("?")[0].strip("/").split("/")
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
            token = bearer_token(headers)
            if len(parts) != 4 or parts[:2] != ["v1", "workers"] or parts[3] != "tunnel":
                await request.reject(404, body=b"no such endpoint\n")
                nursery.cancel_scope.cancel()
                return
            worker_id = parts[2]
            if token is None or not self.registry.check_token(worker_id, token):
                log.warning("tunnel for worker %s refused: wrong or missing token", worker_id)
                await request.reject(401, body=b"wrong or missing worker token\n")
                nursery.cancel_scope.cancel()
                return
            ws = await request.accept()
            conn = Http2Connection(
                WebSocketStream(ws, tls),
                client_side=True,
                keepalive=self.keepalive,
                name=f"tunnel {worker_id}",
            )
            await nursery.start(conn.run)
            client = WorkerClient(conn, token=token, authority=worker_id)
            self.registry.attach_tunnel(worker_id, client, version=headers.get("x-levers9-version"))
            log.info("worker %s connected through its tunnel", worker_id)
            nursery.start_soon(self._learn, worker_id, client)
            try:
                await conn.wait_closed()
            finally:
                self.registry.detach_tunnel(worker_id, client)
                log.info("tunnel of worker %s closed: %s", worker_id, conn.close_reason)
                nursery.cancel_scope.cancel()

    async def _learn(self, worker_id: str, client: WorkerClient) -> None:
        """Ask a newly tunnelled worker about itself (its cards, node, version)."""
        with trio.move_on_after(WORKER_CALL_TIMEOUT_S):
            try:
                info = await client.worker()
            except ApiError as exc:
                log.info("could not ask worker %s about itself: %s", worker_id, exc.message)
                return
            self.registry.learn(info)


@attrs.define(eq=False)
class _PoolRun:
    pool: PoolConfig
    reconciler: PoolReconciler | None = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    done: trio.Event = attrs.field(factory=trio.Event)
    remove: bool = False


async def serve_controlplane(
    config: ControlConfig,
    *,
    pool_env: Mapping[str, str] | None = None,
    task_status: trio.TaskStatus[Controlplane] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the public endpoint and reconcile every configured pool until cancelled;
    `started()` gives the `Controlplane`. `pool_env` is extra environment for every worker
    Job (e.g. the controlplane's CA for agents)."""
    context = server_ssl_context(config)
    pools = load_pools(config.worker.pools).pools
    async with open_task_store(config.database.path) as store, trio.open_nursery() as nursery:
        registry = WorkerRegistry(
            {t.worker_id: t.token for t in config.worker.tokens},
            nursery,
            keepalive=KeepaliveConfig(
                ping_interval_s=config.tunnel.ping_interval_s,
                ping_timeout_s=config.tunnel.ping_timeout_s,
            ),
        )
        dispatcher = Dispatcher(
            store,
            registry,
            Workspaces(config.workspaces),
            lost_after_s=config.worker.lost_after_s,
        )
        control = Controlplane(config, registry, dispatcher)
        control.pool_env = pool_env
        control._nursery = nursery
        listeners = await trio.open_tcp_listeners(config.listen_port, host=config.listen_host)
        port = int(listeners[0].socket.getsockname()[1])
        control.port = port

        async def handle(tcp: trio.SocketStream) -> None:
            await control.handle_connection(tcp, context)

        await nursery.start(dispatcher.run)
        await nursery.start(trio.serve_listeners, handle, listeners)
        log.info("controlplane listening on %s:%d", config.listen_host, port)
        await control.set_pools(pools)
        task_status.started(control)
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await control.proxy.aclose()
