"""The task store on PostgreSQL: the records of several controlplane replicas in one database.

Why psycopg 3 with its connection pool, driven from worker threads: psycopg is the maintained
PostgreSQL driver and its pool bounds the connections a replica holds (`poolSize`); each store
call is one short transaction on a connection of the pool, in a thread taken through a limiter
of the pool's size, so calls wait for a connection in trio, not in a blocked thread. The thread
is not abandoned on cancellation, so a cancelled caller never leaves a transaction half done
(as the SQLite side, and as the Kubernetes adapter runs its blocking calls).

The password comes from `config.database.password` (the private values file) or
`passwordFile`, never from the URL (refused there), argv or a log: it is handed to libpq as a
connection parameter, and errors name the server by its URL, which has none.

Migrations are versioned like SQLite's and run at open under an advisory lock, so replicas
starting together migrate once; a database from a newer controlplane is refused.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import psycopg_pool
import trio

from control.config import DatabaseSettings
from control.db.base import CasConflict, Rows, TaskStoreError, Tx, migrations_due
from wire.errors import ApiError, ErrorCode

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "PostgresDatabase", "open_postgres"]

T = TypeVar("T")
log = logging.getLogger("levers9.tasks")

MIGRATIONS: tuple[str, ...] = (
    # 1: tasks in FIFO order of `seq`, their row version, and what ended tasks printed.
    """
    CREATE TABLE tasks (
        seq BIGSERIAL PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        workspace TEXT NOT NULL,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        started_at DOUBLE PRECISION,
        running_at DOUBLE PRECISION,
        finished_at DOUBLE PRECISION,
        worker TEXT,
        node TEXT,
        cards TEXT NOT NULL DEFAULT '[]',
        exit_code INTEGER,
        reason TEXT,
        version INTEGER NOT NULL DEFAULT 1
    );
    CREATE INDEX tasks_workspace_state ON tasks (workspace, state, seq);
    CREATE INDEX tasks_state ON tasks (state, seq);
    CREATE INDEX tasks_worker_state ON tasks (worker, state);
    CREATE TABLE task_logs (
        id TEXT PRIMARY KEY REFERENCES tasks (id),
        lines BYTEA NOT NULL
    );
    """,
    # 2: the replicas and which of them owns each worker (control.workers.directory).
    """
    CREATE TABLE replicas (
        id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE workers (
        id TEXT PRIMARY KEY,
        token_hash TEXT,
        facts TEXT,
        owner TEXT,
        owner_expires DOUBLE PRECISION
    );
    CREATE INDEX workers_owner ON workers (owner);
    """,
    # 3: which replica a worker's newest tunnel landed on, and when.
    """
    ALTER TABLE workers ADD COLUMN tunnel_replica TEXT;
    ALTER TABLE workers ADD COLUMN tunnel_at DOUBLE PRECISION;
    """,
    # 4: the dashboard's sessions (control.ui.sessions): the hash of each id, never the id.
    """
    CREATE TABLE ui_sessions (
        id_hash TEXT PRIMARY KEY,
        principal TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        last_seen_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX ui_sessions_expires ON ui_sessions (expires_at);
    """,
)
"""Schema migrations; the database's version is how many of these it has had."""

SCHEMA_VERSION = len(MIGRATIONS)
CHANGES_CHANNEL = "levers9_tasks"
"""What `Tx.notify` says and `watch_changes` listens to."""
LISTEN_POLL_S = 0.5
"""How long the listening thread blocks before it looks whether it should stop."""
MIGRATION_LOCK = 0x6C657665  # "leve": the advisory lock replicas migrate under
CONNECT_TIMEOUT_S = 10


def password_of(settings: DatabaseSettings) -> str | None:
    """The password from the settings or their file (its first line)."""
    if settings.password is not None:
        return settings.password
    if settings.password_file is None:
        return None
    try:
        text = Path(settings.password_file).read_text()
    except OSError as exc:
        raise TaskStoreError(
            ErrorCode.UNAVAILABLE,
            f"config.database.passwordFile {settings.password_file} cannot be read "
            f"({exc.strerror}); check the path and its mode",
            field="database.passwordFile",
        ) from None
    return text.splitlines()[0] if text.strip() else ""


class _Tx:
    def __init__(self, conn: psycopg.Connection[Any], origin: str) -> None:
        self._conn = conn
        self._origin = origin

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        cursor: Rows = self._conn.execute(sql.replace("?", "%s"), params)
        return cursor

    def notify(self, task_id: str, what: str) -> None:
        # Delivered at commit. The payload names this process first, whose own listener then
        # lets it pass; task ids and states have no spaces.
        payload = f"{self._origin} {task_id} {what}"
        self._conn.execute("SELECT pg_notify(%s, %s)", (CHANGES_CHANNEL, payload))


class PostgresDatabase:
    """A pool of connections to one database; each `run` one transaction on one of them."""

    def __init__(
        self,
        pool: psycopg_pool.ConnectionPool[Any],
        where: str,
        size: int,
        connect: Callable[[], psycopg.Connection[Any]],
    ) -> None:
        self._pool = pool
        self._connect = connect
        self.where = where
        self.origin = secrets.token_hex(8)
        """Names this process's notifications, so it does not wake for its own changes."""
        self._limiter = trio.CapacityLimiter(size)
        self._closed = False

    async def run(self, fn: Callable[[Tx], T]) -> T:
        if self._closed:
            raise TaskStoreError(ErrorCode.UNAVAILABLE, "the task store is closed")
        return await trio.to_thread.run_sync(self._transaction, fn, limiter=self._limiter)

    def _transaction(self, fn: Callable[[Tx], T]) -> T:
        try:
            with self._pool.connection() as conn, conn.transaction():
                return fn(_Tx(conn, self.origin))
        except (ApiError, CasConflict):
            raise
        except psycopg.errors.SerializationFailure:
            raise CasConflict() from None
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise TaskStoreError(
                ErrorCode.UNAVAILABLE,
                f"task database {self.where}: {_first_line(exc)}; retry shortly",
            ) from None
        except psycopg.Error as exc:
            raise TaskStoreError(
                ErrorCode.INTERNAL, f"task database {self.where}: {_first_line(exc)}"
            ) from None

    async def watch_changes(
        self,
        on_change: Callable[[str, str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """LISTEN on a connection of its own, outside the pool, read in a thread of its own;
        each notification calls `on_change` in trio. A lost connection is opened again after
        a second (what changed meanwhile is seen by the callers' own periodic looks)."""
        token = trio.lowlevel.current_trio_token()
        stop = threading.Event()
        first_try = trio.Event()

        def in_trio(fn: Callable[[], None]) -> None:
            try:
                trio.from_thread.run_sync(fn, trio_token=token)
            except trio.RunFinishedError:
                stop.set()

        def listen() -> None:
            while not stop.is_set():
                try:
                    with self._connect() as conn:
                        conn.execute(f"LISTEN {CHANGES_CHANNEL}")
                        in_trio(first_try.set)
                        while not stop.is_set():
                            for note in conn.notifies(timeout=LISTEN_POLL_S):
                                origin, _, rest = note.payload.partition(" ")
                                task_id, _, what = rest.partition(" ")
                                if origin != self.origin:
                                    in_trio(functools.partial(on_change, task_id, what))
                except psycopg.Error as exc:
                    in_trio(first_try.set)
                    log.warning(
                        "task database %s: listening for other replicas' changes failed: "
                        "%s; trying again",
                        self.where,
                        _first_line(exc),
                    )
                    stop.wait(1.0)

        async def in_thread() -> None:
            try:
                await trio.to_thread.run_sync(listen, abandon_on_cancel=True)
            finally:
                stop.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread)
            # Started once LISTEN is in place: a change made after that is heard.
            await first_try.wait()
            task_status.started()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await trio.to_thread.run_sync(self._pool.close)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


async def open_postgres(settings: DatabaseSettings) -> PostgresDatabase:
    """Connect (the first connection checked at once), migrate, and return the database."""
    assert settings.url is not None
    where = settings.url
    password = password_of(settings)
    kwargs: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S, "application_name": "levers9"}
    if password is not None:
        kwargs["password"] = password

    def connect() -> psycopg_pool.ConnectionPool[Any]:
        pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            settings.url or "",
            kwargs=kwargs,
            min_size=1,
            max_size=settings.pool_size,
            open=False,
            timeout=CONNECT_TIMEOUT_S,
            name="levers9-tasks",
        )
        try:
            pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
            _migrate(pool, where)
        except BaseException:
            pool.close()
            raise
        return pool

    def listener() -> psycopg.Connection[Any]:
        return psycopg.connect(settings.url or "", autocommit=True, **kwargs)

    started = time.monotonic()
    try:
        pool = await trio.to_thread.run_sync(connect)
    except psycopg_pool.PoolTimeout:
        # The pool hides why: ask once more for the server's own words.
        reason = await trio.to_thread.run_sync(_why_not, settings.url, kwargs)
        raise TaskStoreError(
            ErrorCode.UNAVAILABLE,
            f"task database {where} cannot be reached within "
            f"{round(time.monotonic() - started)} s: {reason}; check config.database.url "
            "and that the server runs",
            field="database.url",
        ) from None
    except psycopg.Error as exc:
        raise TaskStoreError(
            ErrorCode.UNAVAILABLE, f"task database {where}: {_first_line(exc)}"
        ) from None
    return PostgresDatabase(pool, where, settings.pool_size, listener)


def _why_not(url: str, kwargs: dict[str, Any]) -> str:
    try:
        psycopg.connect(url, **kwargs).close()
    except psycopg.Error as exc:
        text = _first_line(exc)
        if "password authentication failed" in text:
            return f"{text} (check config.database.password or passwordFile in the private values)"
        return text
    return "it answered only now"


def _migrate(pool: psycopg_pool.ConnectionPool[Any], where: str) -> None:
    with pool.connection() as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        version = 0 if row is None else int(row[0])
        for number in migrations_due(version, SCHEMA_VERSION, where):
            conn.execute(MIGRATIONS[number - 1])
        if row is None:
            conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (SCHEMA_VERSION,))
        else:
            conn.execute("UPDATE schema_version SET version=%s", (SCHEMA_VERSION,))
