"""The pools' runner: every pool's reconciler, each under its pool's leader election when
`config.leaderElection` is on, and the pools joined through the API.

Why this module exists: the pools are the one part of the controlplane that changes while it
runs (SIGHUP reloads the configured pools, `cluster join` / `leave` add and remove joined
ones), and each running pool owns tasks: its reconcile loop, its Lease's elector, its share of
the cluster caches. One owner, `PoolRunner`, holds them all in the nursery its `run` opens;
every change goes through `set_pools` under one lock, so a pool is never started twice or
removed while it starts. What the API shows of the pools (`pool_views`, `machine_sizes`) is
read from here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from control.config import ControlConfig
from control.kube.adapter import open_kube_client
from control.kube.caches import Clusters, PoolCluster, open_clusters
from control.kube.informer import CacheEvent
from control.kube.joined import JoinedPoolStore, own_cluster
from control.kube.lease import LeaderElector, election_settings, lease_cluster
from control.kube.loop import PoolReconciler
from control.kube.pools import PoolConfig
from control.models import PoolView
from control.tasks.scheduler import MachineSize, Retire
from control.workers.registry import WorkerRegistry
from wire.errors import ApiError
from workerapi.models import CardState

REMOVE_POOL_S = 60.0
"""How long a removed pool's Jobs may take to delete before its loop stops anyway."""

log = logging.getLogger("levers9.control")


@attrs.define(eq=False)
class _PoolRun:
    pool: PoolConfig
    reconciler: PoolReconciler | None = None
    elector: LeaderElector | None = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    done: trio.Event = attrs.field(factory=trio.Event)
    remove: bool = False


class PoolRunner:
    """Runs the pools of `config` (`run`) and those joined later; `identity` names this
    replica in the pools' Leases, `pool_env` is extra environment for every worker Job (e.g.
    the controlplane's CA for agents). The callbacks are passed to every reconciler
    (`on_worker_gone`, `on_pass`) and to the cluster caches (`on_cache_event`)."""

    def __init__(
        self,
        config: ControlConfig,
        registry: WorkerRegistry,
        *,
        identity: str,
        pool_env: Mapping[str, str] | None = None,
        on_worker_gone: Callable[[str, str], Awaitable[None]] | None = None,
        on_pass: Callable[[str, float, bool], None] | None = None,
        on_cache_event: CacheEvent | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.identity = identity
        self.pool_env = pool_env
        self._on_worker_gone = on_worker_gone
        self._on_pass = on_pass
        self._on_cache_event = on_cache_event
        self.config_pools: tuple[PoolConfig, ...] = ()
        self.joined: JoinedPoolStore | None = None
        """The joined pools' store, once read (`config.joinedPools`); None before, or when
        this controlplane keeps none."""
        self._pools: dict[str, _PoolRun] = {}
        self._lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._clusters: Clusters | None = None

    async def run(
        self,
        pools: Sequence[PoolConfig],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Reconcile `pools` (the configured ones) and, with `config.joinedPools`, the joined
        ones until cancelled. Started once every pool started (a joined-pool store that cannot
        be read yet is retried meanwhile)."""
        async with (
            open_clusters(on_cache_event=self._on_cache_event) as clusters,
            trio.open_nursery() as nursery,
        ):
            self._clusters, self._nursery = clusters, nursery
            await self.set_config_pools(pools)
            if self.config.joined_pools is not None:
                await nursery.start(self._keep_joined_pools)
            task_status.started()
            await trio.sleep_forever()

    @property
    def pools(self) -> list[PoolReconciler]:
        """The reconcilers running here now (with leader election: of the pools this replica
        leads)."""
        return [run.reconciler for run in self._pools.values() if run.reconciler is not None]

    def pool_views(self) -> list[PoolView]:
        joined = set(self.joined.blocks) if self.joined is not None else set()
        return [
            _pool_view(name, run, "joined" if name in joined else "config")
            for name, run in sorted(self._pools.items())
        ]

    def machine_sizes(self) -> list[MachineSize]:
        """Every machine the pools this replica reconciles saw last, with all its cards and
        those our worker there quarantined."""
        problems = self.registry.card_problems()
        return [
            MachineSize(
                pool=m.pool,
                node=m.node,
                cards=m.cards.total,
                free=m.cards.free,
                worker=m.worker.name if m.worker is not None else "",
                broken=sum(
                    c.state in (CardState.UNHEALTHY, CardState.REFUSED)
                    for c in problems.get(m.node, ())
                )
                if m.worker is not None
                else 0,
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

    async def set_config_pools(self, pools: Sequence[PoolConfig]) -> None:
        """The configured pools changed (start-up or SIGHUP); joined pools stay, except one
        whose name a configured pool now takes."""
        async with self._lock:
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

    async def join(self, store: JoinedPoolStore, block: Mapping[str, Any]) -> PoolConfig:
        """Keep the pool `block` in the joined pools' store and run it (a changed block
        restarts it)."""
        async with self._lock:
            pool = await store.put(block)
            await self.set_pools([*self.config_pools, *store.pools()])
        return pool

    async def leave(self, store: JoinedPoolStore, name: str) -> None:
        """Drop the joined pool `name` from the store; its workers are removed."""
        async with self._lock:
            await store.remove(name)
            await self.set_pools([*self.config_pools, *store.pools()])

    async def set_pools(self, pools: Sequence[PoolConfig]) -> None:
        """Reconcile exactly these pools from now on: a new block starts, a changed one
        restarts, and a removed one has its Jobs and Secrets deleted (never the namespace,
        never a node) before its loop stops."""
        if self._nursery is None:
            raise RuntimeError("PoolRunner.set_pools before run started")
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

    async def _keep_joined_pools(
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
            on_worker_gone=self._on_worker_gone,
            on_pass=self._on_pass,
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


def _pool_view(name: str, run: _PoolRun, source: str) -> PoolView:
    kube = run.pool.kubernetes
    status = run.reconciler.status if run.reconciler is not None else None
    return PoolView(
        name=name,
        source=source,
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
