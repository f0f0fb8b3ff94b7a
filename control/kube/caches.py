"""One cluster's caches, shared by every pool that reconciles it: nodes by selector, the pods
bound to those nodes, and our Jobs and token Secrets by namespace.

Why this module exists: pools are configured one by one, but several of them often live in one
cluster (one per GPU node pool). Each collection of a cluster is watched once however many
pools read it: pools with the same selector share a node cache, every pool of the cluster
shares the pod cache, and pools of one namespace share the Job and Secret caches. A cache
lives while a pool uses it (`acquire` / `release`).

What is watched, and how narrowly:

- nodes: by the pool's selector on the server (every selector a pool can write is a label
  selector the API server understands), keeping only the labels the selector and the machine
  list read;
- pods: every namespace, with the field selector `status.phase!=Succeeded,status.phase!=Failed,
  spec.nodeName!=` (no finished pod, no pod not yet bound: neither holds cards), and kept only
  when bound to a node one of the node caches holds. A field selector cannot name a set of
  nodes, so the subset is kept here: when a node enters it (after the first list), its pods are
  listed with `spec.nodeName=NODE` (or, when many enter at once, all pods again) and merged;
  when it leaves, its pods are dropped;
- our Jobs and token Secrets: by our labels in the pool's namespace; a Secret is kept as its
  token only (read back when a controlplane adopts a worker it did not start).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from control.kube.adapter import (
    Collection,
    KubeClient,
    KubeError,
    open_kube_client,
    secret_value,
)
from control.kube.informer import BOOKMARK_PERIOD_S, RETRY, CacheEvent, Change, Informer
from control.kube.manifests import MANAGED_BY_LABEL, MANAGER, NAME_LABEL, TOKEN_KEY, WORKER_NAME
from control.kube.planner import JobFacts, NodeFacts, PodFacts, job_facts, node_facts, pod_facts
from control.kube.pools import PoolConfig
from wire.backoff import BackoffState, next_delay, record_failure

__all__ = ["ClusterCaches", "Clusters", "PoolCaches", "PoolCluster", "cluster_key", "open_clusters"]

log = logging.getLogger("levers9.cache")

OUR_OBJECTS = f"{MANAGED_BY_LABEL}={MANAGER},{NAME_LABEL}={WORKER_NAME}"
BOUND_LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed,spec.nodeName!="
FILL_ONE_BY_ONE = 16
"""Up to this many nodes entering at once have their pods listed node by node; more, and all
pods are listed once instead."""


def token_of(secret: dict[str, Any]) -> str | None:
    """A worker token Secret's token (decoded), the only thing its cache keeps."""
    return secret_value(secret, TOKEN_KEY)


@attrs.frozen(eq=False)
class PoolCaches:
    """The caches one pool reads."""

    nodes: Informer[NodeFacts]
    pods: Informer[PodFacts]
    jobs: Informer[JobFacts]
    secrets: Informer[str]
    cluster: ClusterCaches | None = None
    """Whose pod cache this is: it says which nodes' pods are still being listed."""

    def all(self) -> tuple[Informer[Any], ...]:
        return (self.nodes, self.pods, self.jobs, self.secrets)


@attrs.define(eq=False)
class _Running:
    informer: Informer[Any]
    scope: trio.CancelScope
    users: int = 0


class ClusterCaches:
    """The informers of one cluster, run in `nursery`, reading through `api`. Each expects a
    BOOKMARK about every `bookmark_period_s` and tells `on_cache_event` when it lists again or
    becomes unusable (`control.kube.informer`)."""

    def __init__(
        self,
        api: KubeClient,
        nursery: trio.Nursery,
        *,
        label: str,
        bookmark_period_s: float = BOOKMARK_PERIOD_S,
        on_cache_event: CacheEvent | None = None,
    ) -> None:
        self.api = api
        self.label = label
        self.bookmark_period_s = bookmark_period_s
        self.on_cache_event = on_cache_event
        self._nursery = nursery
        self._running: dict[tuple[str, str], _Running] = {}
        self._node_refs: Counter[str] = Counter()
        self._to_fill: set[str] = set()
        self._unlisted: set[str] = set()
        """Nodes that entered after the pod cache's first list, their pods not listed yet."""
        self._filled = trio.Event()
        self._fill_wanted = trio.Event()
        self._pods: Informer[PodFacts] | None = None
        self._filler: trio.CancelScope | None = None

    async def _start(self, key: tuple[str, str], informer: Informer[Any]) -> _Running:
        running = self._running.get(key)
        if running is None:
            running = _Running(informer, trio.CancelScope())
            self._running[key] = running
            try:
                await self._nursery.start(self._keep, running)
            except BaseException:
                # Not started: the next pool to ask starts it again.
                del self._running[key]
                raise
        running.users += 1
        return running

    async def _keep(
        self, running: _Running, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with running.scope:
            await running.informer.run(task_status=task_status)

    async def acquire(
        self, node_selector: str, label_keys: Iterable[str], namespace: str
    ) -> PoolCaches:
        """The caches of a pool with this node selector and namespace, started if new."""
        keep_labels = frozenset(label_keys)
        nodes: Informer[NodeFacts] = Informer(
            self.api,
            Collection("nodes", label_selector=node_selector),
            lambda obj: node_facts(obj, keep_labels),
            label=self.label,
            bookmark_period_s=self.bookmark_period_s,
            on_event=self.on_cache_event,
        )
        if ("nodes", node_selector) not in self._running:
            nodes.subscribe(self._nodes_changed)
        nodes = (await self._start(("nodes", node_selector), nodes)).informer
        pods = self._pod_cache()
        if ("pods", "") not in self._running:
            await self._start(("pods", ""), pods)
        else:
            self._running[("pods", "")].users += 1
        jobs: Informer[JobFacts] = Informer(
            self.api,
            Collection("jobs", namespace, label_selector=OUR_OBJECTS),
            job_facts,
            label=self.label,
            bookmark_period_s=self.bookmark_period_s,
            on_event=self.on_cache_event,
        )
        jobs = (await self._start(("jobs", namespace), jobs)).informer
        secrets: Informer[str] = Informer(
            self.api,
            Collection("secrets", namespace, label_selector=OUR_OBJECTS),
            token_of,
            label=self.label,
            bookmark_period_s=self.bookmark_period_s,
            on_event=self.on_cache_event,
        )
        secrets = (await self._start(("secrets", namespace), secrets)).informer
        return PoolCaches(nodes, pods, jobs, secrets, cluster=self)

    def release(self, caches: PoolCaches) -> None:
        """One pool stopped reading these; a cache no pool reads stops."""
        for key, running in list(self._running.items()):
            if running.informer in caches.all():
                running.users -= 1
                if running.users <= 0:
                    running.scope.cancel()
                    del self._running[key]
                    if key[0] == "nodes":
                        self._forget_nodes(running.informer.items)
        if self._pods is not None and ("pods", "") not in self._running:
            self._pods = None
            self._unlisted.clear()
            if self._filler is not None:
                self._filler.cancel()
                self._filler = None

    def unlisted(self, nodes: Iterable[str]) -> set[str]:
        """Those of `nodes` whose pods the pod cache has not listed yet: a node that enters
        after its first list (a pool joined later, a node newly labelled) has its pods listed
        on its own, a moment later. Until then its cards all look free."""
        return {node for node in nodes if node in self._unlisted}

    async def wait_listed(self) -> None:
        """Until the next listing of entered nodes' pods is done."""
        await self._filled.wait()

    async def nodes_listed(self) -> None:
        """Returns once the node caches have listed their nodes (or failed to)."""
        for key, running in list(self._running.items()):
            if key[0] == "nodes":
                await running.informer.first_outcome.wait()

    # -- the pod cache and the nodes it keeps pods of -----------------------------------------

    def _pod_cache(self) -> Informer[PodFacts]:
        if self._pods is None:
            self._pods = Informer(
                _AfterNodes(self),
                Collection("pods", field_selector=BOUND_LIVE_PODS),
                pod_facts,
                label=self.label,
                keep=lambda pod: pod.node in self._node_refs,
                bookmark_period_s=self.bookmark_period_s,
                on_event=self.on_cache_event,
            )
            self._filler = trio.CancelScope()
            self._nursery.start_soon(self._fill_loop, self._pods, self._filler)
        return self._pods

    def _nodes_changed(self, changes: list[Change[NodeFacts]]) -> None:
        left: set[str] = set()
        for change in changes:
            if change.old is None and change.new is not None:
                self._node_refs[change.key] += 1
                if self._node_refs[change.key] == 1:
                    left.discard(change.key)
                    if self._pods is not None and self._pods.synced.is_set():
                        self._to_fill.add(change.key)
                        self._unlisted.add(change.key)
                        self._fill_wanted.set()
            elif change.old is not None and change.new is None:
                self._unref(change.key, left)
        self._drop_pods_of(left)

    def _unref(self, node: str, left: set[str]) -> None:
        self._node_refs[node] -= 1
        if self._node_refs[node] <= 0:
            del self._node_refs[node]
            self._to_fill.discard(node)
            self._unlisted.discard(node)
            left.add(node)

    def _forget_nodes(self, nodes: Iterable[str]) -> None:
        left: set[str] = set()
        for node in nodes:
            self._unref(node, left)
        self._drop_pods_of(left)

    def _drop_pods_of(self, nodes: set[str]) -> None:
        if nodes and self._pods is not None:
            self._pods.drop(lambda pod: pod.node in nodes)

    async def _fill_loop(self, pods: Informer[PodFacts], scope: trio.CancelScope) -> None:
        """Lists the pods of nodes that entered after the pod cache's first list."""
        with scope:
            state = BackoffState()
            while True:
                await self._fill_wanted.wait()
                self._fill_wanted = trio.Event()
                nodes = sorted(self._to_fill)
                self._to_fill.clear()
                try:
                    if len(nodes) > FILL_ONE_BY_ONE:
                        await pods.fill("")
                    else:
                        for node in nodes:
                            if node in self._node_refs:
                                await pods.fill(f"spec.nodeName={node}")
                    state = BackoffState()
                    self._unlisted.difference_update(nodes)
                    self._filled.set()
                    self._filled = trio.Event()
                except KubeError as exc:
                    self._to_fill.update(n for n in nodes if n in self._node_refs)
                    self._fill_wanted.set()
                    log.warning(
                        "%s: cannot list the pods of %d new node(s): %s",
                        self.label,
                        len(nodes),
                        exc.message,
                        extra={"pool": self.label, "nodes": len(nodes)},
                    )
                    await trio.sleep(next_delay(RETRY, state, random.random()))
                    record_failure(state)


class _AfterNodes:
    """The pod cache's view of the cluster: its first list waits until a node cache has its
    nodes, so that list keeps their pods (instead of keeping none and filling all later)."""

    def __init__(self, cluster: ClusterCaches) -> None:
        self._cluster = cluster

    async def list_page(self, collection: Collection, facts: Any, **kw: Any) -> Any:
        await self._cluster.nodes_listed()
        return await self._cluster.api.list_page(collection, facts, **kw)

    async def watch(self, collection: Collection, resource_version: str, *, timeout_s: int) -> Any:
        return await self._cluster.api.watch(collection, resource_version, timeout_s=timeout_s)


def cluster_key(pool: PoolConfig) -> tuple[Any, ...]:
    """Pools with equal keys reach the same cluster as the same identity, and share caches."""
    kube = pool.kubernetes
    return (
        kube.flavor,
        kube.endpoint,
        kube.ca_data,
        repr(kube.credentials),
        kube.credentials_file,
        kube.in_cluster,
        kube.qps,
        kube.burst,
    )


@attrs.frozen(eq=False)
class PoolCluster:
    """What a pool's reconciler holds: the client it writes with, and the caches it reads."""

    api: KubeClient
    caches: PoolCaches
    cluster: ClusterCaches


@attrs.define(eq=False)
class _Cluster:
    caches: ClusterCaches
    pools: set[str]
    done: trio.Event


@asynccontextmanager
async def open_clusters(
    *, bookmark_period_s: float = BOOKMARK_PERIOD_S, on_cache_event: CacheEvent | None = None
) -> AsyncIterator[Clusters]:
    """`Clusters` whose clusters' clients and informers run in a nursery of its own, open
    while the block runs (every pool using one has left it by then)."""
    async with trio.open_nursery() as nursery:
        yield Clusters(nursery, bookmark_period_s=bookmark_period_s, on_cache_event=on_cache_event)
        nursery.cancel_scope.cancel()


class Clusters:
    """Every cluster the controlplane's pools reach, each with one client and its caches
    (`ClusterCaches`: `bookmark_period_s` and `on_cache_event` are passed on). Opened by
    `open_clusters`, which runs the clusters' tasks."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        bookmark_period_s: float = BOOKMARK_PERIOD_S,
        on_cache_event: CacheEvent | None = None,
    ) -> None:
        self._nursery = nursery
        self._bookmark_period_s = bookmark_period_s
        self._on_cache_event = on_cache_event
        self._clusters: dict[tuple[Any, ...], _Cluster] = {}
        self._lock = trio.Lock()

    @asynccontextmanager
    async def use(self, pool: PoolConfig) -> AsyncIterator[PoolCluster]:
        """The pool's client and caches while the block runs."""
        selector = pool.kubernetes.selector
        keys = {*selector.match_labels, *(e.key for e in selector.match_expressions)}
        key = cluster_key(pool)
        async with self._lock:
            entry = self._clusters.get(key)
            if entry is None:
                entry = await self._nursery.start(self._run_cluster, key, pool)
            assert entry is not None
            entry.pools.add(pool.name)
            entry.caches.label = ", ".join(sorted(entry.pools))
            entry.caches.api.relabel(entry.caches.label)
            # Shielded: the informers are started and counted all or none, so a pool cancelled
            # here (it stopped leading) leaves no cache half started for the next one to wait
            # on. It waits for nothing but the informers' starts.
            with trio.CancelScope(shield=True):
                caches = await entry.caches.acquire(
                    selector.label_selector(), keys, pool.kubernetes.namespace
                )
        try:
            yield PoolCluster(entry.caches.api, caches, entry.caches)
        finally:
            entry.caches.release(caches)
            entry.pools.discard(pool.name)
            if not entry.pools:
                if self._clusters.get(key) is entry:
                    del self._clusters[key]
                entry.done.set()
            else:
                entry.caches.label = ", ".join(sorted(entry.pools))
                entry.caches.api.relabel(entry.caches.label)

    async def _run_cluster(
        self,
        key: tuple[Any, ...],
        pool: PoolConfig,
        *,
        task_status: trio.TaskStatus[_Cluster] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with open_kube_client(pool) as api, trio.open_nursery() as nursery:
            caches = ClusterCaches(
                api,
                nursery,
                label=pool.name,
                bookmark_period_s=self._bookmark_period_s,
                on_cache_event=self._on_cache_event,
            )
            entry = _Cluster(caches, set(), trio.Event())
            self._clusters[key] = entry
            task_status.started(entry)
            await entry.done.wait()
            nursery.cancel_scope.cancel()
