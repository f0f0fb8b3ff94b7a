"""Task records: what `levers9 run` asked for, where it ran and how it ended, kept in a database.

Two halves. The task state machine is a table keyed by (state, event type); `transition` is a
pure function over it, so every allowed and refused move is unit-tested without a database.
`TaskStore` persists records so they survive a controlplane restart and scopes every call to a
workspace, over one of two databases behind the `Database` interface: one SQLite file (the
embedded default, `control.db.sqlite`) or PostgreSQL (`control.db.postgres`, for several
controlplane replicas), chosen by `config.database` (`control.db.open`). Both speak
the same SQL (written with `?` placeholders; the PostgreSQL side rewrites them), run each call
as one transaction in a worker thread, check their schema version at open (a newer one is
refused, older ones are migrated), and turn their errors into `ApiError`s.

Every state change is a compare-and-set on the row's `version`: the record is read, the
transition computed, and the row updated only where its version is still the one read. A
replica that lost the race reads again and finds the move already made (the transition is then
refused, or applied to the newer record), so two replicas can never both move one task, say
both start it.

Secrets never reach the database: volume credentials are stripped from the spec before it is
serialised; the controlplane attaches the workspace's credentials again when it starts the
task on a worker.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, ClassVar, TypeVar

import attrs
import trio

from control.db.base import CasConflict, Database, TaskStoreError, Tx
from control.db.open import DatabaseWhere, open_database
from control.models import TaskFields, TaskState
from wire.errors import ApiError, ErrorCode, dumps, structure
from workerapi.models import VolumeSpec
from workerapi.validation import check_mount_paths, check_process, check_resources, invalid

T = TypeVar("T")


ACTIVE_ON_WORKER = (TaskState.STARTING, TaskState.RUNNING)
"""A task placed on a worker that has not ended: its worker holds (or makes) its container."""


@attrs.frozen
class TaskSpec(TaskFields):
    """What a task runs, as stored: the request with its buckets resolved (`volumes`, without
    credentials once stored). The JSON of records written before the fields were shared with
    the request and the container spec is the same, key for key."""

    volumes: tuple[VolumeSpec, ...] = ()


def validate_spec(workspace: str, spec: TaskSpec) -> None:
    """Refuse a spec a worker could not run, naming the field and what to change: the one
    validation the worker applies too (`workerapi.validation`), and what only a task has."""
    check_process(spec)
    check_resources(cpu_millis=spec.cpu_millis, memory_bytes=spec.memory_bytes)
    if spec.timeout_s is not None and not (math.isfinite(spec.timeout_s) and spec.timeout_s > 0):
        raise invalid("timeoutS", f"is {spec.timeout_s}; give a positive number or omit it")
    for i, volume in enumerate(spec.volumes):
        if volume.workspace != workspace:
            raise invalid(
                f"volumes[{i}].workspace",
                f"is {volume.workspace!r}; a task may only mount buckets of its own workspace "
                f"{workspace!r}",
            )
    check_mount_paths([volume.mount_path for volume in spec.volumes])


def without_secrets(spec: TaskSpec) -> TaskSpec:
    """The spec as it may be stored: bucket credentials removed from every volume."""
    volumes = tuple(attrs.evolve(v, s3=None, gcs=None) for v in spec.volumes)
    return attrs.evolve(spec, volumes=volumes)


@attrs.frozen
class TaskRecord:
    """One task as stored. Timestamps are seconds since the epoch; `started_at` is when a
    worker was chosen, `running_at` when the container ran, `finished_at` when it ended."""

    id: str
    workspace: str
    spec: TaskSpec
    state: TaskState
    created_at: float
    started_at: float | None = None
    running_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    node: str | None = None
    cards: tuple[str, ...] = ()
    exit_code: int | None = None
    reason: str | None = None


# -- events and the transition table ---------------------------------------------------------


@attrs.frozen
class Start:
    """The scheduler placed the task on `worker` (on `node`) with these card UUIDs."""

    kind: ClassVar[str] = "start"
    worker: str
    node: str | None = None
    cards: tuple[str, ...] = ()


@attrs.frozen
class Running:
    """The container runs, on these card UUIDs (known once the worker assigned them)."""

    kind: ClassVar[str] = "running"
    cards: tuple[str, ...] = ()


@attrs.frozen
class Exited:
    """The container ended with `code`: 0 is success, anything else a failure."""

    kind: ClassVar[str] = "exited"
    code: int


@attrs.frozen
class Failed:
    """The task could not be run or went wrong outside its own command (pull, mount, ...)."""

    kind: ClassVar[str] = "failed"
    reason: str


@attrs.frozen
class Cancel:
    kind: ClassVar[str] = "cancel"
    reason: str = "cancelled by the user"


@attrs.frozen
class Lost:
    """The worker running the task vanished; what happened to the task is unknown."""

    kind: ClassVar[str] = "lost"
    reason: str


TaskEvent = Start | Running | Exited | Failed | Cancel | Lost


def _start(record: TaskRecord, event: Any, now: float) -> TaskRecord:
    assert isinstance(event, Start)
    if event.cards and len(event.cards) != record.spec.cards:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"task {record.id} asks for {record.spec.cards} card(s) but start gave "
            f"{len(event.cards)}; assign exactly that many",
            field="cards",
        )
    return attrs.evolve(
        record,
        state=TaskState.STARTING,
        started_at=now,
        worker=event.worker,
        node=event.node,
        cards=event.cards,
    )


def _running(record: TaskRecord, event: Any, now: float) -> TaskRecord:
    assert isinstance(event, Running)
    return attrs.evolve(
        record, state=TaskState.RUNNING, running_at=now, cards=event.cards or record.cards
    )


def _exited(record: TaskRecord, event: Any, now: float) -> TaskRecord:
    assert isinstance(event, Exited)
    if event.code == 0:
        return attrs.evolve(record, state=TaskState.SUCCEEDED, finished_at=now, exit_code=0)
    return attrs.evolve(
        record,
        state=TaskState.FAILED,
        finished_at=now,
        exit_code=event.code,
        reason=f"exited with code {event.code}",
    )


def _ends_in(state: TaskState) -> Callable[[TaskRecord, Any, float], TaskRecord]:
    def end(record: TaskRecord, event: Any, now: float) -> TaskRecord:
        assert isinstance(event, Failed | Cancel | Lost)
        return attrs.evolve(record, state=state, finished_at=now, reason=event.reason)

    return end


_P, _S, _R = TaskState.PENDING, TaskState.STARTING, TaskState.RUNNING

TRANSITIONS: Mapping[tuple[TaskState, type[Any]], Callable[[TaskRecord, Any, float], TaskRecord]]
TRANSITIONS = {
    (_P, Start): _start,
    (_P, Failed): _ends_in(TaskState.FAILED),
    (_P, Cancel): _ends_in(TaskState.CANCELLED),
    (_S, Running): _running,
    # A short command can end before the worker reports it running.
    (_S, Exited): _exited,
    (_S, Failed): _ends_in(TaskState.FAILED),
    (_S, Cancel): _ends_in(TaskState.CANCELLED),
    (_S, Lost): _ends_in(TaskState.LOST),
    (_R, Exited): _exited,
    (_R, Failed): _ends_in(TaskState.FAILED),
    (_R, Cancel): _ends_in(TaskState.CANCELLED),
    (_R, Lost): _ends_in(TaskState.LOST),
}
"""Every allowed move; the handler computes the next record. Terminal states accept nothing."""


class TransitionError(ApiError):
    """An event the task's current state does not accept."""

    def __init__(self, record: TaskRecord, event: TaskEvent) -> None:
        allowed = sorted(kind.kind for (state, kind) in TRANSITIONS if state is record.state)
        hint = f"it accepts: {', '.join(allowed)}" if allowed else "it has ended"
        super().__init__(
            ErrorCode.FAILED_PRECONDITION,
            f"task {record.id} is {record.state.value} and cannot take event "
            f"{event.kind!r} ({hint})",
        )
        self.task_id = record.id
        self.state = record.state
        self.event = event.kind


def transition(record: TaskRecord, event: TaskEvent, now: float) -> TaskRecord:
    """The record after `event` at time `now`; raises `TransitionError` for a refused move."""
    handler = TRANSITIONS.get((record.state, type(event)))
    if handler is None:
        raise TransitionError(record, event)
    return handler(record, event, now)


# -- the store --------------------------------------------------------------------------------

COLUMNS = (
    "id, workspace, state, spec, created_at, started_at, running_at, finished_at, worker, "
    "node, cards, exit_code, reason, version"
)
CAS_ATTEMPTS = 8
"""How often a state change is tried again after another writer moved the row first."""


def _new_id() -> str:
    return f"t-{secrets.token_hex(6)}"


def _finite_or_none(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _stored_spec(text: str) -> TaskSpec:
    """A stored spec. One written before the API refused non-finite numbers may hold
    `Infinity` (a `timeoutS` that never ends): read as absent, which means the same, so the
    record still lists and is answered as valid JSON."""
    data = json.loads(text, parse_constant=lambda _: None, parse_float=_finite_or_none)
    return structure(data, TaskSpec)


def _row_to_record(row: Sequence[Any]) -> tuple[TaskRecord, int]:
    (id_, workspace, state, spec, created_at, started_at, running_at, finished_at, worker,
     node, cards, exit_code, reason, version) = row  # fmt: skip
    record = TaskRecord(
        id=id_,
        workspace=workspace,
        spec=_stored_spec(spec),
        state=TaskState(state),
        created_at=created_at,
        started_at=started_at,
        running_at=running_at,
        finished_at=finished_at,
        worker=worker,
        node=node,
        cards=tuple(json.loads(cards)),
        exit_code=exit_code,
        reason=reason,
    )
    return record, int(version)


def _records(rows: Iterable[Sequence[Any]]) -> tuple[TaskRecord, ...]:
    return tuple(_row_to_record(r)[0] for r in rows)


def _not_found(task_id: str) -> ApiError:
    # The same words whether the id is unknown or belongs to another workspace.
    return ApiError(
        ErrorCode.NOT_FOUND,
        f"task {task_id!r} not found in this workspace; list tasks to see their ids",
        field="id",
    )


def _update(tx: Tx, record: TaskRecord, version: int) -> None:
    """Write `record` where its row is still at `version` (else `CasConflict`)."""
    changed = tx.execute(
        "UPDATE tasks SET state=?, started_at=?, running_at=?, finished_at=?, worker=?, "
        "node=?, cards=?, exit_code=?, reason=?, version=version+1 WHERE id=? AND version=?",
        (
            record.state.value,
            record.started_at,
            record.running_at,
            record.finished_at,
            record.worker,
            record.node,
            json.dumps(list(record.cards)),
            record.exit_code,
            record.reason,
            record.id,
            version,
        ),
    )
    if changed.rowcount != 1:
        raise CasConflict(record.id)
    if record.state is not TaskState.RUNNING:
        # Placed (a follow elsewhere starts) or ended (a watcher elsewhere stops, a wait
        # returns); that it runs changes nothing another replica waits on.
        tx.notify(record.id, record.state.value)


def _select_one(tx: Tx, workspace: str, task_id: str) -> tuple[TaskRecord, int] | None:
    row = tx.execute(
        f"SELECT {COLUMNS} FROM tasks WHERE id=? AND workspace=?", (task_id, workspace)
    ).fetchone()
    return None if row is None else _row_to_record(row)


def _active_on(tx: Tx, worker: str) -> list[tuple[TaskRecord, int]]:
    rows = tx.execute(
        f"SELECT {COLUMNS} FROM tasks WHERE worker=? AND state IN (?, ?) ORDER BY seq",
        (worker, *(s.value for s in ACTIVE_ON_WORKER)),
    )
    return [_row_to_record(r) for r in rows]


_NOT_ENDED = tuple(s.value for s in TaskState if not s.terminal)


def _count_active(tx: Tx, workspace: str) -> int:
    """The workspace's tasks pending, starting or running (the (workspace, state) index)."""
    row = tx.execute(
        f"SELECT COUNT(*) FROM tasks WHERE workspace=? AND state IN "
        f"({','.join('?' * len(_NOT_ENDED))})",
        (workspace, *_NOT_ENDED),
    ).fetchone()
    return int(row[0]) if row is not None else 0


class TaskStore:
    """Task records in a `Database`. Open with `open_task_store`."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._clock = clock
        self._closed = False

    @property
    def where(self) -> str:
        return self._db.where

    @property
    def database(self) -> Database:
        """The database under the records (the replicas keep theirs in it too)."""
        return self._db

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._db.aclose()

    async def watch_changes(
        self,
        on_change: Callable[[str, str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """`on_change(task_id, what)` whenever another replica created a task, moved one (what:
        its new state) or kept its log (`logs`); this replica's own changes are not echoed
        back. Until cancelled."""
        await self._db.watch_changes(on_change, task_status=task_status)

    async def _run(self, fn: Callable[[Tx], T]) -> T:
        if self._closed:
            raise TaskStoreError(ErrorCode.UNAVAILABLE, "the task store is closed")
        return await self._db.run(fn)

    async def _change(self, fn: Callable[[Tx], T]) -> T:
        """A read-transition-write, tried again while other writers win the race."""
        for _ in range(CAS_ATTEMPTS):
            try:
                return await self._run(fn)
            except CasConflict:
                continue
        raise TaskStoreError(
            ErrorCode.UNAVAILABLE,
            f"task database {self.where}: the record kept changing under us; retry shortly",
        )

    async def create(
        self,
        workspace: str,
        spec: TaskSpec,
        admit: Callable[[int], ApiError | None] | None = None,
    ) -> TaskRecord:
        """Validate and store a new pending task; its id is fresh and its place in FIFO last.

        `admit`: told how many of the workspace's tasks are pending or running, in the
        insert's own transaction, it returns why this one may not be added (raised), or None.
        SQLite runs one writer at a time, so the count is exact there; PostgreSQL at READ
        COMMITTED lets creates that run at the same moment each miss the others' rows, so the
        limit may be passed by the number of creates in flight at once (bounded by the
        request rate), never more."""
        validate_spec(workspace, spec)
        stored = without_secrets(spec)
        spec_json = dumps(stored).decode()
        now = self._clock()

        def insert(tx: Tx) -> TaskRecord | None:
            if admit is not None:
                refused = admit(_count_active(tx, workspace))
                if refused is not None:
                    raise refused
            record = TaskRecord(
                id=_new_id(),
                workspace=workspace,
                spec=stored,
                state=TaskState.PENDING,
                created_at=now,
            )
            # An id collision (48 random bits) inserts nothing: draw again.
            inserted = tx.execute(
                "INSERT INTO tasks (id, workspace, state, spec, created_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (record.id, workspace, record.state.value, spec_json, now),
            )
            if inserted.rowcount != 1:
                return None
            tx.notify(record.id, record.state.value)
            return record

        while True:
            created = await self._run(insert)
            if created is not None:
                return created

    async def get(self, workspace: str, task_id: str) -> TaskRecord:
        def select(tx: Tx) -> TaskRecord:
            found = _select_one(tx, workspace, task_id)
            if found is None:
                raise _not_found(task_id)
            return found[0]

        return await self._run(select)

    async def list(
        self,
        workspace: str,
        states: Iterable[TaskState] | None = None,
        limit: int = 100,
        before: str | None = None,
    ) -> tuple[TaskRecord, ...]:
        """The workspace's tasks, newest first, at most `limit`; with `before` (a task id, the
        last of the previous page) those created before it, so pages never overlap or skip
        one however many tasks arrive meanwhile."""
        if limit < 1:
            raise invalid("limit", f"is {limit}; give 1 or more")
        wanted = None if states is None else [s.value for s in states]

        def select(tx: Tx) -> tuple[TaskRecord, ...]:
            sql = f"SELECT {COLUMNS} FROM tasks WHERE workspace=?"
            params: list[Any] = [workspace]
            if before is not None:
                row = tx.execute(
                    "SELECT seq FROM tasks WHERE workspace=? AND id=?", (workspace, before)
                ).fetchone()
                if row is None:
                    raise TaskStoreError(
                        ErrorCode.INVALID_ARGUMENT,
                        f"query 'before': no task {before!r} in workspace {workspace}; "
                        "use the last id of the page before",
                        field="before",
                    )
                sql += " AND seq < ?"
                params.append(row[0])
            if wanted is not None:
                sql += f" AND state IN ({','.join('?' * len(wanted))})"
                params += wanted
            sql += " ORDER BY seq DESC LIMIT ?"
            params.append(limit)
            return _records(tx.execute(sql, params))

        return await self._run(select)

    async def count_by_state(self) -> dict[tuple[str, TaskState], int]:
        """How many tasks each workspace has in each state (what `/metrics` reports)."""

        def count(tx: Tx) -> dict[tuple[str, TaskState], int]:
            rows = tx.execute("SELECT workspace, state, COUNT(*) FROM tasks GROUP BY 1, 2", ())
            return {(str(w), TaskState(st)): int(n) for w, st, n in rows}

        return await self._run(count)

    async def apply(self, workspace: str, task_id: str, event: TaskEvent) -> TaskRecord:
        """Move the task by `event` and persist it, compare-and-set on its row version."""
        now = self._clock()

        def move(tx: Tx) -> TaskRecord:
            found = _select_one(tx, workspace, task_id)
            if found is None:
                raise _not_found(task_id)
            record, version = found
            after = transition(record, event, now)
            _update(tx, after, version)
            return after

        return await self._change(move)

    async def pending(self, workspace: str | None = None) -> tuple[TaskRecord, ...]:
        """Pending tasks oldest first (the scheduler's queue), of one workspace or all."""

        def select(tx: Tx) -> tuple[TaskRecord, ...]:
            sql = f"SELECT {COLUMNS} FROM tasks WHERE state=?"
            params: list[Any] = [TaskState.PENDING.value]
            if workspace is not None:
                sql += " AND workspace=?"
                params.append(workspace)
            sql += " ORDER BY seq"
            return _records(tx.execute(sql, params))

        return await self._run(select)

    async def running_on(self, worker: str) -> tuple[TaskRecord, ...]:
        """Tasks placed on `worker` that have not ended (starting or running), oldest first."""

        def select(tx: Tx) -> tuple[TaskRecord, ...]:
            return tuple(record for record, _ in _active_on(tx, worker))

        return await self._run(select)

    async def states(self, task_ids: Sequence[str]) -> dict[str, TaskState]:
        """The states of these tasks (those that exist), in any workspace."""
        ids = list(task_ids)
        if not ids:
            return {}

        def select(tx: Tx) -> dict[str, TaskState]:
            marks = ",".join("?" for _ in ids)
            rows = tx.execute(f"SELECT id, state FROM tasks WHERE id IN ({marks})", ids)
            return {str(r[0]): TaskState(r[1]) for r in rows}

        return await self._run(select)

    async def active(self) -> tuple[TaskRecord, ...]:
        """Every task placed on a worker that has not ended (starting or running), oldest
        first: what a restarted controlplane watches again."""

        def select(tx: Tx) -> tuple[TaskRecord, ...]:
            rows = tx.execute(
                f"SELECT {COLUMNS} FROM tasks WHERE state IN (?, ?) ORDER BY seq",
                tuple(s.value for s in ACTIVE_ON_WORKER),
            )
            return _records(rows)

        return await self._run(select)

    async def save_logs(self, task_id: str, lines: bytes) -> None:
        """Keep an ended task's log (NDJSON lines) for `levers9 task logs` after its worker has
        let the container go."""

        def save(tx: Tx) -> None:
            tx.execute(
                "INSERT INTO task_logs (id, lines) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET lines = excluded.lines",
                (task_id, lines),
            )
            tx.notify(task_id, "logs")  # a follow elsewhere waits for the kept log

        await self._run(save)

    async def logs(self, workspace: str, task_id: str) -> bytes | None:
        """The kept log of an ended task, None when none was kept."""

        def select(tx: Tx) -> bytes | None:
            if _select_one(tx, workspace, task_id) is None:
                raise _not_found(task_id)
            row = tx.execute("SELECT lines FROM task_logs WHERE id=?", (task_id,)).fetchone()
            return None if row is None else bytes(row[0])

        return await self._run(select)

    async def mark_worker_lost(self, worker: str, reason: str) -> tuple[TaskRecord, ...]:
        """Mark every starting or running task of `worker` lost; returns those records."""
        now = self._clock()

        def mark(tx: Tx) -> tuple[TaskRecord, ...]:
            lost = []
            for record, version in _active_on(tx, worker):
                after = transition(record, Lost(reason), now)
                _update(tx, after, version)
                lost.append(after)
            return tuple(lost)

        return await self._change(mark)


@asynccontextmanager
async def open_task_store(
    where: DatabaseWhere, *, clock: Callable[[], float] = time.time
) -> AsyncIterator[TaskStore]:
    """The task store in `where`: the database settings (PostgreSQL when they give a URL, else
    the SQLite file at their path), or a SQLite file's path."""
    db = await open_database(where)
    store = TaskStore(db, clock)
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
