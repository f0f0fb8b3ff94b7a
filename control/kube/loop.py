"""Keeps one pool's machines and workers: plan from the caches, apply, on a change or a period.

The decisions are `control.kube.planner.plan_pool`'s (pure); this module is the thin I/O around
it. The pool reads its cluster through caches kept by list + watch (`control.kube.caches`): its
nodes (by its selector), the pods bound to them, and our Jobs and token Secrets. A pass reads
nothing from the API server: it folds in what the worker registry heard (registrations,
tunnels: the heartbeats), plans from the caches, and applies the plan: a worker Job with its
token Secret where a node has free cards and no worker of ours, a Job deleted where its node
stopped being a machine or its worker's record expired. A Job's worker id is the Job's name
and its token is minted here; the registry accepts it from then on and forgets it when the Job
is deleted.

A pass runs every `reconcileSeconds`, and soon after a change that matters to the pool (one of
its nodes changed what the planner reads of it, a pod on one of its nodes came, went or
finished, one of its Jobs changed): `COALESCE_S` after the first such change and at least
`MIN_GAP_S` after the previous pass, so a burst of events makes one pass.

A pass that fails (a cache cannot be kept: the cluster answered 401, or stayed unavailable; a
write failed) changes nothing more; the next one comes after a backoff (from
`reconcileSeconds`, doubling, capped, jittered) instead of the period, and changes do not
hurry it. Its error is logged once while it stays the same, and kept in the pool's status
(`levers9 cluster list`) until a pass goes through.

Each pass logs one canonical line, its counts as fields (`pool`, `nodes`, `pods`, `jobs`,
`machines`, `skipped`, `jobs_created`, `jobs_deleted`, `duration_s`; `error` when it failed),
so a log pipeline filters and graphs passes without parsing the message: at info when it
changed something or failed anew, else at debug.
"""

from __future__ import annotations

import collections
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import attrs
import trio

from control.kube.adapter import KubeAlreadyExists, KubeApi, KubeError, KubeNotFound
from control.kube.caches import PoolCaches, PoolCluster
from control.kube.events import EventRecorder
from control.kube.expectations import (
    EXPECTATION_TIMEOUT_S,
    Expectation,
    Expectations,
    Expecting,
)
from control.kube.informer import Change
from control.kube.manifests import (
    POOL_LABEL,
    PoolSettings,
    job_manifest,
    token_secret,
    token_secret_name,
    with_job_uid,
    worker_labels,
)
from control.kube.planner import (
    Action,
    CreateJob,
    CreateSecret,
    DeleteJob,
    JobFacts,
    Machine,
    NodeFacts,
    NotAMachine,
    Plan,
    PodFacts,
    WorkerRecord,
    plan_pool,
)
from control.kube.podsecurity import EVENTS_SELECTOR, refused_nodes
from control.kube.pools import PoolConfig
from control.kube.selectors import Selector
from control.models import WorkerState
from control.workers.cards import CardNews, news_event
from control.workers.registry import WorkerRegistry
from wire.backoff import Backoff, BackoffState, next_delay, record_failure
from wire.errors import ApiError, ErrorCode

log = logging.getLogger("levers9.reconcile")


def settings_of(pool: PoolConfig) -> PoolSettings:
    """The planner's view of a pool's configuration."""
    kube = pool.kubernetes
    return PoolSettings(
        name=pool.name,
        namespace=kube.namespace,
        image=kube.image,
        selector=Selector(
            labels=dict(kube.selector.match_labels),
            expressions=tuple(
                {"key": e.key, "operator": e.operator, "values": list(e.values)}
                for e in kube.selector.match_expressions
            ),
        ),
        tunnel=kube.tunnel,
        host_network=kube.host_network,
        tolerations=tuple(t.manifest() for t in kube.tolerations),
        objects_path=kube.objects_path,
        driver_path=kube.driver_path,
        idle_minutes=kube.idle_minutes,
        reconcile_seconds=kube.reconcile_seconds,
        metrics_port=kube.agent_metrics_port,
        metrics_host=kube.agent_metrics_host,
        allow_local_registries=kube.allow_local_registries,
    )


@attrs.frozen
class PoolStatus:
    """What the last pass saw: the machines, the nodes that are not, and any failure: the
    pass's own (`error`), a node's write (`Machine.error`, `failed`), or the cluster refusing
    a node's worker pods (`refused`)."""

    pool: str
    machines: tuple[Machine, ...] = ()
    skipped: tuple[NotAMachine, ...] = ()
    passed_at: float | None = None
    error: str | None = None
    failed: Mapping[str, str] = attrs.field(factory=dict)
    """Nodes whose last write failed, and why; each is retried on its own backoff."""
    refused: Mapping[str, str] = attrs.field(factory=dict)
    """Nodes whose worker Job's pods the cluster refuses (Pod Security, GKE Autopilot), in
    its words and with what to run (`control.kube.podsecurity`); gone once a pod is made."""

    def problem(self) -> str | None:
        """The pool's trouble in one line (`levers9 cluster list`): the pass's error, else
        the first node's refusal (and how many more nodes have one)."""
        if self.error is not None or not self.refused:
            return self.error
        node = min(self.refused)
        more = len(self.refused) - 1
        return f"node {node}: {self.refused[node]}" + (
            f" (and {more} more node(s))" if more else ""
        )


@attrs.frozen
class _Gone:
    """Why a worker is gone, and whether the registry is to forget it too (a Job deleted
    here; the dispatcher forgets one whose Job ended)."""

    reason: str
    remove: bool = True


@attrs.define
class KeyFailure:
    """A node whose last write failed: why, and when it may be tried again (trio's clock)."""

    error: str
    retry_at: float
    backoff: BackoffState = attrs.Factory(BackoffState)


@attrs.define
class PassCounts:
    """What one pass saw and did, for its canonical log line."""

    nodes: int = 0
    pods: int = 0
    jobs: int = 0
    machines: int = 0
    skipped: int = 0
    jobs_created: int = 0
    jobs_deleted: int = 0

    held: int = 0
    failed: int = 0

    def fields(self) -> dict[str, int]:
        return attrs.asdict(self)


FOLLOW_UP_S = 2.0
"""A pass that created or deleted Jobs is followed this soon by another, so the machines show
the workers' registrations without waiting a whole `reconcileSeconds`."""
COALESCE_S = 0.25
"""How long a pass waits after the first change that wakes it, for the rest of a burst."""
MIN_GAP_S = 1.0
"""The least time between two passes woken by changes."""
FAILED_CAP_S = 120.0
"""The longest wait after failed passes (or `reconcileSeconds`, when that is longer)."""
EVENT_WAIT_S = 5.0
CARD_NEWS_MAX = 256
"""Card transitions kept for the next pass's Events; beyond it the oldest are dropped."""
"""The longest a pass waits to record an Event (advisory: a struggling API server must not
hold up the pass)."""
PODS_LISTED_WAIT_S = 10.0
"""How long a pass waits for the pods of nodes that just entered to be listed."""
APPLY_CONCURRENCY = 8
"""Nodes whose actions a pass carries out at once (one node's actions go in order)."""


def next_pass_in_s(plan: Plan | None, reconcile_seconds: float) -> float:
    if plan is not None and plan.actions:
        return min(FOLLOW_UP_S, reconcile_seconds)
    return reconcile_seconds


def failure_backoff(reconcile_seconds: float) -> Backoff:
    return Backoff(
        initial_s=reconcile_seconds,
        factor=2.0,
        cap_s=max(reconcile_seconds, FAILED_CAP_S),
        stable_s=0.0,
        jitter=0.2,
    )


def key_backoff(reconcile_seconds: float) -> Backoff:
    """A node's own retries after its write failed: soon at first, capped as the pool's."""
    return Backoff(
        initial_s=min(2.0, reconcile_seconds),
        factor=2.0,
        cap_s=max(reconcile_seconds, FAILED_CAP_S),
        stable_s=0.0,
        jitter=0.2,
    )


class PoolReconciler:
    """One pool's reconcile loop; `run` in the controlplane's nursery."""

    def __init__(
        self,
        pool: PoolConfig,
        cluster: PoolCluster,
        registry: WorkerRegistry,
        *,
        controlplane_url: str,
        extra_env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        on_worker_gone: Callable[[str, str], Awaitable[None]] | None = None,
        on_pass: Callable[[str, float, bool], None] | None = None,
        expectation_timeout_s: float = EXPECTATION_TIMEOUT_S,
    ) -> None:
        self.settings = settings_of(pool)
        self.kube: KubeApi = cluster.api
        self.caches: PoolCaches = cluster.caches
        self.registry = registry
        self.controlplane_url = controlplane_url
        self.extra_env = dict(extra_env or {})
        self.clock = clock
        self.records: dict[str, WorkerRecord] = {}
        self.on_worker_gone = on_worker_gone
        self.on_pass = on_pass
        """Told of each pass once it ends: (pool, seconds, whether it succeeded) (metrics)."""
        self._gone: set[str] = set()
        self._untold: dict[str, _Gone] = {}
        """Workers gone whose end the registry and the dispatcher have not taken yet (the task
        database was away); told again at each pass."""
        self.status = PoolStatus(pool=pool.name)
        self.passes = trio.lowlevel.ParkingLot()
        self.pass_count = 0
        self._namespace_ready = False
        self._pool_label = worker_labels(pool.name, "")[POOL_LABEL]
        self._jobs_selector = f"{POOL_LABEL}={self._pool_label}"
        self._dirty = False
        self._wakeup = trio.lowlevel.ParkingLot()
        self._last_pass = -float("inf")
        self._failures = BackoffState()
        self._logged_error: str | None = None
        self._one_pass_at_a_time = trio.Lock()
        self.events = EventRecorder(cluster.api, pool=pool.name, clock=clock)
        self.expectations = Expectations(expectation_timeout_s)
        """Writes of this reconciler its caches have not shown yet; their nodes are held."""
        self.failures: dict[str, KeyFailure] = {}
        """Nodes whose last write failed, retried each on its own backoff."""
        self.refused: dict[str, str] = {}
        """Nodes whose worker's pods the cluster refuses, as the last pass read it."""
        self._events_unreadable: str | None = None
        self.retiring: dict[str, str] = {}
        """Idle workers to delete at the next pass, and why (`retire`)."""
        self._card_news: collections.deque[CardNews] = collections.deque(maxlen=CARD_NEWS_MAX)
        """Cards of this pool's workers that became unhealthy or occupied (or serve again),
        told as an Event on the worker's Job at the next pass."""

    def retire(self, worker: str, reason: str) -> None:
        """Delete this idle worker's Job at the next pass (now), so that its node's next
        worker takes its cards and the free ones together; `reason` goes in the Job's Event."""
        self.retiring[worker] = reason
        self._wake()

    # -- what wakes a pass ------------------------------------------------------------------

    def _wake(self) -> None:
        self._dirty = True
        self._wakeup.unpark_all()

    def _nodes_changed(self, changes: list[Change[NodeFacts]]) -> None:
        self._wake()

    def _pods_changed(self, changes: list[Change[PodFacts]]) -> None:
        nodes = self.caches.nodes.items
        for change in changes:
            pod = change.new if change.new is not None else change.old
            if pod is not None and pod.node in nodes:
                self._wake()
                return

    def _jobs_changed(self, changes: list[Change[JobFacts]]) -> None:
        for change in changes:
            job = change.new if change.new is not None else change.old
            if job is not None and job.pool == self._pool_label:
                self._wake()
                return

    def _cards_changed(self, news: tuple[CardNews, ...]) -> None:
        mine = [n for n in news if self._my_job(n.worker_id) is not None]
        if mine:
            self._card_news.extend(mine)
            self._wake()

    def _my_job(self, name: str) -> JobFacts | None:
        job = self.caches.jobs.items.get(f"{self.settings.namespace}/{name}")
        return job if job is not None and job.pool == self._pool_label else None

    def _workers_changed(self) -> None:
        # A worker registering or connecting its tunnel turns its machine ready.
        if any(r.state is WorkerState.PENDING for r in self.records.values()):
            self._wake()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        undo = [
            self.caches.nodes.subscribe(self._nodes_changed),
            self.caches.pods.subscribe(self._pods_changed),
            self.caches.jobs.subscribe(self._jobs_changed),
        ]
        self.registry.listeners.append(self._workers_changed)
        self.registry.card_listeners.append(self._cards_changed)
        task_status.started()
        try:
            await self.wait_synced()
            while True:
                plan = await self.reconcile_once()
                if plan is None:
                    delay = next_delay(
                        failure_backoff(self.settings.reconcile_seconds),
                        self._failures,
                        random.random(),
                    )
                    record_failure(self._failures)
                    await trio.sleep(delay)
                    continue
                self._failures = BackoffState()
                period = next_pass_in_s(plan, self.settings.reconcile_seconds)
                if self.failures:
                    retry_in = min(f.retry_at for f in self.failures.values())
                    period = min(period, max(retry_in - trio.current_time(), 0.0))
                await self._wait(period)
        finally:
            for unsubscribe in undo:
                unsubscribe()
            self.registry.listeners.remove(self._workers_changed)
            self.registry.card_listeners.remove(self._cards_changed)

    async def wait_synced(self) -> None:
        """Until every cache has listed once or failed to (the first pass then reports it)."""
        for cache in self.caches.all():
            await cache.first_outcome.wait()

    async def _wait(self, period_s: float) -> None:
        """Until the period is over, or soon after a change that matters (coalesced)."""
        with trio.move_on_after(period_s):
            while not self._dirty:
                await self._wakeup.park()
            since_last = trio.current_time() - self._last_pass
            await trio.sleep(max(COALESCE_S, MIN_GAP_S - since_last))

    # -- one pass ---------------------------------------------------------------------------

    async def reconcile_once(self) -> Plan | None:
        """One pass; returns its plan, or None when a cache could not be kept or a write
        failed. Passes never overlap."""
        async with self._one_pass_at_a_time:
            return await self._reconcile_once()

    async def _reconcile_once(self) -> Plan | None:
        self._dirty = False
        self._last_pass = trio.current_time()
        started = time.monotonic()
        counts = PassCounts()
        name = self.settings.name
        self.pass_count += 1
        try:
            plan = await self._pass(counts)
        except ApiError as exc:
            # The Kubernetes API, or the task database a pass reads tokens from and writes
            # workers to: a failed pass, shown on the pool and tried again on its backoff.
            fields = {
                "pool": name,
                **counts.fields(),
                "duration_s": round(time.monotonic() - started, 3),
                "error": exc.code.name,
            }
            if exc.message != self._logged_error:
                self._logged_error = exc.message
                # The message names the pool already.
                log.warning("reconcile failed: %s", exc.message, extra=fields)
            else:
                log.debug("reconcile failed again: %s", exc.message, extra=fields)
            self.status = attrs.evolve(self.status, error=exc.message, passed_at=self.clock())
            if self.on_pass is not None:
                self.on_pass(name, time.monotonic() - started, False)
            self.passes.unpark_all()
            return None
        if self._logged_error is not None:
            log.info("pool %s: reconcile passes again", name, extra={"pool": name})
            self._logged_error = None
        failed = {node: f.error for node, f in self.failures.items()}
        self.status = PoolStatus(
            pool=name,
            machines=tuple(
                attrs.evolve(m, error=failed[m.node]) if m.node in failed else m
                for m in plan.machines
            ),
            skipped=plan.skipped,
            passed_at=self.clock(),
            failed=failed,
            refused=dict(self.refused),
        )
        level = logging.INFO if plan.actions else logging.DEBUG
        log.log(
            level,
            "pool %s: %d node(s), %d machine(s), %d skipped; %d job(s) created, %d deleted",
            name,
            counts.nodes,
            counts.machines,
            counts.skipped,
            counts.jobs_created,
            counts.jobs_deleted,
            extra={
                "pool": name,
                **counts.fields(),
                "duration_s": round(time.monotonic() - started, 3),
            },
        )
        if self.on_pass is not None:
            self.on_pass(name, time.monotonic() - started, True)
        self.passes.unpark_all()
        return plan

    def _cache_error(self) -> KubeError | None:
        for cache in self.caches.all():
            if cache.error is not None:
                return cache.error
        for cache in self.caches.all():
            if not cache.synced.is_set():
                return KubeError(
                    ErrorCode.UNAVAILABLE,
                    f"pool {self.settings.name}: the {cache.collection.describe()} cache has "
                    "not listed yet",
                )
        return None

    async def _pass(self, counts: PassCounts) -> Plan:
        error = self._cache_error()
        if error is not None:
            raise error
        namespace = self.settings.namespace
        if not self._namespace_ready:
            await self.kube.ensure_namespace(namespace)
            self._namespace_ready = True
        nodes = self.caches.nodes.items
        await self._pods_listed(nodes)
        counts.nodes = len(nodes)
        pods = [pod for pod in self.caches.pods.items.values() if pod.node in nodes]
        counts.pods = len(pods)
        jobs = [job for job in self.caches.jobs.items.values() if job.pool == self._pool_label]
        counts.jobs = len(jobs)
        now = self.clock()
        secrets = {key.partition("/")[2] for key in self.caches.secrets.items}
        jobs = self._expected_jobs(jobs, secrets)
        await self._adopt_tokens(jobs)
        await self._note_finished(jobs)
        self._fold_in(jobs, now)
        await self._tell_card_news()
        self.refused = await self._refused(jobs)
        active = {job.name for job in jobs if job.active}
        for gone in set(self.retiring) - active:
            del self.retiring[gone]
        held = self._held()
        plan = plan_pool(
            self.settings,
            nodes.values(),
            pods,
            jobs,
            self.records.values(),
            now,
            held=held,
            secrets=secrets,
            tokens={job.name for job in jobs if self.registry.has_token(job.name)},
            retire=self.retiring,
        )
        counts.machines = len(plan.machines)
        counts.skipped = len(plan.skipped)
        counts.held = len(plan.held)
        by_node: dict[str, list[Action]] = {}
        for action in plan.actions:
            by_node.setdefault(action.node, []).append(action)
        limiter = trio.CapacityLimiter(APPLY_CONCURRENCY)
        async with trio.open_nursery() as nursery:
            for node, actions in by_node.items():
                nursery.start_soon(self._apply, node, actions, now, counts, limiter)
        counts.failed = len(self.failures)
        return plan

    async def _tell_card_news(self) -> None:
        """An Event on each worker's Job for each of its cards that changed state (`kubectl
        describe job` shows `Warning CardUnhealthy card 2 (GPU-...) on node n: XID 79...`)."""
        while self._card_news:
            news = self._card_news.popleft()
            job = self._my_job(news.worker_id)
            if job is None:
                continue  # gone meanwhile
            reason, message, kind = news_event(news)
            manifest = {
                "metadata": {"name": job.name, "namespace": self.settings.namespace, "uid": job.uid}
            }
            with trio.move_on_after(EVENT_WAIT_S):
                await self.events.record(manifest, reason, message, kind)

    async def _refused(self, jobs: list[JobFacts]) -> dict[str, str]:
        """Nodes whose worker's pods the cluster refuses, from the Job controller's
        `FailedCreate` Events (listed only while a live Job of ours has no pod, so a pool
        whose workers run reads nothing more). Advisory: Events that cannot be read leave the
        nodes as they were, and a Role without `list` on events is a warning once."""
        waiting = [job for job in jobs if job.active and job.pods == 0 and job.uid]
        if not waiting:
            return {}
        namespace = self.settings.namespace
        events = None
        try:
            with trio.move_on_after(EVENT_WAIT_S):
                events = await self.kube.list_events(namespace, EVENTS_SELECTOR)
        except KubeError as exc:
            if exc.message != self._events_unreadable:
                self._events_unreadable = exc.message
                denied = exc.code is ErrorCode.PERMISSION_DENIED
                log.log(
                    logging.WARNING if denied else logging.DEBUG,
                    "pool %s: cannot read the Job controller's Events, so pods the cluster "
                    "refuses are not shown: %s",
                    self.settings.name,
                    exc.message,
                    extra={"pool": self.settings.name, "error": exc.code.name},
                )
        if events is None:
            live = {job.node for job in waiting}
            return {node: why for node, why in self.refused.items() if node in live}
        self._events_unreadable = None
        refused = refused_nodes(namespace, waiting, events)
        for node in refused.keys() - self.refused.keys():
            log.warning(
                "pool %s: node %s: %s",
                self.settings.name,
                node,
                refused[node],
                extra={"pool": self.settings.name, "node": node},
            )
        return refused

    def _expected_jobs(self, jobs: list[JobFacts], secrets: set[str]) -> list[JobFacts]:
        """Settle the writes the caches now show, and count the Jobs created but not shown
        yet as this pool's pending workers (a pass planned without them would start a
        second worker on their nodes)."""
        active = {job.name for job in jobs if job.active}
        settled = self.expectations.observe(active, {job.name for job in jobs}, secrets)
        if settled:
            log.debug(
                "pool %s: the caches show %s",
                self.settings.name,
                ", ".join(e.describe() for e in settled),
                extra={"pool": self.settings.name},
            )
        for lapsed in self.expectations.lapse(trio.current_time()):
            log.warning(
                "pool %s: %s %.0f s ago, and the caches still do not show it; planning node "
                "%s again from what they show",
                self.settings.name,
                lapsed.describe(),
                trio.current_time() - lapsed.since,
                lapsed.node,
                extra={"pool": self.settings.name, "node": lapsed.node, "worker": lapsed.name},
            )
        known = {job.name for job in jobs}
        unseen = [
            JobFacts(
                name=e.name,
                node=e.node,
                generation=e.generation,
                created_at=e.created_at,
                active=True,
                pool=self._pool_label,
            )
            for e in self.expectations.created_jobs()
            if e.name not in known
        ]
        return jobs + unseen

    def _held(self) -> set[str]:
        """Nodes that get no action this pass: a write not shown by the caches yet, or a
        failed one waiting for its retry."""
        now = trio.current_time()
        held = set(self.expectations.unsettled())
        held.update(node for node, f in self.failures.items() if f.retry_at > now)
        return held

    async def _apply(
        self,
        node: str,
        actions: list[Action],
        now: float,
        counts: PassCounts,
        limiter: trio.CapacityLimiter,
    ) -> None:
        """One node's actions, in order; a failure is this node's alone: it is shown on the
        node and retried on the node's own backoff, and the other nodes go on."""
        async with limiter:
            try:
                for action in actions:
                    if isinstance(action, CreateJob):
                        if await self._create(action, now):
                            counts.jobs_created += 1
                    elif isinstance(action, CreateSecret):
                        await self._create_secret(action)
                    else:
                        await self._delete(action)
                        counts.jobs_deleted += 1
            except ApiError as exc:
                self._key_failed(node, exc)
                return
        if self.failures.pop(node, None) is not None:
            log.info(
                "pool %s: node %s: writes go through again",
                self.settings.name,
                node,
                extra={"pool": self.settings.name, "node": node},
            )

    def _key_failed(self, node: str, exc: ApiError) -> None:
        failure = self.failures.setdefault(node, KeyFailure(error="", retry_at=0.0))
        if failure.error != exc.message:
            # Once per distinct failure of the node, not once per retry.
            failure.error = exc.message
            log.warning(
                "pool %s: node %s: %s",
                self.settings.name,
                node,
                exc.message,
                extra={"pool": self.settings.name, "node": node, "error": exc.code.name},
            )
        policy = key_backoff(self.settings.reconcile_seconds)
        delay = next_delay(policy, failure.backoff, random.random())
        record_failure(failure.backoff)
        failure.retry_at = trio.current_time() + delay

    async def _pods_listed(self, nodes: Iterable[str]) -> None:
        """Wait (briefly) for the pods of nodes that entered after the pod cache's first list:
        planned before they are listed, a node's cards would all look free, and its worker Job
        would ask for cards another pod holds and never be scheduled. Past the wait the pass
        fails, as one on a cache that has not listed yet does, and is tried again."""
        cluster = self.caches.cluster
        if cluster is None:
            return
        with trio.move_on_after(PODS_LISTED_WAIT_S):
            while cluster.unlisted(nodes):
                await cluster.wait_listed()
        missing = sorted(cluster.unlisted(nodes))
        if missing:
            raise KubeError(
                ErrorCode.UNAVAILABLE,
                f"pool {self.settings.name}: the pods of node(s) {', '.join(missing[:3])} are "
                "not listed yet",
            )

    async def _adopt_tokens(self, jobs: list[JobFacts]) -> None:
        """A Job started before this controlplane (re)started: take its worker's token from
        the Job's Secret (cached), so the worker can register and reconnect its tunnel."""
        tokens = self.caches.secrets.items
        for job in jobs:
            if self.registry.has_token(job.name) or not job.active:
                continue
            token = tokens.get(f"{self.settings.namespace}/{token_secret_name(job.name)}")
            if token:
                await self.registry.add_worker(job.name, token)
                log.info(
                    "pool %s: adopted worker %s",
                    self.settings.name,
                    job.name,
                    extra={"pool": self.settings.name, "worker": job.name},
                )

    async def _note_finished(self, jobs: list[JobFacts]) -> None:
        """A worker whose Job has ended (the agent exited or was killed) is gone: whatever it
        was running is lost."""
        for name, gone in list(self._untold.items()):
            await self._tell_gone(name, gone)
        for job in jobs:
            if not job.active:
                await self._tell_gone(job.name, _Gone(f"its Job {job.name} ended", remove=False))

    async def _tell_gone(self, name: str, gone: _Gone) -> None:
        """The registry forgets the worker (`remove`) and the dispatcher marks its tasks lost,
        once. While the task database cannot take it, the worker is kept in `_untold` and
        told again at the next pass: a pass goes on, and no task stays on a worker that is
        gone."""
        if name in self._gone and not gone.remove:
            return
        try:
            if gone.remove:
                await self.registry.remove_worker(name)
            if self.on_worker_gone is not None and name not in self._gone:
                await self.on_worker_gone(name, gone.reason)
        except ApiError as exc:
            if name not in self._untold:
                log.warning(
                    "pool %s: worker %s is gone (%s), and its tasks cannot be marked lost yet: "
                    "%s; trying again at the next pass",
                    self.settings.name,
                    name,
                    gone.reason,
                    exc.message,
                    extra={"pool": self.settings.name, "worker": name, "error": exc.code.name},
                )
            self._untold[name] = gone
            return
        self._untold.pop(name, None)
        self._gone.add(name)

    def _fold_in(self, jobs: list[JobFacts], now: float) -> None:
        """Records for Jobs we did not start in this process (a controlplane restart), and the
        heartbeats the registry heard."""
        for job in jobs:
            if job.name not in self.records:
                self.records[job.name] = WorkerRecord(
                    job_name=job.name,
                    node=job.node,
                    state=WorkerState.PENDING,
                    created_at=job.created_at or now,
                )
        for name, record in list(self.records.items()):
            seen = self.registry.last_seen(name, now)
            if seen is not None and (record.last_heartbeat is None or seen > record.last_heartbeat):
                self.records[name] = attrs.evolve(
                    record, state=WorkerState.READY, last_heartbeat=seen
                )

    async def _create(self, action: CreateJob, now: float) -> bool:
        """Start the worker; False when its Job was there already (nothing new started)."""
        namespace = self.settings.namespace
        token = secrets.token_urlsafe(32)
        manifests = job_manifest(
            self.settings,
            action.node,
            action.cards,
            action.name,
            token_secret_name(action.name),
            self.controlplane_url,
            token=token,
            generation=action.generation,
            hostname=action.hostname,
            extra_env=self.extra_env or None,
        )
        # The registry accepts the token before the worker can possibly present it.
        await self.registry.add_worker(action.name, token)
        # Expected before the write: the cache may show the Job before the answer comes.
        self.expectations.expect(
            Expectation(
                action.node,
                Expecting.JOB_CREATED,
                action.name,
                trio.current_time(),
                generation=action.generation,
                created_at=now,
            )
        )
        try:
            job = await self.kube.create_job(namespace, manifests.job)
        except KubeAlreadyExists:
            # A retry of a create that went through: the name is deterministic, nothing doubles.
            log.info(
                "pool %s: job %s already exists",
                self.settings.name,
                action.name,
                extra={"pool": self.settings.name, "worker": action.name, "node": action.node},
            )
            return False
        except KubeError:
            self.expectations.forget(Expecting.JOB_CREATED, action.name)
            raise
        self.records[action.name] = WorkerRecord(
            job_name=action.name, node=action.node, state=WorkerState.PENDING, created_at=now
        )
        with trio.move_on_after(EVENT_WAIT_S):
            await self.events.record(
                job,
                "Created",
                f"created worker for {action.cards} free card(s) on {action.node}",
            )
        uid = str((job.get("metadata") or {}).get("uid", ""))
        await self._write_secret(action.node, action.name, with_job_uid(manifests.secret, uid))
        log.info(
            "pool %s: started worker %s on %s with %d card(s)",
            self.settings.name,
            action.name,
            action.node,
            action.cards,
            extra={
                "pool": self.settings.name,
                "worker": action.name,
                "node": action.node,
                "cards": action.cards,
            },
        )
        return True

    async def _write_secret(self, node: str, job: str, manifest: Mapping[str, Any]) -> None:
        """The worker's token Secret (owned by its Job), replacing one left from before."""
        namespace = self.settings.namespace
        name = token_secret_name(job)
        self.expectations.expect(
            Expectation(node, Expecting.SECRET_CREATED, name, trio.current_time())
        )
        try:
            try:
                await self.kube.create_secret(namespace, manifest)
            except KubeAlreadyExists:
                await self.kube.delete_secret(namespace, name)
                await self.kube.create_secret(namespace, manifest)
        except KubeError:
            # The Job stays; a later pass writes its Secret again (`CreateSecret`).
            self.expectations.forget(Expecting.SECRET_CREATED, name)
            raise

    async def _create_secret(self, action: CreateSecret) -> None:
        """A Job of ours without its token Secret: write it again from the token held here."""
        token = self.registry.token_of(action.job)
        cached = self.caches.jobs.items.get(f"{self.settings.namespace}/{action.job}")
        if token is None or cached is None:
            return
        secret = token_secret(
            self.settings, action.node, action.job, token_secret_name(action.job), token
        )
        await self._write_secret(action.node, action.job, with_job_uid(secret, cached.uid))
        log.info(
            "pool %s: wrote the token Secret of worker %s again",
            self.settings.name,
            action.job,
            extra={"pool": self.settings.name, "worker": action.job, "node": action.node},
        )

    async def _delete(self, action: DeleteJob) -> None:
        namespace = self.settings.namespace
        cached = self.caches.jobs.items.get(f"{namespace}/{action.name}")
        job = {
            "metadata": {
                "name": action.name,
                "namespace": namespace,
                "uid": cached.uid if cached is not None else "",
            }
        }
        with trio.move_on_after(EVENT_WAIT_S):
            await self.events.record(job, "Deleted", f"deleted: {action.reason}")
        node = action.node or (cached.node if cached is not None else "")
        self.expectations.expect(
            Expectation(node, Expecting.JOB_DELETED, action.name, trio.current_time())
        )
        try:
            for delete, name in (
                (self.kube.delete_job, action.name),
                (self.kube.delete_secret, token_secret_name(action.name)),
            ):
                try:
                    await delete(namespace, name)
                except KubeNotFound:
                    pass
        except KubeError:
            self.expectations.forget(Expecting.JOB_DELETED, action.name)
            raise
        await self._tell_gone(action.name, _Gone(f"its Job was deleted ({action.reason})"))
        log.info(
            "pool %s: deleted worker %s (%s)",
            self.settings.name,
            action.name,
            action.reason,
            extra={"pool": self.settings.name, "worker": action.name, "reason": action.reason},
        )

    async def remove_all(self) -> None:
        """The pool is gone from the config: delete its Jobs and Secrets (not the namespace,
        never a node)."""
        jobs = await self.kube.list_jobs(self.settings.namespace, self._jobs_selector)
        for job in jobs:
            name = str((job.get("metadata") or {}).get("name", ""))
            if name:
                await self._delete(DeleteJob(name=name, reason="its pool was removed"))
        self.records.clear()
