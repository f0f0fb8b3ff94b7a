"""Keeps one pool's machines and workers: list, plan, apply, every `reconcileSeconds`.

The decisions are `control.kube.planner.plan_pool`'s (pure); this module is the thin I/O around
it. Each pass lists the pool's nodes (by its selector), every pod (to see what other workloads
hold) and our Jobs, folds in what the worker registry heard (registrations, tunnels: the
heartbeats), plans, and applies the plan: a worker Job with its token Secret where a node has
free cards and no worker of ours, a Job deleted where its node stopped being a machine or its
worker's record expired. A Job's worker id is the Job's name and its token is minted here; the
registry accepts it from then on and forgets it when the Job is deleted.

A pass that fails (the cluster answered 401, or stayed unavailable through the adapter's
retries) changes nothing more and is logged with its reason; the next pass tries again.

Each pass logs one canonical line, its counts as fields (`pool`, `nodes`, `pods`, `jobs`,
`machines`, `skipped`, `jobs_created`, `jobs_deleted`, `duration_s`; `error` when it failed),
so a log pipeline filters and graphs passes without parsing the message.
"""

from __future__ import annotations

import calendar
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from control.kube.adapter import KubeAlreadyExists, KubeApi, KubeError, KubeNotFound
from control.kube.planner import (
    POOL_LABEL,
    TOKEN_KEY,
    CreateJob,
    DeleteJob,
    Machine,
    NotAMachine,
    Plan,
    PoolSettings,
    Selector,
    WorkerRecord,
    job_active,
    job_manifest,
    label_selector_text,
    plan_pool,
    token_secret_name,
    with_job_uid,
    worker_labels,
)
from control.kube.pools import PoolConfig
from control.models import WorkerState
from control.registry import WorkerRegistry

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
    )


@attrs.frozen
class PoolStatus:
    """What the last pass saw: the machines, the nodes that are not, and any failure."""

    pool: str
    machines: tuple[Machine, ...] = ()
    skipped: tuple[NotAMachine, ...] = ()
    passed_at: float | None = None
    error: str | None = None


def _created_at(job: Mapping[str, Any]) -> float | None:
    stamp = (job.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return None
    try:
        return float(calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


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

    def fields(self) -> dict[str, int]:
        return attrs.asdict(self)


FOLLOW_UP_S = 2.0
"""A pass that created or deleted Jobs is followed this soon by another, so the machines show
the new workers without waiting a whole `reconcileSeconds`."""


def next_pass_in_s(plan: Plan | None, reconcile_seconds: float) -> float:
    if plan is not None and plan.actions:
        return min(FOLLOW_UP_S, reconcile_seconds)
    return reconcile_seconds


class PoolReconciler:
    """One pool's reconcile loop; `run` in the controlplane's nursery."""

    def __init__(
        self,
        pool: PoolConfig,
        kube: KubeApi,
        registry: WorkerRegistry,
        *,
        controlplane_url: str,
        extra_env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        on_worker_gone: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings_of(pool)
        self.kube = kube
        self.registry = registry
        self.controlplane_url = controlplane_url
        self.extra_env = dict(extra_env or {})
        self.clock = clock
        self.records: dict[str, WorkerRecord] = {}
        self.on_worker_gone = on_worker_gone
        self._gone: set[str] = set()
        self.status = PoolStatus(pool=pool.name)
        self.passes = trio.lowlevel.ParkingLot()
        self._namespace_ready = False
        self._jobs_selector = f"{POOL_LABEL}={worker_labels(pool.name, '')[POOL_LABEL]}"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            plan = await self.reconcile_once()
            await trio.sleep(next_pass_in_s(plan, self.settings.reconcile_seconds))

    async def reconcile_once(self) -> Plan | None:
        """One pass; returns its plan, or None when the cluster could not be read or written."""
        started = time.monotonic()
        counts = PassCounts()
        name = self.settings.name
        try:
            plan = await self._pass(counts)
        except KubeError as exc:
            log.warning(
                "pool %s: reconcile failed: %s",
                name,
                exc.message,
                extra={
                    "pool": name,
                    **counts.fields(),
                    "duration_s": round(time.monotonic() - started, 3),
                    "error": exc.code.name,
                },
            )
            self.status = attrs.evolve(self.status, error=exc.message, passed_at=self.clock())
            self.passes.unpark_all()
            return None
        self.status = PoolStatus(
            pool=name,
            machines=plan.machines,
            skipped=plan.skipped,
            passed_at=self.clock(),
        )
        log.info(
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
        self.passes.unpark_all()
        return plan

    async def _pass(self, counts: PassCounts) -> Plan:
        namespace = self.settings.namespace
        if not self._namespace_ready:
            await self.kube.ensure_namespace(namespace)
            self._namespace_ready = True
        nodes = await self.kube.list_nodes(label_selector_text(self.settings.selector))
        counts.nodes = len(nodes)
        pods = await self.kube.list_pods()
        counts.pods = len(pods)
        jobs = await self.kube.list_jobs(namespace, self._jobs_selector)
        counts.jobs = len(jobs)
        now = self.clock()
        await self._adopt_tokens(jobs)
        await self._note_finished(jobs)
        self._fold_in(jobs, now)
        plan = plan_pool(self.settings, nodes, pods, jobs, self.records.values(), now)
        counts.machines = len(plan.machines)
        counts.skipped = len(plan.skipped)
        for action in plan.actions:
            if isinstance(action, CreateJob):
                if await self._create(action, now):
                    counts.jobs_created += 1
            else:
                await self._delete(action)
                counts.jobs_deleted += 1
        return plan

    async def _adopt_tokens(self, jobs: list[dict[str, Any]]) -> None:
        """A Job started before this controlplane (re)started: read its worker's token back
        from the Job's Secret, so the worker can register and reconnect its tunnel."""
        for job in jobs:
            name = str((job.get("metadata") or {}).get("name", ""))
            if not name or self.registry.knows(name) or not job_active(job):
                continue
            token = await self.kube.read_secret_value(
                self.settings.namespace, token_secret_name(name), TOKEN_KEY
            )
            if token:
                self.registry.add_worker(name, token)
                log.info(
                    "pool %s: adopted worker %s",
                    self.settings.name,
                    name,
                    extra={"pool": self.settings.name, "worker": name},
                )

    async def _note_finished(self, jobs: list[dict[str, Any]]) -> None:
        """A worker whose Job has ended (the agent exited or was killed) is gone: whatever it
        was running is lost."""
        for job in jobs:
            name = str((job.get("metadata") or {}).get("name", ""))
            if not name or job_active(job) or name in self._gone:
                continue
            self._gone.add(name)
            if self.on_worker_gone is not None:
                await self.on_worker_gone(name, f"its Job {name} ended")

    def _fold_in(self, jobs: list[dict[str, Any]], now: float) -> None:
        """Records for Jobs we did not start in this process (a controlplane restart), and the
        heartbeats the registry heard."""
        for job in jobs:
            meta = job.get("metadata") or {}
            name = str(meta.get("name", ""))
            if name and name not in self.records:
                node = str((meta.get("annotations") or {}).get("levers9.dev/node", ""))
                self.records[name] = WorkerRecord(
                    job_name=name,
                    node=node,
                    state=WorkerState.PENDING,
                    created_at=_created_at(job) or now,
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
        self.registry.add_worker(action.name, token)
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
        uid = str((job.get("metadata") or {}).get("uid", ""))
        try:
            await self.kube.create_secret(namespace, with_job_uid(manifests.secret, uid))
        except KubeAlreadyExists:
            await self.kube.delete_secret(namespace, token_secret_name(action.name))
            await self.kube.create_secret(namespace, with_job_uid(manifests.secret, uid))
        self.records[action.name] = WorkerRecord(
            job_name=action.name, node=action.node, state=WorkerState.PENDING, created_at=now
        )
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

    async def _delete(self, action: DeleteJob) -> None:
        namespace = self.settings.namespace
        for delete, name in (
            (self.kube.delete_job, action.name),
            (self.kube.delete_secret, token_secret_name(action.name)),
        ):
            try:
                await delete(namespace, name)
            except KubeNotFound:
                pass
        await self.registry.remove_worker(action.name)
        if self.on_worker_gone is not None and action.name not in self._gone:
            self._gone.add(action.name)
            await self.on_worker_gone(action.name, f"its Job was deleted ({action.reason})")
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
