"""The task store's embedded database: one SQLite file, the default for a single controlplane.

Why one connection driven through `trio.to_thread.run_sync` under a lock, and not a dedicated
thread: each call is one short transaction, so a thread per call costs little, and there is no
extra thread whose lifetime must be tied to a nursery. The lock keeps the connection to one
thread at a time (sqlite3 connections are not safe to share concurrently) and makes each
transaction atomic with respect to other trio tasks. The thread is not abandoned on
cancellation, so a cancelled caller never leaves a transaction half done. WAL lets readers of
the file (backups, a second process reading) proceed while we write. The file is made mode
0600: specs carry users' environments.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from control.db.base import Rows, TaskStoreError, Tx, migrations_due
from wire.errors import ErrorCode

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "SqliteDatabase", "open_sqlite"]

T = TypeVar("T")

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
    # 3: a row version for compare-and-set state changes.
    """
    ALTER TABLE tasks ADD COLUMN version INTEGER NOT NULL DEFAULT 1;
    """,
    # 4: the replicas and which of them owns each worker (control.workers.directory).
    """
    CREATE TABLE replicas (
        id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        expires_at REAL NOT NULL
    );
    CREATE TABLE workers (
        id TEXT PRIMARY KEY,
        token_hash TEXT,
        facts TEXT,
        owner TEXT,
        owner_expires REAL
    );
    CREATE INDEX workers_owner ON workers (owner);
    """,
    # 5: which replica a worker's newest tunnel landed on, and when.
    """
    ALTER TABLE workers ADD COLUMN tunnel_replica TEXT;
    ALTER TABLE workers ADD COLUMN tunnel_at REAL;
    """,
    # 6: the dashboard's sessions (control.ui.sessions): the hash of each id, never the id.
    """
    CREATE TABLE ui_sessions (
        id_hash TEXT PRIMARY KEY,
        principal TEXT NOT NULL,
        created_at REAL NOT NULL,
        last_seen_at REAL NOT NULL,
        expires_at REAL NOT NULL
    );
    CREATE INDEX ui_sessions_expires ON ui_sessions (expires_at);
    """,
)
"""Schema migrations; the file's version is how many of these it has had."""

SCHEMA_VERSION = len(MIGRATIONS)


class _Tx:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        cursor: Rows = self._conn.execute(sql, params)
        return cursor

    def notify(self, task_id: str, what: str) -> None:
        """One process holds the file: its own wake-ups are all there is."""


class SqliteDatabase:
    """One SQLite file, one connection, one transaction at a time."""

    def __init__(self, conn: sqlite3.Connection, path: str) -> None:
        self._conn = conn
        self.where = path
        self._lock = trio.StrictFIFOLock()
        self._closed = False

    async def run(self, fn: Callable[[Tx], T]) -> T:
        async with self._lock:
            if self._closed:
                raise TaskStoreError(ErrorCode.UNAVAILABLE, "the task store is closed")
            return await trio.to_thread.run_sync(self._transaction, fn)

    def _transaction(self, fn: Callable[[Tx], T]) -> T:
        # BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (the connection autocommits
        # otherwise, so the transaction boundaries are ours, not the sqlite3 module's guesses).
        return _guarded(self.where, lambda: _in_transaction(self._conn, fn))

    async def watch_changes(
        self,
        on_change: Callable[[str, str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """No other replica writes this file: nothing to hear."""
        task_status.started()
        await trio.sleep_forever()

    async def aclose(self) -> None:
        async with self._lock:
            if not self._closed:
                self._closed = True
                await trio.to_thread.run_sync(self._conn.close)


def _in_transaction(conn: sqlite3.Connection, fn: Callable[[Tx], T]) -> T:
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn(_Tx(conn))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


def _guarded(path: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except sqlite3.OperationalError as exc:
        # Locked or busy files, full disks, I/O errors: worth retrying later.
        raise TaskStoreError(
            ErrorCode.UNAVAILABLE, f"task database {path}: {exc}; retry shortly"
        ) from None
    except sqlite3.Error as exc:
        raise TaskStoreError(ErrorCode.INTERNAL, f"task database {path}: {exc}") from None


async def open_sqlite(path: str) -> SqliteDatabase:
    conn = await trio.to_thread.run_sync(_connect, path)
    return SqliteDatabase(conn, path)


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
        _guarded(path, lambda: _prepare(conn, path))
    except BaseException:
        conn.close()
        raise
    return conn


def _prepare(conn: sqlite3.Connection, path: str) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")

    def migrate(tx: Tx) -> None:
        tx.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = tx.execute("SELECT version FROM schema_version").fetchone()
        version = 0 if row is None else int(row[0])
        for number in migrations_due(version, SCHEMA_VERSION, path):
            for statement in MIGRATIONS[number - 1].split(";"):
                if statement.strip():
                    tx.execute(statement)
        if row is None:
            tx.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        else:
            tx.execute("UPDATE schema_version SET version=?", (SCHEMA_VERSION,))

    _in_transaction(conn, migrate)
