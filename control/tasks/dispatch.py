"""Tasks onto workers: the scheduling loop and one watcher per task placed on a worker.

The loop wakes when something changes (a task is created or ends, a worker registers, opens
its tunnel or winds down) and at least every `SCHEDULE_EVERY_S`; it reads the pending queue and
what each worker has free, asks the pure `control.tasks.scheduler.schedule` for a plan, records why
each remaining task waits, and carries the plan out: the record moves to starting on its
worker first (so a restart never places a task twice), then a watcher is started.

A watcher owns its task until the task ends: it creates the container on the worker (through
whichever way the registry reaches it), reports pull progress, records running with the cards
the worker gave, waits for the exit, then keeps the task's log in the task database and lets
the worker delete the container. It rides out a worker's reconnects (a tunnel coming back, a
restarted controlplane adopting the task again) for up to `lost_after_s`; a worker that stays
unreachable, or whose Job has ended, has lost the task. Cancelling a task and its timeout stop
the container through the same watcher, so one owner cleans up.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import attrs
import trio

from control.db.base import TaskStoreError
from control.models import TaskSnapshot, TaskState, TaskView
from control.tasks.scheduler import (
    MachineSize,
    PendingTask,
    Retire,
    SchedulePlan,
    WorkerCapacity,
    beyond_every_machine,
    idle_workers_to_retire,
    schedule,
)
from control.tasks.store import (
    ACTIVE_ON_WORKER,
    Cancel,
    Exited,
    Failed,
    Lost,
    Running,
    Start,
    TaskRecord,
    TaskStore,
    TransitionError,
)
from control.workers.registry import WorkerEntry, WorkerRegistry
from control.workspaces import Workspaces
from wire.backoff import Backoff, BackoffState, next_delay, record_failure
from wire.errors import ApiError, ErrorCode, dumps
from workerapi.client import WorkerClient
from workerapi.models import (
    ContainerSpec,
    ContainerState,
    ContainerStatus,
    RegistryAuth,
    Resources,
    VolumeSpec,
)

log = logging.getLogger("levers9.dispatch")
T = TypeVar("T")

TASK_LABEL = "levers9.dev/task"
SCHEDULE_EVERY_S = 2.0
PROGRESS_EVERY_S = 0.25
PROGRESS_IDLE_S = 2.0
RETRY_EVERY_S = 0.5
CLEANUP_S = 30.0
STOP_GRACE_S = 5.0
STORE_RETRY = Backoff(initial_s=0.2, cap_s=2.0)
"""How often a watcher writes its task's record again while the task database is away."""
"""How long a stopping controlplane lets clean-ups under way finish; then they are cut short
(their containers are removed by the next controlplane's first sync of each worker)."""
SNAPSHOT_SOURCE_WAIT_S = 10.0
"""How long a worker holding a snapshot may take to answer before the next holder is asked."""
NOT_FOLLOWED = "the controlplane failed to follow the task"
"""An ended task's reason when its watcher broke on something unforeseen (a bug: the log has
the traceback)."""
LOG_KEEP_BYTES = 4 << 20
"""The most of an ended task's log the controlplane keeps (its end, in whole lines)."""


class WorkerLost(Exception):
    """The worker running a task is gone or stayed unreachable too long."""


@attrs.frozen
class Hold:
    cards: int
    cpu_millis: int
    memory_bytes: int


@attrs.define(eq=False)
class _Watch:
    worker: str
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    cancelled: bool = False
    lost: bool = False
    handed_over: bool = False
    """Another replica owns the worker now and watches the task; this watcher just stops."""


def is_ready(entry: WorkerEntry, now: float, lost_after_s: float) -> bool:
    """A worker takes tasks once it has registered, while it is reachable and not winding
    down."""
    if entry.registered_at is None or entry.draining or not entry.runs_containers:
        return False
    if entry.mode == "tunnel":
        return entry.tunnel is not None and entry.tunnel.conn.usable
    if entry.direct is not None and not entry.direct.conn.usable:
        return False  # its connection broke; ready again when it registers again
    return now - entry.registered_at < lost_after_s


def capacities(
    entries: list[WorkerEntry],
    holding: dict[str, dict[str, Hold]],
    now: float,
    lost_after_s: float,
) -> list[WorkerCapacity]:
    """What each worker has free: what it reported less what its placed tasks hold. Pure."""
    out = []
    for entry in entries:
        held = holding.get(entry.worker_id, {}).values()
        out.append(
            WorkerCapacity(
                worker_id=entry.worker_id,
                node=entry.node or "",
                ready=is_ready(entry, now, lost_after_s),
                draining=entry.draining,
                cards_free=max(0, entry.cards - sum(h.cards for h in held)),
                cpu_free_millis=max(0, entry.cpu_millis - sum(h.cpu_millis for h in held)),
                memory_free_bytes=max(0, entry.memory_bytes - sum(h.memory_bytes for h in held)),
                cards_total=entry.cards,
                cpu_total_millis=entry.cpu_millis,
                memory_total_bytes=entry.memory_bytes,
            )
        )
    return out


def _watch_ended_by(record: TaskRecord, exc: Exception) -> Failed | Lost:
    """What a watcher's error means for its task. The worker's answer is the task's (its
    container gone: lost). Anything else, a record that could not be written included (the
    database being away is waited out, so not that), is logged: the task was not followed."""
    if isinstance(exc, ApiError) and not isinstance(exc, TaskStoreError):
        if exc.code is ErrorCode.NOT_FOUND:
            return Lost(f"worker {record.worker} no longer has its container")
        return Failed(exc.message)
    log.error(
        "task %s: watching it failed",
        record.id,
        exc_info=exc,
        extra=_fields(task=record.id, worker=record.worker),
    )
    return Failed(NOT_FOLLOWED)


def unreachable(exc: ApiError) -> bool:
    """Whether a worker call failed because the worker could not be reached (its connection,
    its tunnel, the replica holding it): worth asking again. An UNAVAILABLE that names a field
    of the request is the worker's answer about that request (`image`: its registry cannot be
    reached) and is the task's to keep, at once."""
    return exc.code is ErrorCode.UNAVAILABLE and exc.field is None


def outcome(status: ContainerStatus) -> Exited | Failed:
    """The task event for a container that has ended."""
    if status.state is ContainerState.EXITED and status.exit_code is not None:
        if status.oom_killed:
            return Failed(
                f"killed for using more memory than it asked for (exit {status.exit_code})"
            )
        return Exited(status.exit_code)
    return Failed(status.error or f"the container ended in state {status.state}")


def container_spec(
    record: TaskRecord,
    volumes: tuple[VolumeSpec, ...],
    *,
    registry_auth: RegistryAuth | None,
    pull_policy: str,
) -> ContainerSpec:
    """The container a task asks its worker for: the task's process and limits, its buckets
    (`volumes`, credentials attached), its workspace's registry login and pull policy, and the
    labels that tie the container to the task."""
    spec = record.spec
    return ContainerSpec(
        image=spec.image,
        id=record.id,
        command=spec.command,
        args=spec.args,
        env=dict(spec.env),
        cards=spec.cards,
        resources=Resources(cpu_millis=spec.cpu_millis, memory_bytes=spec.memory_bytes),
        ports=spec.ports,
        snapshot=spec.snapshot,
        volumes=volumes,
        registry_auth=registry_auth,
        pull_policy=pull_policy,
        labels={TASK_LABEL: record.id, "levers9.dev/workspace": record.workspace},
    )


def _fields(**fields: object) -> dict[str, object]:
    """Log fields, leaving out those not known (None)."""
    return {key: value for key, value in fields.items() if value is not None}


def _duration_s(record: TaskRecord) -> float | None:
    """How long an ended task ran: from its container running (or its placement) to its end."""
    begun = record.running_at if record.running_at is not None else record.started_at
    if begun is None or record.finished_at is None:
        return None
    return round(record.finished_at - begun, 3)


def keep_tail(lines: list[bytes], limit_bytes: int) -> bytes:
    """The last whole lines that fit in `limit_bytes`. Pure."""
    kept: collections.deque[bytes] = collections.deque()
    size = 0
    for line in reversed(lines):
        if size + len(line) > limit_bytes:
            break
        kept.appendleft(line)
        size += len(line)
    return b"".join(kept)


class Dispatcher:
    def __init__(
        self,
        store: TaskStore,
        registry: WorkerRegistry,
        workspaces: Workspaces,
        *,
        lost_after_s: float,
        clock: Callable[[], float] = time.time,
        machines: Callable[[], Sequence[MachineSize]] = tuple,
        retire: Callable[[Retire], bool] = lambda retire: False,
        on_ended: Sequence[Callable[[str], Awaitable[object]]] = (),
        on_placed: Sequence[Callable[[TaskRecord], None]] = (),
    ) -> None:
        self.store = store
        self.registry = registry
        self.workspaces = workspaces
        self.lost_after_s = lost_after_s
        self.clock = clock
        self.machines = machines
        """The pools' machines: a task larger than all of them waits with a reason that names
        the largest."""
        self.retire = retire
        """Ask the pool that runs the worker to delete it; False when no pool here runs it."""
        self._retiring: dict[str, Retire] = {}
        """Task id → the idle worker given up for it, until the task no longer waits or the
        worker's successor registered."""
        self._retired: set[str] = set()
        """Workers given up: none takes a task again (their Jobs are being deleted)."""
        self.waiting: dict[str, str] = {}
        self.progress: dict[str, ContainerStatus] = {}
        self._holding: dict[str, dict[str, Hold]] = {}
        self._watches: dict[str, _Watch] = {}
        self._running_records: dict[str, TaskRecord] = {}
        self._syncing: set[str] = set()
        self._synced: set[str] = set()
        self._wake = trio.Event()
        self._changed = trio.lowlevel.ParkingLot()
        self._cleanups: set[trio.CancelScope] = set()
        self._cleanup_ended = trio.lowlevel.ParkingLot()
        self._adopted: set[str] = set()
        """Workers whose tasks this replica watches (with several replicas: those it owns)."""
        self._nursery: trio.Nursery | None = None
        self.on_ended = tuple(on_ended)
        """Called with a task's id once its watcher is done (its container is gone)."""
        self.on_placed = tuple(on_placed)
        """Called with each task this replica placed on a worker, as placed (metrics)."""

    # -- the loop ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.registry.replication is None:
                for record in await self.store.active():
                    # A restarted controlplane: every task it had placed is watched again.
                    self._hold(record)
                    nursery.start_soon(self._watch, record, True)
            self.registry.listeners.append(self.wake)
            # Another replica created, cancelled or moved a task: look now, not at the next
            # period (scheduling, cancels, and every follow and wait here).
            await nursery.start(self.store.watch_changes, self._heard)
            task_status.started()
            try:
                while True:
                    with trio.move_on_after(SCHEDULE_EVERY_S) as timer:
                        await self._wake.wait()
                    self._wake = trio.Event()
                    try:
                        if self.registry.replication is not None:
                            await self.follow_ownership()
                            if timer.cancelled_caught:
                                await self.look_for_ends_elsewhere()
                        await self.schedule_once()
                    except ApiError as exc:
                        log.warning(
                            "scheduling pass failed: %s",
                            exc.message,
                            extra={"code": exc.code.name},
                        )
            finally:
                self.registry.listeners.remove(self.wake)
                await self._cut_cleanups()

    async def _cut_cleanups(self) -> None:
        """Stopping: clean-ups under way (shielded) get `STOP_GRACE_S`, then are cancelled, so
        one that cannot reach its worker does not hold the shutdown for `CLEANUP_S`."""
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_GRACE_S):
            while self._cleanups:
                await self._cleanup_ended.park()
        for scope in self._cleanups:
            scope.cancel()

    def takes_tasks(self, worker_id: str) -> bool:
        """Whether placement considers the worker: it registered and the containers it held
        from before (strays) were removed. Until then its tasks go to workers that are."""
        return worker_id in self._synced

    def wake(self) -> None:
        self._wake.set()

    def _heard(self, task_id: str, what: str) -> None:
        """Another replica changed a task: a new one is scheduled now; one watched here that
        ended there (a cancel that arrived there, a worker it found gone) stops its watcher;
        whoever waits on a task here looks again."""
        self.changed()
        if what == TaskState.PENDING.value:
            self.wake()
            return
        watch = self._watches.get(task_id)
        try:
            state = TaskState(what)
        except ValueError:
            return  # its kept log
        if watch is not None and state.terminal:
            self._ended_elsewhere(task_id, watch, state)

    def _ended_elsewhere(self, task_id: str, watch: _Watch, state: TaskState) -> None:
        if watch.cancelled or watch.lost:
            return
        if state is TaskState.CANCELLED:
            watch.cancelled = True
        else:
            watch.lost = True
        self._running_records.pop(task_id, None)
        watch.scope.cancel()

    def changed(self) -> None:
        self._changed.unpark_all()

    async def wait_changed(self) -> None:
        """Until any task changes state or progress (callers loop on their own condition)."""
        await self._changed.park()

    async def follow_ownership(self) -> None:
        """Several replicas: watch the tasks of the workers this replica owns, and hand over
        those of workers another replica took."""
        assert self._nursery is not None
        for watch in self._watches.values():
            if not self.registry.owns(watch.worker) and not watch.handed_over:
                watch.handed_over = True
                watch.scope.cancel()
        owned = self.registry.owned_ids()
        self._adopted &= owned
        for worker in sorted(owned - self._adopted):
            self._adopted.add(worker)
            for record in await self.store.running_on(worker):
                if record.id not in self._watches:
                    self._hold(record)
                    self._nursery.start_soon(self._watch, record, True)

    async def look_for_ends_elsewhere(self) -> None:
        """What `_heard` does, from the records: for a notification this replica missed (its
        listening connection was being opened again)."""
        watched = [i for i, w in self._watches.items() if not (w.cancelled or w.lost)]
        for task_id, state in (await self.store.states(watched)).items():
            watch = self._watches.get(task_id)
            if state.terminal and watch is not None:
                self._ended_elsewhere(task_id, watch, state)

    def _sync_new(self, workers: list[WorkerCapacity]) -> None:
        """A worker seen ready for the first time is synced before it takes tasks."""
        assert self._nursery is not None
        for worker in workers:
            if worker.ready and worker.worker_id not in self._syncing:
                self._syncing.add(worker.worker_id)
                self._nursery.start_soon(self._sync_worker, worker.worker_id)

    async def _sync_worker(self, worker_id: str) -> None:
        """Remove the containers a worker holds that no task here owns: those of tasks that
        were marked lost while their worker was away (a new agent on the node adopts what the
        killed one left running). Then the worker takes tasks."""

        async def remove_strays(client: WorkerClient) -> None:
            # Judged by the records, not by this replica's watchers: with several replicas a
            # task another replica placed is adopted here only as its watcher starts.
            active = {record.id for record in await self.store.running_on(worker_id)}
            for container in await client.containers():
                if TASK_LABEL not in container.labels or container.id in active:
                    continue  # not a task's, or a task that has not ended
                if container.id in self._watches:
                    continue  # ending now: its watcher cleans up
                log.warning(
                    "worker %s: removing container %s, which no task owns any more",
                    worker_id,
                    container.id,
                    extra={"worker": worker_id, "container": container.id},
                )
                if not container.state.finished:
                    await client.stop_container(container.id, grace_s=0)
                await client.delete_container(container.id)

        try:
            await self.on_worker(worker_id, remove_strays)
        except (ApiError, WorkerLost) as exc:
            log.warning(
                "worker %s: could not remove stray containers: %s",
                worker_id,
                exc,
                extra={"worker": worker_id},
            )
        self._synced.add(worker_id)
        self.wake()

    async def schedule_once(self) -> None:
        replication = self.registry.replication
        if replication is not None and replication.peers is not None:
            owned = self.registry.owned_entries()
            now = self.clock()
            if not any(is_ready(e, now, self.lost_after_s) for e in owned):
                # Several replicas, and the others hold every worker: they place the tasks
                # (and say why one waits).
                self._sync_new(capacities(owned, self._holding, now, self.lost_after_s))
                return
        pending = await self.store.pending()
        if not pending:
            self.waiting = {}
            now = self.clock()
            self._sync_new(
                capacities(self.registry.owned_entries(), self._holding, now, self.lost_after_s)
            )
            return
        now = self.clock()
        workers = capacities(self.registry.owned_entries(), self._holding, now, self.lost_after_s)
        self._sync_new(workers)
        workers = [
            attrs.evolve(w, draining=True) if w.worker_id in self._retired else w
            for w in workers
            if w.worker_id in self._synced
        ]
        tasks = [
            PendingTask(
                id=r.id,
                workspace=r.workspace,
                created_seq=i,
                cards=r.spec.cards,
                cpu_millis=r.spec.cpu_millis or 0,
                memory_bytes=r.spec.memory_bytes or 0,
            )
            for i, r in enumerate(pending)
        ]
        plan = schedule(tasks, workers, now)
        machines = self.machines()
        self._retire_idle(tasks, plan, workers, machines)
        asked = {r.id: r.spec.cards for r in pending}
        waiting = {
            w.task_id: (
                self._retiring[w.task_id].waiting
                if w.task_id in self._retiring
                else beyond_every_machine(asked[w.task_id], machines) or w.reason
            )
            for w in plan.waiting
        }
        if waiting != self.waiting:
            self.waiting = waiting
            self.changed()
        by_id = {r.id: r for r in pending}
        for assignment in plan.assignments:
            record = by_id[assignment.task_id]
            entry = self.registry.entry(assignment.worker_id)
            if entry is None or entry.draining:
                continue  # it deregistered while earlier placements were written
            # Held before the write, so a deregistration meanwhile sees the worker is busy.
            placed = attrs.evolve(record, worker=assignment.worker_id)
            self._hold(placed)
            try:
                started = await self.store.apply(
                    record.workspace,
                    record.id,
                    Start(worker=assignment.worker_id, node=entry.node),
                )
            except TransitionError:
                self._release(placed)
                continue  # cancelled meanwhile
            except BaseException:
                self._release(placed)
                raise
            log.info(
                "task %s placed on worker %s",
                record.id,
                assignment.worker_id,
                extra=_fields(
                    task=record.id,
                    worker=assignment.worker_id,
                    node=entry.node,
                    workspace=record.workspace,
                ),
            )
            for placed_hook in self.on_placed:
                placed_hook(started)
            assert self._nursery is not None
            self._nursery.start_soon(self._watch, started, False)
        if plan.assignments:
            self.changed()

    def _retire_idle(
        self,
        tasks: Sequence[PendingTask],
        plan: SchedulePlan,
        workers: Sequence[WorkerCapacity],
        machines: Sequence[MachineSize],
    ) -> None:
        """Give up idle workers whose cards with their node's free ones make room for a
        waiting task (`idle_workers_to_retire`); forget a promise once its task no longer waits
        or a worker other than the retired one is ready on its node."""
        self._retired.intersection_update(e.worker_id for e in self.registry.entries())
        waiting_ids = {w.task_id for w in plan.waiting}
        for task_id, retire in list(self._retiring.items()):
            successor = any(
                w.node == retire.node and w.ready and w.worker_id != retire.worker_id
                for w in workers
            )
            if task_id not in waiting_ids or successor:
                del self._retiring[task_id]
        if not machines:
            return
        decided = idle_workers_to_retire(
            [t for t in tasks if t.id in waiting_ids],
            workers,
            # A worker this very plan places a task on is not idle either.
            busy={worker for worker, held in self._holding.items() if held}
            | {a.worker_id for a in plan.assignments},
            machines=machines,
            promised=self._retiring.keys(),
        )
        for retire in decided:
            if not self.retire(retire):
                continue
            # No placement goes there from now on: it holds nothing, and its Job is deleted.
            self._retiring[retire.task_id] = retire
            self._retired.add(retire.worker_id)
            log.info(
                "worker %s %s",
                retire.worker_id,
                retire.why,
                extra=_fields(worker=retire.worker_id, node=retire.node, task=retire.task_id),
            )

    def _hold(self, record: TaskRecord) -> None:
        assert record.worker is not None
        self._holding.setdefault(record.worker, {})[record.id] = Hold(
            cards=record.spec.cards,
            cpu_millis=record.spec.cpu_millis or 0,
            memory_bytes=record.spec.memory_bytes or 0,
        )

    def _release(self, record: TaskRecord) -> None:
        if record.worker is not None:
            self._holding.get(record.worker, {}).pop(record.id, None)

    async def running_record(self, workspace: str, task_id: str) -> TaskRecord:
        """The task's record, from memory while its watcher knows it runs (every endpoint
        request and port connection asks; the database is read only otherwise)."""
        record = self._running_records.get(task_id)
        if record is not None and record.workspace == workspace:
            watch = self._watches.get(task_id)
            if watch is not None and not (watch.cancelled or watch.lost):
                return record
        return await self.store.get(workspace, task_id)

    def watching(self, task_id: str) -> bool:
        return task_id in self._watches

    def has_tasks(self, worker_id: str) -> bool:
        return bool(self._holding.get(worker_id))

    @property
    def watchers(self) -> int:
        """How many task watchers run (a task being placed, followed or cleaned up)."""
        return len(self._watches)

    # -- what users ask ---------------------------------------------------------------------

    def view(self, record: TaskRecord) -> TaskView:
        spec = record.spec
        status = self.progress.get(record.id)
        entry = self.registry.entry(record.worker) if record.worker is not None else None
        return TaskView(
            id=record.id,
            workspace=record.workspace,
            state=record.state,
            image=spec.image,
            created_at=record.created_at,
            command=spec.command,
            args=spec.args,
            cards=spec.cards,
            cpu_millis=spec.cpu_millis,
            memory_bytes=spec.memory_bytes,
            ports=spec.ports,
            timeout_s=spec.timeout_s,
            snapshot=spec.snapshot,
            started_at=record.started_at,
            running_at=record.running_at,
            finished_at=record.finished_at,
            worker=record.worker,
            node=record.node,
            card_ids=record.cards,
            exit_code=record.exit_code,
            reason=record.reason,
            waiting=self.waiting.get(record.id) if record.state is TaskState.PENDING else None,
            pull=status.pull if status is not None else None,
            container_state=status.state if status is not None else None,
            card_model=entry.card_model if entry is not None and record.cards else None,
        )

    async def cancel(self, workspace: str, task_id: str) -> TaskRecord:
        record = await self.store.apply(workspace, task_id, Cancel())
        self._running_records.pop(task_id, None)
        watch = self._watches.get(task_id)
        if watch is not None:
            watch.cancelled = True
            watch.scope.cancel()
        log.info(
            "task %s cancelled",
            task_id,
            extra=_fields(task=task_id, workspace=workspace, worker=record.worker),
        )
        self.changed()
        self.wake()
        return record

    async def wait_ended(self, workspace: str, task_id: str) -> TaskRecord:
        """The record once the task has ended (under the caller's deadline)."""
        while True:
            record = await self.store.get(workspace, task_id)
            if record.state.terminal:
                return record
            with trio.move_on_after(SCHEDULE_EVERY_S):
                await self.wait_changed()

    async def snapshot(self, workspace: str, task_id: str) -> TaskSnapshot:
        record = await self.store.get(workspace, task_id)
        if record.state not in ACTIVE_ON_WORKER or record.worker is None:
            # A starting task goes to its worker, which refuses if the container is not up.
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"task {task_id} is {record.state.value}; only a running task can be snapshotted",
            )
        info = await self.on_worker(
            record.worker, lambda client: client.snapshot_container(task_id)
        )
        return TaskSnapshot(digest=info.digest, size=info.size, task=task_id, worker=record.worker)

    async def worker_gone(self, worker_id: str, reason: str) -> None:
        """The worker's Job ended or was deleted: its tasks are lost."""
        lost = await self.store.mark_worker_lost(worker_id, f"worker {worker_id} is gone: {reason}")
        for record in lost:
            self._running_records.pop(record.id, None)
            log.warning(
                "task %s lost: %s",
                record.id,
                record.reason,
                extra=_fields(task=record.id, worker=worker_id, node=record.node),
            )
            watch = self._watches.get(record.id)
            if watch is not None:
                watch.lost = True
                watch.scope.cancel()
            self._release(record)
        # Its agent has exited: forget it (its token stops working, its clients close).
        await self.registry.remove_worker(worker_id)
        self._syncing.discard(worker_id)
        self._synced.discard(worker_id)
        self._holding.pop(worker_id, None)
        self._retired.discard(worker_id)
        self.changed()
        self.wake()

    def busy_cards(self) -> dict[str, int]:
        """Node → the cards tasks placed on our worker there hold (their own, not the
        worker's)."""
        busy: dict[str, int] = {}
        for entry in self.registry.entries():
            held = sum(h.cards for h in self._holding.get(entry.worker_id, {}).values())
            if entry.node is not None and held:
                busy[entry.node] = busy.get(entry.node, 0) + held
        return busy

    # -- talking to a worker ----------------------------------------------------------------

    async def on_worker(self, worker_id: str, call: Callable[[WorkerClient], Awaitable[T]]) -> T:
        """`call` with the worker's client, retried while the worker is unreachable (a tunnel
        reconnecting); WorkerLost once it has been unreachable for `lost_after_s`."""
        first_failure: float | None = None
        while True:
            try:
                with trio.fail_after(self.lost_after_s):
                    client = await self.registry.client_for(worker_id)
                return await call(client)
            except trio.TooSlowError:
                raise WorkerLost(
                    f"worker {worker_id} was unreachable for {self.lost_after_s:g} s"
                ) from None
            except ApiError as exc:
                # An unknown worker may be one a restarted controlplane has not adopted yet
                # (its pool's first pass reads its token back); a gone one is reported by its
                # pool (`worker_gone`), or stays unknown until `lost_after_s`.
                unknown = exc.code is ErrorCode.NOT_FOUND and not self.registry.knows(worker_id)
                if not (unreachable(exc) or unknown):
                    raise
                now = trio.current_time()
                first_failure = now if first_failure is None else first_failure
                if now - first_failure >= self.lost_after_s:
                    raise WorkerLost(
                        f"worker {worker_id} was unreachable for {self.lost_after_s:g} s "
                        f"({exc.message})"
                    ) from None
                await trio.sleep(RETRY_EVERY_S)

    # -- one task's watcher -----------------------------------------------------------------

    async def _watch(self, record: TaskRecord, adopted: bool) -> None:
        assert record.worker is not None
        watch = _Watch(record.worker)
        self._watches[record.id] = watch
        try:
            with watch.scope:
                await self._carry(record, adopted)
            if watch.handed_over:
                log.info(
                    "task %s: worker %s is owned by another replica now, which watches it",
                    record.id,
                    record.worker,
                    extra=_fields(task=record.id, worker=record.worker),
                )
            elif watch.cancelled:
                await self._clean_up(record, stop=True)
        except WorkerLost as exc:
            await self._settle_last(record, Lost(str(exc)))
        except Exception as exc:
            await self._settle_last(record, _watch_ended_by(record, exc))
        finally:
            for hook in self.on_ended:
                with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_S):
                    await hook(record.id)
            self._watches.pop(record.id, None)
            self._running_records.pop(record.id, None)
            self.progress.pop(record.id, None)
            self._release(record)
            self.changed()
            self.wake()

    async def _settle_last(self, record: TaskRecord, event: Failed | Lost) -> None:
        """A watcher's last word: its failure to write is logged, and goes no further (one
        task's watcher never stops the dispatcher's other tasks)."""
        try:
            await self._settle(record, event)
        except ApiError:
            log.exception(
                "task %s: recording that it ended (%s) failed",
                record.id,
                event,
                extra=_fields(task=record.id, worker=record.worker),
            )

    async def _write(
        self, record: TaskRecord, event: Exited | Failed | Lost | Running
    ) -> TaskRecord:
        """`store.apply`, written again while the task database is away (`_stored`)."""
        return await self._stored(
            record, lambda: self.store.apply(record.workspace, record.id, event)
        )

    async def _stored(self, record: TaskRecord, write: Callable[[], Awaitable[T]]) -> T:
        """`write` of the task's record or log, again while the task database is away
        (restarting, failing over: UNAVAILABLE), for as long as it takes: what the worker said
        is not given up, and a database that went away is not the task's failure."""
        backoff = BackoffState()
        waiting = False
        while True:
            try:
                return await write()
            except TaskStoreError as exc:
                if exc.code is not ErrorCode.UNAVAILABLE:
                    raise
                if not waiting:
                    log.warning(
                        "task %s: its record cannot be written yet (%s); trying again",
                        record.id,
                        exc.message,
                        extra=_fields(task=record.id, worker=record.worker),
                    )
                waiting = True
            await trio.sleep(next_delay(STORE_RETRY, backoff, random.random()))
            record_failure(backoff)

    async def _settle(self, record: TaskRecord, event: Exited | Failed | Lost) -> TaskRecord | None:
        self._running_records.pop(record.id, None)
        try:
            after = await self._write(record, event)
        except TransitionError:
            return None  # cancelled or lost meanwhile
        log.info(
            "task %s %s%s",
            record.id,
            after.state.value,
            f": {after.reason}" if after.reason else "",
            extra=_fields(
                task=record.id,
                worker=after.worker,
                node=after.node,
                state=after.state.value,
                exit_code=after.exit_code,
                duration_s=_duration_s(after),
            ),
        )
        self.changed()
        return after

    async def _carry(self, record: TaskRecord, adopted: bool) -> None:
        assert record.worker is not None
        worker = record.worker
        task_id = record.id
        deadline = None
        if record.spec.timeout_s is not None:
            begun = record.started_at or self.clock()
            deadline = trio.current_time() + max(0.0, begun + record.spec.timeout_s - self.clock())
        status: ContainerStatus | None = None
        with trio.move_on_at(deadline if deadline is not None else float("inf")) as timeout:
            status = await self._start(record, adopted)
            if status is None:
                return
            if not status.state.finished:
                # The worker answers once the container has ended: its answer is the end, also
                # in a state a newer worker added (`outcome` fails the task naming it).
                status = await self.on_worker(worker, lambda c: c.wait_container(task_id))
        if timeout.cancelled_caught or status is None:
            await self._settle(
                record, Failed(f"ran past its timeout of {record.spec.timeout_s:g} s; stopped")
            )
            await self._clean_up(record, stop=True)
            return
        if status.started_at is not None and record.state is not TaskState.RUNNING:
            await self._running(record, status)
        # The log is kept before the end is written: a worker gone in between loses the task
        # (its output with it), never leaves it ended with its output missing.
        try:
            await self._keep_log(record)
        except ApiError as exc:
            # The worker is there but its log is not (or the store refused it): the end is
            # still the container's own.
            log.warning(
                "task %s: its log could not be kept: %s",
                task_id,
                exc,
                extra=_fields(task=task_id, worker=worker),
            )
        await self._settle(record, outcome(status))
        await self._clean_up(record, stop=False, keep_log=False)

    async def _running(self, record: TaskRecord, status: ContainerStatus) -> None:
        try:
            running = await self._write(record, Running(cards=status.cards))
        except TransitionError:
            return
        self._running_records[record.id] = running
        self.progress.pop(record.id, None)
        self.changed()

    async def _start(self, record: TaskRecord, adopted: bool) -> ContainerStatus | None:
        """Create the container (or find it again after a restart) and wait until it runs or
        has ended; None when the task failed to start (already recorded)."""
        assert record.worker is not None
        worker = record.worker
        if adopted:
            try:
                status = await self.on_worker(worker, lambda c: c.container(record.id))
            except ApiError as exc:
                if exc.code is not ErrorCode.NOT_FOUND:
                    raise
                if record.state is TaskState.RUNNING:
                    await self._settle(record, Lost(f"worker {worker} no longer has its container"))
                    return None
                status = None
            if status is not None:
                if status.state is ContainerState.RUNNING and record.state is TaskState.STARTING:
                    await self._running(record, status)
                if status.state is ContainerState.RUNNING or status.state.finished:
                    return status
        try:
            spec = await self._container_spec(record)
        except ApiError as exc:
            await self._settle(record, Failed(exc.message))
            return None
        created: ContainerStatus | ApiError | WorkerLost | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_progress, worker, record.id)
            try:
                created = await self.on_worker(worker, lambda c: self._create(c, spec))
            except (ApiError, WorkerLost) as exc:
                # Kept out of the nursery: the watcher tells these apart by their type.
                created = exc
            nursery.cancel_scope.cancel()
        if isinstance(created, WorkerLost):
            raise created
        if isinstance(created, ApiError):
            await self._settle(record, Failed(created.message))
            await self._clean_up(record, stop=False)
            return None
        assert created is not None
        status = created
        if status.state is ContainerState.RUNNING:
            await self._running(record, status)
        return status

    async def _create(self, client: WorkerClient, spec: ContainerSpec) -> ContainerStatus:
        assert spec.id is not None
        try:
            return await client.create_container(spec)
        except ApiError as exc:
            if exc.code is not ErrorCode.ALREADY_EXISTS:
                raise
        # A create that went through before the connection broke: wait for it to settle.
        while True:
            status = await client.container(spec.id)
            if not status.state.settling:
                return status
            await trio.sleep(PROGRESS_EVERY_S)

    async def _report_progress(self, worker: str, task_id: str) -> None:
        """While the container is made: the pull's progress, for `levers9 run` to show; asked
        every `PROGRESS_EVERY_S` while a pull moves, less and less often while nothing does
        (a cached image: the container is being made), up to `PROGRESS_IDLE_S`."""
        every = PROGRESS_EVERY_S
        while True:
            await trio.sleep(every)
            every = min(every * 2, PROGRESS_IDLE_S)
            with contextlib.suppress(ApiError, WorkerLost):
                status = await self.on_worker(worker, lambda c: c.container(task_id))
                previous = self.progress.get(task_id)
                self.progress[task_id] = status
                if previous is None or previous.pull != status.pull:
                    self.changed()
                    if status.state is ContainerState.PULLING:
                        every = PROGRESS_EVERY_S

    async def _container_spec(self, record: TaskRecord) -> ContainerSpec:
        spec = record.spec
        volumes = tuple(self.workspaces.with_credentials(record.workspace, v) for v in spec.volumes)
        if spec.snapshot is not None:
            assert record.worker is not None
            await self._bring_snapshot(spec.snapshot, record.worker)
        return container_spec(
            record,
            volumes,
            registry_auth=self.workspaces.registry_auth(record.workspace, spec.image),
            pull_policy=self.workspaces.pull_policy(spec.image),
        )

    async def _bring_snapshot(self, digest: str, worker: str) -> None:
        """Copy the snapshot layer to `worker` from a worker that holds it, unless it has it.
        A copy that breaks (either worker went away) tries the next holder. When no
        connected worker holds it, it is looked for again for up to `lost_after_s`: the node
        whose worker took it keeps it on its disk, and that node's next worker will have it.
        The task's own worker is asked through `on_worker` each time, so that a worker that
        went away loses the task (`WorkerLost`) rather than failing it."""
        deadline = trio.current_time() + self.lost_after_s
        while True:
            if await self.on_worker(worker, lambda c: c.has_object(digest)) is not None:
                return
            if await self._copy_snapshot(digest, worker):
                return
            if trio.current_time() >= deadline:
                raise ApiError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"no connected worker has held snapshot {digest} for "
                    f"{self.lost_after_s:g} s; it is kept on the node whose worker took it, "
                    "and no worker there answered",
                )
            await trio.sleep(RETRY_EVERY_S)

    async def _copy_snapshot(self, digest: str, worker: str) -> bool:
        """One look through the connected workers for the snapshot, whichever replica holds
        each (a client through its owner); True once copied."""
        for entry in self.registry.list():
            if entry.worker_id == worker or not entry.connected:
                continue
            try:
                with trio.fail_after(SNAPSHOT_SOURCE_WAIT_S):
                    source = await self.registry.client_for(entry.worker_id)
                    size = await source.has_object(digest)
                if size is None:
                    continue
                target = await self.registry.client_for(worker)
                async with contextlib.aclosing(source.get_object(digest)) as chunks:
                    await target.put_object(digest, chunks, size=size)
            except (ApiError, trio.TooSlowError) as exc:
                gone = (ErrorCode.UNAVAILABLE, ErrorCode.NOT_FOUND)
                if isinstance(exc, ApiError) and exc.code not in gone:
                    raise
                log.warning(
                    "snapshot %s: copying it from %s to %s broke (%s); trying another holder",
                    digest,
                    entry.worker_id,
                    worker,
                    exc,
                    extra={"digest": digest, "source_worker": entry.worker_id, "worker": worker},
                )
                continue
            log.info(
                "snapshot %s copied from %s to %s",
                digest,
                entry.worker_id,
                worker,
                extra={"digest": digest, "source_worker": entry.worker_id, "worker": worker},
            )
            return True
        return False

    async def _keep_log(self, record: TaskRecord) -> None:
        """Read the container's log from its worker and keep its tail in the task store.
        WorkerLost when the worker is gone first."""
        assert record.worker is not None
        task_id = record.id

        async def read_log(client: WorkerClient) -> list[bytes]:
            lines = []
            async with contextlib.aclosing(client.container_logs(task_id)) as source:
                async for line in source:
                    lines.append(dumps(line) + b"\n")
            return lines

        lines = await self.on_worker(record.worker, read_log)
        kept = keep_tail(lines, LOG_KEEP_BYTES)
        await self._stored(record, lambda: self.store.save_logs(task_id, kept))

    async def _clean_up(self, record: TaskRecord, *, stop: bool, keep_log: bool = True) -> None:
        """Stop the container if asked, keep its log (unless kept already), let the worker
        delete it. Bounded and shielded: it runs when the watcher is being cancelled too."""
        assert record.worker is not None
        worker = record.worker
        task_id = record.id
        with trio.CancelScope(shield=True) as shield, trio.move_on_after(CLEANUP_S):
            self._cleanups.add(shield)
            try:
                if stop:
                    await self.on_worker(worker, lambda c: c.stop_container(task_id))
                if keep_log:
                    await self._keep_log(record)
                await self.on_worker(worker, lambda c: c.delete_container(task_id))
            except (ApiError, WorkerLost) as exc:
                if getattr(exc, "code", None) is not ErrorCode.NOT_FOUND:
                    log.warning(
                        "task %s: cleaning up on worker %s failed: %s",
                        task_id,
                        worker,
                        exc,
                        extra={"task": task_id, "worker": worker, "container": task_id},
                    )
            finally:
                self._cleanups.discard(shield)
                self._cleanup_ended.unpark_all()
        if shield.cancelled_caught:
            log.info(
                "task %s: clean-up on worker %s cut short: stopping",
                task_id,
                worker,
                extra={"task": task_id, "worker": worker, "container": task_id},
            )
