"""The controlplane's public endpoint: one TLS listener, two protocols chosen by ALPN.

- `h2`: the controlplane API (CLI, scripts, workers registering), served by the same
  `wire.service.Service` machinery the worker uses, with the controlplane's own routes.
- `http/1.1`: a worker's tunnel. The WebSocket upgrade to `/v1/workers/<id>/tunnel` is
  authenticated with that worker's token BEFORE it is accepted (401 otherwise, and no HTTP/2
  is ever spoken); then HTTP/2 runs inside the WebSocket with the controlplane as the client,
  and the registry hands that client out for the worker.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
import ssl
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from control.api.endpoints import EndpointProxy
from control.api.tasks import WORKSPACE_PREFIX, add_task_routes
from control.config import ControlConfig
from control.kube.adapter import open_kube_client
from control.kube.caches import Clusters, PoolCluster
from control.kube.joined import JoinedPoolStore, own_cluster
from control.kube.lease import LeaderElector, default_identity, election_settings, lease_cluster
from control.kube.loop import PoolReconciler, PoolStatus
from control.kube.planner import Machine
from control.kube.pools import PoolConfig, load_pools
from control.metrics import ControlMetrics
from control.models import (
    CardCounts,
    MachineList,
    MachineView,
    MachineWorker,
    PoolList,
    PoolPass,
    PoolView,
    SkippedNode,
    WorkerList,
    WorkerState,
)
from control.tasks.dispatch import Dispatcher
from control.tasks.scheduler import MachineSize, Retire
from control.tasks.store import open_task_store
from control.ui.pages import add_ui_routes, error_headers
from control.ui.session import (
    SessionLimits,
    cookie_allowed,
    cookie_session,
    csrf_refusal,
    origin_refusal,
)
from control.ui.sessions import SessionStore
from control.workers.directory import Directory
from control.workers.forward import Peers, is_forwarded, serve_forwarded
from control.workers.registry import Replication, WorkerRegistry
from control.workspaces import Workspaces
from wire.admission import (
    Admission,
    Admissions,
    ConnectionLimits,
    ConnectionLog,
    Refusal,
    source_address,
)
from wire.connection import ConnectionLost, H2Stream, Http2Connection, KeepaliveConfig
from wire.errors import ApiError, ErrorCode, decode_json
from wire.metrics import render as render_metrics
from wire.metrics import serve_metrics
from wire.service import (
    BytesResponse,
    JsonResponse,
    Request,
    Router,
    Service,
    bearer_token,
)
from wire.tls import TLSStream, fingerprint_of_pem
from wire.untrusted import clip
from wire.wsstream import HandshakeError, read_upgrade
from workerapi.client import WorkerClient
from workerapi.models import Registration, WorkerInfo, WorkerSummary

REMOVE_POOL_S = 60.0
"""How long a removed pool's Jobs may take to delete before its loop stops anyway."""

log = logging.getLogger("levers9.control")

WORKER_CALL_TIMEOUT_S = 30.0


def connection_limits(config: ControlConfig) -> ConnectionLimits:
    """The public endpoint's limits: `config.connections`, with the TLS handshake timeout of
    `config.tunnel.handshakeTimeoutS` (which has always covered every connection's)."""
    settings = config.connections
    return ConnectionLimits(
        max_per_source=settings.max_per_source,
        max_total=settings.max_total,
        handshake_timeout_s=config.tunnel.handshake_timeout_s,
        first_request_timeout_s=settings.first_request_timeout_s,
        idle_timeout_s=settings.idle_timeout_s,
    )


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
        dispatcher.machines = self.machine_sizes
        dispatcher.retire = self.retire_worker
        self._api_tokens = {t.token: t.name for t in config.api_tokens}
        self._signed_in = frozenset(
            {f"api:{t.name}" for t in config.api_tokens}
            | {f"{WORKSPACE_PREFIX}{w.name}" for w in config.workspaces if w.tokens}
        )
        """The principals a dashboard session may stand for: one whose tokens are gone from
        the config (this replica's) has its sessions refused."""
        self.sessions = SessionStore(
            dispatcher.store.database,
            SessionLimits(config.dashboard.session_max_s, config.dashboard.session_idle_s),
        )
        self._pools: dict[str, _PoolRun] = {}
        self.config_pools: tuple[PoolConfig, ...] = ()
        self.joined: JoinedPoolStore | None = None
        self._pools_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._clusters: Clusters | None = None
        self._connections: set[Http2Connection] = set()
        self._listening = trio.CancelScope()
        self._listeners: list[trio.SocketListener] = []
        self.draining = False
        """Set once `drain` began: no connection is taken any more."""
        self.pool_env: Mapping[str, str] | None = None
        self.identity = (
            registry.replication.replica
            if registry.replication is not None
            else config.leader_election.identity or default_identity()
        )
        """This replica's name in the pools' Leases (`config.leaderElection`) and in the
        directory of replicas."""
        self.replica_secret = replica_secret(config)
        self.metrics = ControlMetrics(self.identity)
        registry.on_connection = self.metrics.connection
        dispatcher.on_placed.append(self.metrics.placed)
        router = self._router()
        dial = add_task_routes(
            router,
            dispatcher,
            self.proxy,
            allow_local_registries=config.worker.allows_local_registries(),
        )
        add_ui_routes(router, self._principal_of, self.sessions, title="levers9")
        self.service = Service(
            router,
            authenticate=self._authenticate,
            dial=dial,
            name="control",
            observe=self.metrics.request,
            authenticate_session=self._session_principal,
            error_headers=error_headers,
        )
        self.port = 0
        self.metrics_port: int | None = None
        """The plain-HTTP metrics listener's port (`config.metrics.listen`), once it listens."""
        self.limits = connection_limits(config)
        self.admissions = Admissions(self.limits)
        self._early = ConnectionLog()
        self.keepalive = KeepaliveConfig(
            ping_interval_s=config.tunnel.ping_interval_s,
            ping_timeout_s=config.tunnel.ping_timeout_s,
        )

    def _authenticate(self, headers: dict[str, str]) -> str | None:
        token = bearer_token(headers)
        return None if token is None else self._principal_of(token)

    async def _session_principal(self, headers: dict[str, str]) -> str | None:
        """Who the request's dashboard session stands for, when it has no bearer token: None
        for no cookie, a cookie where none is taken, or a session ended, expired or of a
        principal no longer configured (the dashboard then sends the browser to sign in
        again). A state-changing request under `/ui/` must come from our origin whether or
        not it has a cookie, and one authenticated by the cookie needs the CSRF value."""
        method, path = headers.get(":method", ""), _request_path(headers)
        if path == "/ui" or path.startswith("/ui/"):
            refused = origin_refusal(headers)
            if refused is not None:
                raise ApiError(ErrorCode.PERMISSION_DENIED, refused)
        session_id = cookie_session(headers)
        if session_id is None or not cookie_allowed(method, path):
            return None
        principal = await self.sessions.principal(session_id)
        if principal is None or principal not in self._signed_in:
            return None
        refused = csrf_refusal(headers, session_id)
        if refused is not None:
            raise ApiError(ErrorCode.PERMISSION_DENIED, refused)
        return principal

    def _principal_of(self, token: str) -> str | None:
        """Who a token stands for: `api:NAME` (an operator), `ws:NAME` (a workspace),
        `worker:ID`, or None."""
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
            await self.registry.register(registration)
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
            await self.registry.deregister(worker_id)
            log.info(
                "worker %s deregistered: it winds down", worker_id, extra={"worker": worker_id}
            )
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

        async def list_machines(request: Request) -> MachineList:
            require_user(request)
            return machine_list([r.status for r in self.pools], self.dispatcher.busy_cards())

        def joined_store() -> JoinedPoolStore:
            if self.joined is None:
                raise ApiError(
                    ErrorCode.FAILED_PRECONDITION,
                    "this controlplane keeps no joined pools (config.joinedPools is not set, "
                    "or its store could not be read yet); add the pool's block to "
                    "config.worker.pools instead",
                )
            return self.joined

        def refuse_configured(name: str, advice: str) -> None:
            if any(pool.name == name for pool in self.config_pools):
                raise ApiError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"pool {name} comes from config.worker.pools; {advice}",
                    field="name",
                )

        async def list_pools(request: Request) -> PoolList:
            require_api(request)
            return PoolList(tuple(self.pool_views()), joined_pools=self.joined is not None)

        async def put_pool(request: Request) -> PoolView:
            require_api(request)
            name = request.params["name"]
            refuse_configured(name, "change it in the values, or join under another name")
            block = _json_mapping(await request.body())
            if block.get("name", name) != name:
                raise ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"name {block.get('name')!r} does not match the path's {name!r}",
                    field="name",
                )
            store = joined_store()
            kept = store.blocks.get(name, {}).get("kubernetes", {})
            given = block.get("kubernetes")
            if (
                kept
                and isinstance(given, Mapping)
                and kept.get("endpoint") != given.get("endpoint")
            ):
                raise ApiError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"pool {name} is joined from {kept.get('endpoint')}; another cluster needs "
                    f"another name, or `levers9 cluster leave {name}` first",
                    field="kubernetes.endpoint",
                )
            async with self._pools_lock:
                pool = await store.put({**block, "name": name})
                await self.set_pools([*self.config_pools, *store.pools()])
            log.info(
                "pool %s joined (%s)",
                name,
                pool.kubernetes.endpoint,
                extra={"pool": name, "endpoint": pool.kubernetes.endpoint},
            )
            return next(v for v in self.pool_views() if v.name == name)

        async def delete_pool(request: Request) -> PoolView:
            require_api(request)
            name = request.params["name"]
            refuse_configured(name, "delete its block from the values and deploy")
            store = joined_store()
            views = [v for v in self.pool_views() if v.name == name]
            if not views:
                raise ApiError(ErrorCode.NOT_FOUND, f"no joined pool named {name}")
            async with self._pools_lock:
                await store.remove(name)
                await self.set_pools([*self.config_pools, *store.pools()])
            log.info("pool %s left: its workers were removed", name, extra={"pool": name})
            return views[0]

        router.add("GET", "/v1/pools", list_pools)
        router.add("PUT", "/v1/pools/{name}", put_pool)
        router.add("DELETE", "/v1/pools/{name}", delete_pool)
        router.add("GET", "/v1/machines", list_machines)
        router.add("POST", "/v1/workers/{worker_id}/register", register)
        router.add("POST", "/v1/workers/{worker_id}/deregister", deregister)
        router.add("GET", "/v1/workers", list_workers)
        router.add("GET", "/v1/workers/{worker_id}", get_worker)

        async def metrics(request: Request) -> BytesResponse:
            require_api(request)
            await self.refresh_metrics()
            body, content_type = render_metrics(
                self.metrics.registry, request.headers.get("accept", "")
            )
            return BytesResponse(body, content_type)

        router.add("GET", "/metrics", metrics)
        return router

    async def refresh_metrics(self) -> None:
        """Read the states `/metrics` reports (the records' counts first: the rest is in
        memory)."""
        counts = await self.dispatcher.store.count_by_state()
        tunnels = sum(
            1 for e in self.registry.entries() if e.tunnel is not None and e.tunnel.conn.usable
        )
        self.metrics.refresh(
            counts,
            machine_list([r.status for r in self.pools], self.dispatcher.busy_cards()),
            self.registry.list(),
            tunnels,
        )

    def pool_views(self) -> list[PoolView]:
        joined = set(self.joined.blocks) if self.joined is not None else set()
        views = []
        for name, run in sorted(self._pools.items()):
            kube = run.pool.kubernetes
            status = run.reconciler.status if run.reconciler is not None else None
            views.append(
                PoolView(
                    name=name,
                    source="joined" if name in joined else "config",
                    flavor=kube.flavor.value,
                    endpoint=kube.endpoint,
                    namespace=kube.namespace,
                    selector=kube.selector.label_selector(),
                    tunnel=kube.tunnel,
                    host_network=kube.host_network,
                    image=kube.image,
                    machines=len(status.machines) if status is not None else 0,
                    error=status.problem() if status is not None else None,
                    leader=run.elector.holder if run.elector is not None else None,
                )
            )
        return views

    async def set_config_pools(self, pools: Sequence[PoolConfig]) -> None:
        """The configured pools changed (start-up or SIGHUP); joined pools stay, except one
        whose name a configured pool now takes."""
        async with self._pools_lock:
            self.config_pools = tuple(pools)
            names = {pool.name for pool in pools}
            joined = self.joined.pools() if self.joined is not None else []
            for pool in joined:
                if pool.name in names:
                    log.warning(
                        "joined pool %s is shadowed by config.worker.pools[%s]",
                        pool.name,
                        pool.name,
                        extra={"pool": pool.name},
                    )
            await self.set_pools([*pools, *(p for p in joined if p.name not in names)])

    async def keep_joined_pools(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Open the joined-pool store in the controlplane's own cluster and start the pools it
        keeps. Started once the first read is done, or has failed: then it is retried while
        the configured pools and the API already run."""
        settings = self.config.joined_pools
        assert settings is not None
        own, namespace = own_cluster(settings)
        async with open_kube_client(own) as kube:
            store = JoinedPoolStore(kube, namespace)
            delay_s = 1.0
            while True:
                try:
                    await store.load()
                    break
                except ApiError as exc:
                    # The first failure does not hold up the configured pools and the API.
                    task_status.started()
                    task_status = trio.TASK_STATUS_IGNORED
                    log.warning(
                        "joined pools: cannot read them from namespace %s, retrying in %g s: %s",
                        namespace,
                        delay_s,
                        exc.message,
                        extra={"namespace": namespace, "retry_in_s": delay_s},
                    )
                await trio.sleep(delay_s)
                delay_s = min(delay_s * 2, 30.0)
            self.joined = store
            log.info(
                "joined pools: %d kept in namespace %s",
                len(store.blocks),
                namespace,
                extra={"namespace": namespace, "pools": len(store.blocks)},
            )
            await self.set_config_pools(self.config_pools)
            task_status.started()
            await trio.sleep_forever()

    def machine_sizes(self) -> list[MachineSize]:
        """Every machine the pools this replica reconciles saw last, with all its cards."""
        return [
            MachineSize(
                pool=m.pool,
                node=m.node,
                cards=m.cards.total,
                free=m.cards.free,
                worker=m.worker.name if m.worker is not None else "",
            )
            for r in self.pools
            for m in r.status.machines
        ]

    def retire_worker(self, retire: Retire) -> bool:
        """Have the pool that runs this idle worker delete it now (the dispatcher's choice);
        False when no pool of this replica does."""
        for reconciler in self.pools:
            if reconciler.settings.name == retire.pool:
                reconciler.retire(retire.worker_id, retire.why)
                return True
        return False

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
            if self.config.leader_election.enabled:
                await self._run_elected_pool(run, task_status)
                return
            assert self._clusters is not None
            async with self._clusters.use(pool) as cluster:
                run.reconciler = self._reconciler(pool, cluster)
                with run.scope:
                    await run.reconciler.run(task_status=task_status)
                if run.remove:
                    await self._remove_workers(run.reconciler)
        finally:
            run.done.set()

    def _reconciler(self, pool: PoolConfig, cluster: PoolCluster) -> PoolReconciler:
        return PoolReconciler(
            pool,
            cluster,
            self.registry,
            controlplane_url=self.config.public_url,
            extra_env=self.pool_env,
            on_worker_gone=self.dispatcher.worker_gone,
            on_pass=self.metrics.reconcile_pass,
        )

    async def _remove_workers(self, reconciler: PoolReconciler) -> None:
        """A pool removed from the config: its Jobs and Secrets go (shielded, bounded)."""
        name = reconciler.settings.name
        with trio.CancelScope(shield=True), trio.move_on_after(REMOVE_POOL_S):
            try:
                await reconciler.remove_all()
            except ApiError as exc:
                log.warning(
                    "pool %s: its workers could not be removed: %s",
                    name,
                    exc,
                    extra={"pool": name},
                )
        log.info("pool %s removed", name, extra={"pool": name})

    async def _run_elected_pool(self, run: _PoolRun, task_status: trio.TaskStatus[None]) -> None:
        """`config.leaderElection`: the pool is reconciled here only while this replica holds
        its Lease, and until then its view names the replica that does. A pool removed from
        the config (or changed) releases its Lease, once its workers are deleted when this
        replica led it."""
        election, pool = self.config.leader_election, run.pool
        own, namespace = lease_cluster(election, pool=pool.name)
        settings = election_settings(
            election, pool=pool.name, identity=self.identity, namespace=namespace
        )
        async with open_kube_client(own) as leases:
            run.elector = LeaderElector(leases, settings, pool=pool.name)
            task_status.started()
            with run.scope:
                await run.elector.run(lambda: self._lead_pool(run))

    async def _lead_pool(self, run: _PoolRun) -> None:
        """Reconciles while this replica leads; cancelled when it stops leading."""
        assert self._clusters is not None
        try:
            async with self._clusters.use(run.pool) as cluster:
                reconciler = run.reconciler = self._reconciler(run.pool, cluster)
                try:
                    await reconciler.run()
                finally:
                    if run.remove:
                        await self._remove_workers(reconciler)
        finally:
            run.reconciler = None

    async def drain(self, grace_s: float) -> None:
        """Stop as a replica being replaced should: take no more connections (the port closes,
        so the readiness probe fails and the Service stops sending here), send GOAWAY on every
        connection, tunnels included (their agents open the next tunnel at once, through the
        Service to another replica), and give what is in flight up to `grace_s` to finish. The
        caller then cancels the rest; the pools' Leases are released as their loops stop."""
        self.draining = True
        self._listening.cancel()
        for listener in self._listeners:
            await listener.aclose()
        connections = list(self._connections)
        log.info(
            "draining: the port is closed; GOAWAY on %d connection(s), up to %g s for what "
            "is in flight",
            len(connections),
            grace_s,
            extra={"connections": len(connections), "grace_s": grace_s},
        )
        started = trio.current_time()
        with trio.move_on_after(grace_s):
            async with trio.open_nursery() as nursery:
                for conn in connections:
                    nursery.start_soon(_drain_quietly, conn)
        left = sum(1 for conn in connections if not conn.closed and conn.statistics().open_streams)
        log.info(
            "drained in %.1f s; %d connection(s) still busy are cut",
            trio.current_time() - started,
            left,
            extra={"duration_s": round(trio.current_time() - started, 3), "connections": left},
        )

    async def handle_stream(self, stream: H2Stream) -> None:
        """A stream on the API listener: a request another replica forwards for a worker this
        one holds (`control.workers.forward`), or the API's."""
        worker = is_forwarded(stream.headers or [])
        if worker is None:
            await self.service(stream)
            return
        await serve_forwarded(
            stream, worker.decode("latin-1"), self.replica_secret, self._local_worker
        )

    async def _local_worker(self, worker_id: str) -> tuple[WorkerClient, str]:
        client = await self.registry.local_client(worker_id)
        entry = self.registry.entry(worker_id)
        assert entry is not None  # a local client means a local entry
        return client, entry.token

    async def keep_membership(
        self,
        advertise: str,
        fingerprint: str,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Several replicas: publish this one (its address and certificate) in the directory,
        renew its claims on workers and take those with tasks that nobody holds, every third
        of the lease; on the way out, leave (the workers it held are free at once)."""
        replication = self.registry.replication
        assert replication is not None
        period = replication.lease_s / 3
        failing: str | None = None
        try:
            while True:
                try:
                    now = time.time()
                    await replication.directory.heartbeat(
                        replication.replica, advertise, fingerprint, now + replication.lease_s
                    )
                    active = await self.dispatcher.store.active()
                    await self.registry.sync(claim={r.worker for r in active if r.worker})
                    failing = None
                except ApiError as exc:
                    if exc.message != failing:
                        log.warning(
                            "replica %s could not renew its place: %s",
                            replication.replica,
                            exc.message,
                            extra={"replica": replication.replica, "code": exc.code.name},
                        )
                    failing = exc.message
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                await trio.sleep(period)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await self.registry.leave()
                except ApiError as exc:
                    log.warning("leaving the directory failed: %s", exc.message)

    async def handle_connection(self, tcp: trio.SocketStream, context: ssl.SSLContext) -> None:
        """One accepted connection: counted against the limits first (closed at once, before
        TLS, when over one), then TLS, then the API (h2) or a tunnel (http/1.1)."""
        # Nothing awaits before the decision: a refused connection costs an accept and a close.
        try:
            source = source_address(tcp.socket.getpeername())
        except OSError:
            source = "unknown"
        admission = self.admissions.admit(source)
        if isinstance(admission, Refusal):
            self._early.refused(admission, trio.current_time())
            await tcp.aclose()
            return
        try:
            await self._serve_connection(tcp, context, admission)
        except Exception:
            # One connection's failure is that connection's: the listener, every other
            # connection and the process go on (they share the nursery it is served in).
            log.exception("connection from %s failed", source, extra={"source": source})
        finally:
            self.admissions.release(admission)

    async def _serve_connection(
        self, tcp: trio.SocketStream, context: ssl.SSLContext, admission: Admission
    ) -> None:
        source = admission.source
        peer = _peer(tcp)
        tls = TLSStream(tcp, context, server_side=True)
        try:
            with trio.fail_after(self.limits.handshake_timeout_s):
                await tls.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
            self._early.failed(peer, source, f"TLS handshake failed: {reason}", trio.current_time())
            await tls.aclose()
            return
        if tls.selected_alpn_protocol() == "h2":
            conn = Http2Connection(
                tls,
                client_side=False,
                settings=self.config.http2,
                handler=self.handle_stream,
                name="api",
                first_request_timeout_s=self.limits.first_request_timeout_s,
                idle_timeout_s=self.limits.idle_timeout_s,
            )
            self._connections.add(conn)
            try:
                with contextlib.suppress(ConnectionLost):
                    # Gone before it was ready (reset right after the handshake): nothing to
                    # serve.
                    await conn.run()
            finally:
                self._connections.discard(conn)
            closed = conn.close_reason
            if closed and not conn.closed_by_peer and conn.statistics().streams_opened == 0:
                self._early.failed(peer, source, closed, trio.current_time())
            return
        await self._accept_tunnel(tls, peer, admission)

    async def _accept_tunnel(self, tls: TLSStream, peer: str, admission: Admission) -> None:
        source = admission.source
        async with trio.open_nursery() as nursery:
            try:
                # The upgrade request is the connection's first: it comes at once or not at
                # all. Once it is in, the tunnel lives as long as its PINGs are answered.
                with trio.fail_after(self.limits.first_request_timeout_s):
                    request = await read_upgrade(tls)
            except (
                trio.BrokenResourceError,
                trio.TooSlowError,
                HandshakeError,
            ) as exc:
                if isinstance(exc, trio.TooSlowError):
                    reason = f"no request within {self.limits.first_request_timeout_s:g} s"
                else:
                    reason = f"WebSocket handshake failed: {clip(str(exc))}"
                self._early.failed(peer, source, reason, trio.current_time())
                nursery.cancel_scope.cancel()
                await tls.aclose()
                return
            parts = request.path.split("?")[0].strip("/").split("/")
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
            token = bearer_token(headers)
            if len(parts) != 4 or parts[:2] != ["v1", "workers"] or parts[3] != "tunnel":
                await request.reject(404, body=b"no such endpoint\n")
                await tls.aclose()
                nursery.cancel_scope.cancel()
                return
            worker_id = parts[2]
            if token is None or not self.registry.check_token(worker_id, token):
                log.warning(
                    "tunnel for worker %s refused: wrong or missing token",
                    clip(worker_id),
                    extra={"worker": clip(worker_id)},
                )
                await request.reject(401, body=b"wrong or missing worker token\n")
                await tls.aclose()
                nursery.cancel_scope.cancel()
                return
            try:
                ws = await request.accept()
            except trio.BrokenResourceError as exc:
                self._early.failed(
                    peer, source, f"tunnel closed while accepted: {exc}", trio.current_time()
                )
                nursery.cancel_scope.cancel()
                return
            self.admissions.vouch(admission)
            conn = Http2Connection(
                ws,
                client_side=True,
                settings=self.config.http2,
                keepalive=self.keepalive,
                name=f"tunnel {worker_id}",
            )
            try:
                await nursery.start(conn.run)
            except ConnectionLost as exc:
                # The WebSocket closed before HTTP/2 inside it was ready: the agent retries.
                self._early.failed(
                    peer, source, f"tunnel closed at once: {exc}", trio.current_time()
                )
                nursery.cancel_scope.cancel()
                return
            client = WorkerClient(conn, token=token, authority=worker_id)
            # Counted before anything awaits: a drain that begins meanwhile sends it a GOAWAY.
            self._connections.add(conn)
            try:
                try:
                    await self.registry.attach_tunnel(
                        worker_id, client, version=headers.get("x-levers9-version")
                    )
                except ApiError as exc:
                    # Its claim could not be recorded (the database is away): closed, so the
                    # agent opens its next tunnel, here or at another replica, in a moment.
                    log.warning(
                        "tunnel of worker %s closed: %s",
                        worker_id,
                        exc.message,
                        extra={"worker": worker_id, "code": exc.code.name},
                    )
                    await conn.aclose()
                    return
                log.info(
                    "worker %s connected through its tunnel",
                    worker_id,
                    extra={"worker": worker_id},
                )
                if self.draining:
                    nursery.start_soon(_drain_quietly, conn)
                nursery.start_soon(self._learn, worker_id, client)
                await conn.wait_closed()
            finally:
                self._connections.discard(conn)
                self.registry.detach_tunnel(worker_id, client)
                log.info(
                    "tunnel of worker %s closed: %s",
                    worker_id,
                    conn.close_reason,
                    extra={"worker": worker_id, "reason": conn.close_reason or "closed"},
                )
                nursery.cancel_scope.cancel()

    async def _learn(self, worker_id: str, client: WorkerClient) -> None:
        """Ask a newly tunnelled worker about itself (its cards, node, version)."""
        with trio.move_on_after(WORKER_CALL_TIMEOUT_S):
            try:
                info = await client.worker()
            except ApiError as exc:
                log.info(
                    "could not ask worker %s about itself: %s",
                    worker_id,
                    exc.message,
                    extra={"worker": worker_id, "code": exc.code.name},
                )
                return
            self.registry.learn(info)


def replica_secret(config: ControlConfig) -> str | None:
    """`config.replication.secret`, or the first line of its `secretFile`."""
    replication = config.replication
    if replication.secret_file is None:
        return replication.secret
    try:
        text = Path(replication.secret_file).read_text()
    except OSError as exc:
        raise ApiError(
            ErrorCode.FAILED_PRECONDITION,
            f"config.replication.secretFile {replication.secret_file} cannot be read "
            f"({exc.strerror}); check the path and its mode",
            field="replication.secretFile",
        ) from None
    return text.splitlines()[0].strip() if text.strip() else None


def advertise_address(config: ControlConfig, port: int) -> str:
    """Where the other replicas reach this one: `config.replication.advertise`, else the pod's
    address (POD_IP, from the downward API), else the listen host; and the listening port."""
    if config.replication.advertise is not None:
        return config.replication.advertise
    host = os.environ.get("POD_IP") or config.listen_host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def certificate_fingerprint(config: ControlConfig) -> str:
    """The SHA-256 of this replica's certificate, which its peers pin."""
    try:
        return fingerprint_of_pem(Path(config.tls.cert_file).read_bytes())
    except OSError as exc:
        raise ApiError(
            ErrorCode.FAILED_PRECONDITION,
            f"cannot read config.tls.certFile ({config.tls.cert_file}): {exc.strerror}",
        ) from None


def machine_list(
    statuses: Sequence[PoolStatus], busy: Mapping[str, int] | None = None
) -> MachineList:
    """`GET /v1/machines` from what each pool's last pass saw, our cards split by `busy`
    (node → cards our tasks hold there). Pure."""
    busy = busy or {}
    return MachineList(
        machines=tuple(
            _machine_view(m, busy, status.refused.get(m.node))
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
    machine: Machine, busy: Mapping[str, int], refused: str | None = None
) -> MachineView:
    cards = machine.cards
    worker = machine.worker
    held = min(busy.get(machine.node, 0), cards.ours)
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
            idle=cards.ours - held,
        ),
        cpu_free_millis=machine.cpu_free_millis,
        memory_free_bytes=machine.memory_free_bytes,
        worker=None
        if worker is None
        else MachineWorker(state=WorkerState(worker.state), age_seconds=worker.age_seconds),
        error=machine.error,
        refused=refused,
    )


def _request_path(headers: Mapping[str, str]) -> str:
    return headers.get(":path", "").partition("?")[0]


async def _drain_quietly(conn: Http2Connection) -> None:
    with contextlib.suppress(trio.BrokenResourceError, ConnectionLost):
        await conn.drain()


def _peer(tcp: trio.SocketStream) -> str:
    try:
        host, port = tcp.socket.getpeername()[:2]
    except OSError:
        return "unknown"
    return f"{host}:{port}"


def _json_mapping(body: bytes) -> dict[str, Any]:
    data = decode_json(body) if body else None
    if not isinstance(data, dict):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT, "body must be a pool block (a JSON object with kubernetes)"
        )
    return data


@attrs.define(eq=False)
class _PoolRun:
    pool: PoolConfig
    reconciler: PoolReconciler | None = None
    elector: LeaderElector | None = None
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
    pools = load_pools(config.worker.pools, config.worker.pool_credentials).pools
    secret = replica_secret(config)
    keepalive = KeepaliveConfig(
        ping_interval_s=config.tunnel.ping_interval_s,
        ping_timeout_s=config.tunnel.ping_timeout_s,
    )
    async with open_task_store(config.database) as store, trio.open_nursery() as nursery:
        replication = Replication(
            Directory(store.database),
            config.leader_election.identity or default_identity(),
            config.replication.lease_s,
            peers=None
            if secret is None
            else Peers(nursery, secret, settings=config.http2, keepalive=keepalive),
        )
        tokens = {t.worker_id: t.token for t in config.worker.tokens}
        registry = WorkerRegistry(
            tokens, nursery, settings=config.http2, keepalive=keepalive, replication=replication
        )
        for worker_id, token in tokens.items():
            await registry.add_worker(worker_id, token)
        dispatcher = Dispatcher(
            store,
            registry,
            Workspaces(config.workspaces, config.workspace_limits),
            lost_after_s=config.worker.lost_after_s,
        )
        control = Controlplane(config, registry, dispatcher)
        control.pool_env = pool_env
        control._nursery = nursery
        control._clusters = Clusters(nursery, on_cache_event=control.metrics.cache_event)
        listeners = await trio.open_tcp_listeners(config.listen_port, host=config.listen_host)
        port = int(listeners[0].socket.getsockname()[1])
        control.port = port

        async def handle(tcp: trio.SocketStream) -> None:
            await control.handle_connection(tcp, context)

        control._listeners = listeners

        async def listen(
            *,
            task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            # Connections are served in the main nursery: stopping the accept loops (a drain)
            # leaves them running. Each loop closes its listener as it ends.
            with control._listening:
                await trio.serve_listeners(
                    handle, listeners, handler_nursery=nursery, task_status=task_status
                )

        await nursery.start(
            control.keep_membership,
            advertise_address(config, port),
            certificate_fingerprint(config),
        )
        await nursery.start(dispatcher.run)
        await nursery.start(listen)
        if config.metrics.listen is not None:
            control.metrics_port = await nursery.start(
                functools.partial(
                    serve_metrics,
                    config.metrics.host,
                    config.metrics.port,
                    control.metrics.registry,
                    refresh=control.refresh_metrics,
                )
            )
            log.info(
                "metrics at http://%s:%d/metrics",
                config.metrics.host,
                control.metrics_port,
                extra={"host": config.metrics.host, "port": control.metrics_port},
            )
        log.info(
            "controlplane listening on %s:%d",
            config.listen_host,
            port,
            extra={"host": config.listen_host, "port": port},
        )
        await control.set_config_pools(pools)
        if config.joined_pools is not None:
            await nursery.start(control.keep_joined_pools)
        task_status.started(control)
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await control.proxy.aclose()
