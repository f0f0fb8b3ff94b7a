"""The controlplane's public endpoint: one TLS listener, two protocols chosen by ALPN.

- `h2`: the controlplane API (CLI, scripts, workers registering), served by the same
  `wire.service.Service` machinery the worker uses, with the controlplane's own routes
  (`control.api.tasks`, `workers`, `pools`, the dashboard's) and the requests another replica
  forwards for a worker this one holds (`control.workers.forward`).
- `http/1.1`: a worker's tunnel (`control.api.tunnels`).

Why this module exists: it holds what every connection shares (the admission limits, the
callers' principals, the live connections a drain sends GOAWAY) and opens the whole
controlplane as one `async with open_controlplane(config)`: the task store, the worker
registry, the dispatcher, the listener, the replica's membership and the pools' runner
(`control.kube.runner`), each built complete and run in nurseries that block owns.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import trio

from control.api.access import require_api
from control.api.endpoints import EndpointProxy
from control.api.pools import PoolRoutes, machine_list
from control.api.tasks import WORKSPACE_PREFIX, TaskRoutes
from control.api.tunnels import TunnelAcceptor, drain_quietly
from control.api.workers import WorkerRoutes
from control.config import ControlConfig
from control.db.base import Database
from control.kube.lease import default_identity
from control.kube.pools import PoolConfig, load_pools
from control.kube.runner import PoolRunner
from control.metrics import ControlMetrics
from control.tasks.dispatch import Dispatcher
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
from control.workers.forward import is_forwarded, open_peers, serve_forwarded
from control.workers.registry import Replication, WorkerRegistry, open_worker_registry
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
from wire.errors import ApiError, ErrorCode
from wire.metrics import render as render_metrics
from wire.metrics import serve_metrics
from wire.service import BytesResponse, Request, Router, Service, bearer_token
from wire.tls import TLSStream, fingerprint_of_pem
from workerapi.client import WorkerClient

log = logging.getLogger("levers9.control")


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
    """The public endpoint and what it serves, as `open_controlplane` built it: `registry`
    (the workers), `dispatcher` (the tasks), `runner` (the pools), `metrics`; `listeners`
    are the endpoint's, already listening, and `context` their TLS."""

    def __init__(
        self,
        config: ControlConfig,
        *,
        registry: WorkerRegistry,
        dispatcher: Dispatcher,
        runner: PoolRunner,
        metrics: ControlMetrics,
        proxy: EndpointProxy,
        listeners: Sequence[trio.SocketListener],
        context: ssl.SSLContext,
    ) -> None:
        self.config = config
        self.registry = registry
        self.dispatcher = dispatcher
        self.runner = runner
        self.metrics = metrics
        self.proxy = proxy
        self.workspaces = dispatcher.workspaces
        self.identity = runner.identity
        """This replica's name in the pools' Leases (`config.leaderElection`) and in the
        directory of replicas."""
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
        self._connections: set[Http2Connection] = set()
        self._listening = trio.CancelScope()
        self._listeners = list(listeners)
        self._context = context
        self.port = int(self._listeners[0].socket.getsockname()[1])
        self.draining = False
        """Set once `drain` began: no connection is taken any more."""
        self.replica_secret = replica_secret(config)
        self.service = self._service(config)
        self.metrics_port: int | None = None
        """The plain-HTTP metrics listener's port (`config.metrics.listen`), once it listens."""
        self.limits = connection_limits(config)
        self.admissions = Admissions(self.limits)
        self._early = ConnectionLog()
        self.keepalive = keepalive_of(config)
        self.tunnels = TunnelAcceptor(
            registry,
            settings=config.http2,
            keepalive=self.keepalive,
            first_request_timeout_s=self.limits.first_request_timeout_s,
            admissions=self.admissions,
            early=self._early,
            connections=self._connections,
            draining=lambda: self.draining,
        )

    def _service(self, config: ControlConfig) -> Service:
        router = Router()
        WorkerRoutes(self.registry, self.dispatcher).add_to(router)
        PoolRoutes(self.runner, self.dispatcher).add_to(router)
        router.add("GET", "/metrics", self._metrics)
        dial = TaskRoutes(
            self.dispatcher,
            self.proxy,
            allow_local_registries=config.worker.allows_local_registries(),
        ).add_to(router)
        add_ui_routes(router, self._principal_of, self.sessions, title="levers9")
        return Service(
            router,
            program="controlplane",
            authenticate=self._authenticate,
            dial=dial,
            name="control",
            observe=self.metrics.request,
            authenticate_session=self._session_principal,
            error_headers=error_headers,
        )

    async def _run(
        self, pools: Sequence[PoolConfig], *, task_status: trio.TaskStatus[None]
    ) -> None:
        """Serve until cancelled: the replica's membership, the dispatcher, the listener,
        the metrics listener, then the pools; started once all of them are."""
        async with trio.open_nursery() as nursery:
            await nursery.start(
                self.keep_membership,
                advertise_address(self.config, self.port),
                certificate_fingerprint(self.config),
            )
            await nursery.start(self.dispatcher.run)
            await nursery.start(self._listen, nursery)
            metrics = self.config.metrics
            if metrics.listen is not None:
                self.metrics_port = await nursery.start(
                    functools.partial(
                        serve_metrics,
                        metrics.host,
                        metrics.port,
                        self.metrics.registry,
                        refresh=self.refresh_metrics,
                    )
                )
                log.info(
                    "metrics at http://%s:%d/metrics",
                    metrics.host,
                    self.metrics_port,
                    extra={"host": metrics.host, "port": self.metrics_port},
                )
            log.info(
                "controlplane listening on %s:%d",
                self.config.listen_host,
                self.port,
                extra={"host": self.config.listen_host, "port": self.port},
            )
            await nursery.start(self.runner.run, pools)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await self.proxy.aclose()

    async def _listen(
        self,
        handlers: trio.Nursery,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        # Connections are served in the `handlers` nursery: stopping the accept loops (a drain)
        # leaves them running. Each loop closes its listener as it ends.
        with self._listening:
            await trio.serve_listeners(
                functools.partial(self.handle_connection, context=self._context),
                self._listeners,
                handler_nursery=handlers,
                task_status=task_status,
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

    async def _metrics(self, request: Request) -> BytesResponse:
        require_api(request)
        await self.refresh_metrics()
        body, content_type = render_metrics(
            self.metrics.registry, request.headers.get("accept", "")
        )
        return BytesResponse(body, content_type)

    async def refresh_metrics(self) -> None:
        """Read the states `/metrics` reports (the records' counts first: the rest is in
        memory)."""
        counts = await self.dispatcher.store.count_by_state()
        tunnels = sum(
            1 for e in self.registry.entries() if e.tunnel is not None and e.tunnel.conn.usable
        )
        self.metrics.refresh(
            counts,
            machine_list(
                [r.status for r in self.runner.pools],
                self.dispatcher.busy_cards(),
                self.registry.card_problems(),
            ),
            self.registry.list(),
            tunnels,
        )

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
                    nursery.start_soon(drain_quietly, conn)
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
        await self.tunnels.accept(tls, peer, admission)


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


def _request_path(headers: Mapping[str, str]) -> str:
    return headers.get(":path", "").partition("?")[0]


def _peer(tcp: trio.SocketStream) -> str:
    try:
        host, port = tcp.socket.getpeername()[:2]
    except OSError:
        return "unknown"
    return f"{host}:{port}"


def keepalive_of(config: ControlConfig) -> KeepaliveConfig:
    """The PINGs on every tunnel and on the connections to workers and peers."""
    return KeepaliveConfig(
        ping_interval_s=config.tunnel.ping_interval_s,
        ping_timeout_s=config.tunnel.ping_timeout_s,
    )


@contextlib.asynccontextmanager
async def open_controlplane(
    config: ControlConfig, *, pool_env: Mapping[str, str] | None = None
) -> AsyncIterator[Controlplane]:
    """Serve the public endpoint and reconcile every configured pool while the block runs;
    entered once everything started (the port listens). `pool_env` is extra environment for
    every worker Job (e.g. the controlplane's CA for agents)."""
    context = server_ssl_context(config)
    pools = load_pools(config.worker.pools, config.worker.pool_credentials).pools
    secret = replica_secret(config)
    identity = config.leader_election.identity or default_identity()
    metrics = ControlMetrics(identity)
    proxy = EndpointProxy()
    async with (
        open_task_store(config.database) as store,
        _open_registry(config, store.database, identity, secret, metrics) as registry,
        trio.open_nursery() as nursery,
    ):

        async def worker_gone(worker_id: str, why: str) -> None:
            await dispatcher.worker_gone(worker_id, why)

        async def forget_connections(task_id: str) -> None:
            await proxy.forget_where(lambda key: isinstance(key, tuple) and key[1] == task_id)

        runner = PoolRunner(
            config,
            registry,
            identity=identity,
            pool_env=pool_env,
            on_worker_gone=worker_gone,
            on_pass=metrics.reconcile_pass,
            on_cache_event=metrics.cache_event,
        )
        dispatcher = Dispatcher(
            store,
            registry,
            Workspaces(config.workspaces, config.workspace_limits),
            lost_after_s=config.worker.lost_after_s,
            machines=runner.machine_sizes,
            retire=runner.retire_worker,
            on_ended=[forget_connections],
            on_placed=[metrics.placed],
        )
        control = Controlplane(
            config,
            registry=registry,
            dispatcher=dispatcher,
            runner=runner,
            metrics=metrics,
            proxy=proxy,
            listeners=await trio.open_tcp_listeners(config.listen_port, host=config.listen_host),
            context=context,
        )
        await nursery.start(control._run, pools)
        yield control
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def _open_registry(
    config: ControlConfig,
    database: Database,
    identity: str,
    secret: str | None,
    metrics: ControlMetrics,
) -> AsyncIterator[WorkerRegistry]:
    """The worker registry, its configured workers added, replicated through the directory
    in `database`; with a replica secret, with connections to the other replicas to forward
    on."""
    keepalive = keepalive_of(config)
    async with contextlib.AsyncExitStack() as stack:
        peers = (
            None
            if secret is None
            else await stack.enter_async_context(
                open_peers(secret, settings=config.http2, keepalive=keepalive)
            )
        )
        tokens = {t.worker_id: t.token for t in config.worker.tokens}
        registry = await stack.enter_async_context(
            open_worker_registry(
                tokens,
                settings=config.http2,
                keepalive=keepalive,
                replication=Replication(
                    Directory(database), identity, config.replication.lease_s, peers=peers
                ),
                on_connection=metrics.connection,
            )
        )
        for worker_id, token in tokens.items():
            await registry.add_worker(worker_id, token)
        yield registry
