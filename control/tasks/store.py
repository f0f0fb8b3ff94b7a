"""Task records: what `levers9 run` asked for, where it ran and how it ended, kept in SQLite.

Two halves. The task state machine is a table keyed by (state, event type); `transition` is a
pure function over it, so every allowed and refused move is unit-tested without a database.
`TaskStore` is the one adapter to `sqlite3`: it persists records so they survive a
controlplane restart, scopes every call to a workspace, and turns sqlite errors into
`ApiError`s.

Why one connection driven through `trio.to_thread.run_sync` under a lock, and not a dedicated
thread: each call is one short transaction, so a thread per call costs little, and there is no
extra thread whose lifetime must be tied to a nursery. The lock keeps the connection to one
thread at a time (sqlite3 connections are not safe to share concurrently) and makes each
read-transition-write atomic with respect to other trio tasks. The thread is not abandoned on
cancellation, so a cancelled caller never leaves a transaction half done. WAL lets readers of
the file (backups, a second controlplane reading) proceed while we write.

Secrets never reach the file: volume credentials are stripped from the spec before it is
serialised; the controlplane attaches the workspace's credentials again when it starts the
task on a worker.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, ClassVar, TypeVar

import attrs
import trio

from agent.api.models import VolumeSpec
from agent.wire.errors import ApiError, ErrorCode, dumps, loads
from control.models import TaskState

T = TypeVar("T")


ACTIVE_ON_WORKER = (TaskState.STARTING, TaskState.RUNNING)
"""A task placed on a worker that has not ended: its worker holds (or makes) its container."""


@attrs.frozen
class TaskSpec:
    """What a task runs. `command` replaces the image's entrypoint and `args` its cmd."""

    image: str
    command: tuple[str, ...] | None = None
    args: tuple[str, ...] | None = None
    env: dict[str, str] = attrs.field(factory=dict)
    cards: int = 0
    cpu_millis: int | None = None
    memory_bytes: int | None = None
    volumes: tuple[VolumeSpec, ...] = ()
    ports: tuple[int, ...] = ()
    timeout_s: float | None = None
    snapshot: str | None = None


def _invalid(field: str, message: str) -> ApiError:
    return ApiError(ErrorCode.INVALID_ARGUMENT, f"field {field!r}: {message}", field=field)


def validate_spec(workspace: str, spec: TaskSpec) -> None:
    """Refuse a spec a worker could not run, naming the field and what to change."""
    if not spec.image.strip():
        raise _invalid("image", "is empty; give an image reference such as 'busybox:latest'")
    for name in spec.env:
        if not name or "=" in name or "\0" in name:
            raise _invalid("env", f"variable name {name!r} must be non-empty without '=' or NUL")
    if spec.cards < 0:
        raise _invalid("cards", f"is {spec.cards}; give 0 or more cards")
    if spec.cpu_millis is not None and spec.cpu_millis <= 0:
        raise _invalid("cpuMillis", f"is {spec.cpu_millis}; give a positive number or omit it")
    if spec.memory_bytes is not None and spec.memory_bytes <= 0:
        raise _invalid("memoryBytes", f"is {spec.memory_bytes}; give a positive number or omit it")
    if spec.timeout_s is not None and not spec.timeout_s > 0:
        raise _invalid("timeoutS", f"is {spec.timeout_s}; give a positive number or omit it")
    for port in spec.ports:
        if not 1 <= port <= 65535:
            raise _invalid("ports", f"port {port} is outside 1..65535")
    if len(set(spec.ports)) != len(spec.ports):
        raise _invalid("ports", "lists a port more than once")
    mounts: set[str] = set()
    for i, volume in enumerate(spec.volumes):
        if volume.workspace != workspace:
            raise _invalid(
                f"volumes[{i}].workspace",
                f"is {volume.workspace!r}; a task may only mount buckets of its own workspace "
                f"{workspace!r}",
            )
        if not volume.mount_path.startswith("/"):
            raise _invalid(f"volumes[{i}].mountPath", "must be an absolute path")
        if volume.mount_path in mounts:
            raise _invalid(f"volumes[{i}].mountPath", f"{volume.mount_path!r} is used twice")
        mounts.add(volume.mount_path)


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

MIGRATIONS: tuple[str, ...] = (
    # 1: tasks, ordered by `seq` (AUTOINCREMENT never reuses a number, so FIFO holds even
    # after deletes).
    """
    CREATE TABLE tasks (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        workspace TEXT NOT NULL,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        created_at REAL NOT NULL,
        started_at REAL,
        running_at REAL,
        finished_at REAL,
        worker TEXT,
        node TEXT,
        cards TEXT NOT NULL DEFAULT '[]',
        exit_code INTEGER,
        reason TEXT
    );
    CREATE INDEX tasks_workspace_state ON tasks (workspace, state, seq);
    CREATE INDEX tasks_state ON tasks (state, seq);
    CREATE INDEX tasks_worker_state ON tasks (worker, state);
    """,
    # 2: what an ended task printed (its container is gone from the worker by then).
    """
    CREATE TABLE task_logs (
        id TEXT PRIMARY KEY REFERENCES tasks (id),
        lines BLOB NOT NULL
    );
    """,
)
"""Schema migrations; the file's version is how many of these it has had."""

SCHEMA_VERSION = len(MIGRATIONS)

_COLUMNS = (
    "id, workspace, state, spec, created_at, started_at, running_at, finished_at, worker, "
    "node, cards, exit_code, reason"
)


class TaskStoreError(ApiError):
    """The task database could not be used (locked, unreadable, from a newer controlplane)."""


def _new_id() -> str:
    return f"t-{secrets.token_hex(6)}"


def _row_to_record(row: Sequence[Any]) -> TaskRecord:
    (id_, workspace, state, spec, created_at, started_at, running_at, finished_at, worker,
     node, cards, exit_code, reason) = row  # fmt: skip
    return TaskRecord(
        id=id_,
        workspace=workspace,
        spec=loads(spec.encode(), TaskSpec),
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


def _update(conn: sqlite3.Connection, record: TaskRecord) -> None:
    conn.execute(
        "UPDATE tasks SET state=?, started_at=?, running_at=?, finished_at=?, worker=?, "
        "node=?, cards=?, exit_code=?, reason=? WHERE id=?",
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
        ),
    )


def _not_found(task_id: str) -> ApiError:
    # The same words whether the id is unknown or belongs to another workspace.
    return ApiError(
        ErrorCode.NOT_FOUND,
        f"task {task_id!r} not found in this workspace; list tasks to see their ids",
        field="id",
    )


class TaskStore:
    """Task records in one SQLite file. Open with `open_task_store` (or `TaskStore.open`)."""

    def __init__(
        self, conn: sqlite3.Connection, path: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._conn = conn
        self._path = path
        self._clock = clock
        self._lock = trio.StrictFIFOLock()
        self._closed = False

    @classmethod
    async def open(
        cls, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time
    ) -> TaskStore:
        path = os.fspath(path)
        conn = await trio.to_thread.run_sync(_connect, path)
        return cls(conn, path, clock)

    async def aclose(self) -> None:
        async with self._lock:
            if not self._closed:
                self._closed = True
                await trio.to_thread.run_sync(self._conn.close)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        async with self._lock:
            if self._closed:
                raise TaskStoreError(ErrorCode.UNAVAILABLE, "the task store is closed")
            return await trio.to_thread.run_sync(_guarded, self._path, fn, self._conn)

    async def create(self, workspace: str, spec: TaskSpec) -> TaskRecord:
        """Validate and store a new pending task; its id is fresh and its place in FIFO last."""
        validate_spec(workspace, spec)
        stored = without_secrets(spec)
        spec_json = dumps(stored).decode()
        now = self._clock()

        def insert(conn: sqlite3.Connection) -> TaskRecord:
            while True:
                record = TaskRecord(
                    id=_new_id(),
                    workspace=workspace,
                    spec=stored,
                    state=TaskState.PENDING,
                    created_at=now,
                )
                try:
                    with _transaction(conn):
                        conn.execute(
                            "INSERT INTO tasks (id, workspace, state, spec, created_at) "
                            "VALUES (?, ?, ?, ?, ?)",
                            (record.id, workspace, record.state.value, spec_json, now),
                        )
                except sqlite3.IntegrityError:
                    continue  # an id collision (48 random bits): draw again
                return record

        return await self._run(insert)

    async def get(self, workspace: str, task_id: str) -> TaskRecord:
        def select(conn: sqlite3.Connection) -> TaskRecord:
            record = _select_one(conn, workspace, task_id)
            if record is None:
                raise _not_found(task_id)
            return record

        return await self._run(select)

    async def list(
        self, workspace: str, states: Iterable[TaskState] | None = None, limit: int = 100
    ) -> tuple[TaskRecord, ...]:
        """The workspace's tasks, newest first, at most `limit`."""
        if limit < 1:
            raise _invalid("limit", f"is {limit}; give 1 or more")
        wanted = None if states is None else [s.value for s in states]

        def select(conn: sqlite3.Connection) -> tuple[TaskRecord, ...]:
            sql = f"SELECT {_COLUMNS} FROM tasks WHERE workspace=?"
            params: list[Any] = [workspace]
            if wanted is not None:
                sql += f" AND state IN ({','.join('?' * len(wanted))})"
                params += wanted
            sql += " ORDER BY seq DESC LIMIT ?"
            params.append(limit)
            return tuple(_row_to_record(r) for r in conn.execute(sql, params))

        return await self._run(select)

    async def apply(self, workspace: str, task_id: str, event: TaskEvent) -> TaskRecord:
        """Move the task by `event` and persist it, in one transaction."""
        now = self._clock()

        def move(conn: sqlite3.Connection) -> TaskRecord:
            with _transaction(conn):
                record = _select_one(conn, workspace, task_id)
                if record is None:
                    raise _not_found(task_id)
                after = transition(record, event, now)
                _update(conn, after)
                return after

        return await self._run(move)

    async def pending(self, workspace: str | None = None) -> tuple[TaskRecord, ...]:
        """Pending tasks oldest first (the scheduler's queue), of one workspace or all."""

        def select(conn: sqlite3.Connection) -> tuple[TaskRecord, ...]:
            sql = f"SELECT {_COLUMNS} FROM tasks WHERE state=?"
            params: list[Any] = [TaskState.PENDING.value]
            if workspace is not None:
                sql += " AND workspace=?"
                params.append(workspace)
            sql += " ORDER BY seq"
            return tuple(_row_to_record(r) for r in conn.execute(sql, params))

        return await self._run(select)

    async def running_on(self, worker: str) -> tuple[TaskRecord, ...]:
        """Tasks placed on `worker` that have not ended (starting or running), oldest first."""

        def select(conn: sqlite3.Connection) -> tuple[TaskRecord, ...]:
            return _active_on(conn, worker)

        return await self._run(select)

    async def active(self) -> tuple[TaskRecord, ...]:
        """Every task placed on a worker that has not ended (starting or running), oldest
        first: what a restarted controlplane watches again."""

        def select(conn: sqlite3.Connection) -> tuple[TaskRecord, ...]:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM tasks WHERE state IN (?, ?) ORDER BY seq",
                tuple(s.value for s in ACTIVE_ON_WORKER),
            )
            return tuple(_row_to_record(r) for r in rows)

        return await self._run(select)

    async def save_logs(self, task_id: str, lines: bytes) -> None:
        """Keep an ended task's log (NDJSON lines) for `levers9 task logs` after its worker has
        let the container go."""

        def save(conn: sqlite3.Connection) -> None:
            with _transaction(conn):
                conn.execute(
                    "INSERT OR REPLACE INTO task_logs (id, lines) VALUES (?, ?)", (task_id, lines)
                )

        await self._run(save)

    async def logs(self, workspace: str, task_id: str) -> bytes | None:
        """The kept log of an ended task, None when none was kept."""

        def select(conn: sqlite3.Connection) -> bytes | None:
            if _select_one(conn, workspace, task_id) is None:
                raise _not_found(task_id)
            row = conn.execute("SELECT lines FROM task_logs WHERE id=?", (task_id,)).fetchone()
            return None if row is None else bytes(row[0])

        return await self._run(select)

    async def mark_worker_lost(self, worker: str, reason: str) -> tuple[TaskRecord, ...]:
        """Mark every starting or running task of `worker` lost; returns those records."""
        now = self._clock()

        def mark(conn: sqlite3.Connection) -> tuple[TaskRecord, ...]:
            with _transaction(conn):
                lost = tuple(transition(r, Lost(reason), now) for r in _active_on(conn, worker))
                for record in lost:
                    _update(conn, record)
                return lost

        return await self._run(mark)


@asynccontextmanager
async def open_task_store(
    path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time
) -> AsyncIterator[TaskStore]:
    store = await TaskStore.open(path, clock=clock)
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


# -- sqlite, run in a worker thread -----------------------------------------------------------


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (the connection autocommits
    otherwise, so the transaction boundaries are ours, not the sqlite3 module's guesses)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _guarded(path: str, fn: Callable[[sqlite3.Connection], T], conn: sqlite3.Connection) -> T:
    try:
        return fn(conn)
    except sqlite3.OperationalError as exc:
        # Locked or busy files, full disks, I/O errors: worth retrying later.
        raise TaskStoreError(
            ErrorCode.UNAVAILABLE, f"task database {path}: {exc}; retry shortly"
        ) from None
    except sqlite3.Error as exc:
        raise TaskStoreError(ErrorCode.INTERNAL, f"task database {path}: {exc}") from None


def _connect(path: str) -> sqlite3.Connection:
    if path != ":memory:" and not os.path.exists(path):
        # Specs carry users' environments: the file is for the controlplane's eyes only.
        try:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError as exc:
            raise TaskStoreError(
                ErrorCode.UNAVAILABLE,
                f"task database {path} cannot be created ({exc.strerror}); check the "
                "configured path and that its directory exists and is writable",
            ) from None
    try:
        conn = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise TaskStoreError(
            ErrorCode.UNAVAILABLE, f"task database {path} cannot be opened: {exc}"
        ) from None
    try:
        _guarded(path, lambda c: _prepare(c, path), conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _prepare(conn: sqlite3.Connection, path: str) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    with _transaction(conn):
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        version = 0 if row is None else int(row[0])
        if version > SCHEMA_VERSION:
            raise TaskStoreError(
                ErrorCode.FAILED_PRECONDITION,
                f"task database {path} has schema version {version}, newer than "
                f"this controlplane knows ({SCHEMA_VERSION}); run a controlplane at least as "
                "new as the one that wrote it",
            )
        for number in range(version + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[number - 1].split(";"):
                if statement.strip():
                    conn.execute(statement)
        if row is None:
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        else:
            conn.execute("UPDATE schema_version SET version=?", (SCHEMA_VERSION,))


def _select_one(conn: sqlite3.Connection, workspace: str, task_id: str) -> TaskRecord | None:
    row = conn.execute(
        f"SELECT {_COLUMNS} FROM tasks WHERE id=? AND workspace=?", (task_id, workspace)
    ).fetchone()
    return None if row is None else _row_to_record(row)


def _active_on(conn: sqlite3.Connection, worker: str) -> tuple[TaskRecord, ...]:
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM tasks WHERE worker=? AND state IN (?, ?) ORDER BY seq",
        (worker, *(s.value for s in ACTIVE_ON_WORKER)),
    )
    return tuple(_row_to_record(r) for r in rows)
