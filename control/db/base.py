"""The interface the controlplane's databases offer: one transaction at a time in a worker
thread, and word of other replicas' changes.

Why a module of its own: the task records (`control.tasks`) and the replicas' directory
(`control.workers`) keep their tables in the same database, and neither should import the
other to name it. `control.db.sqlite` and `control.db.postgres` implement it; their errors are
translated into `TaskStoreError` here, where every owner of a table can name them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import trio

from wire.errors import ApiError, ErrorCode

__all__ = ["CasConflict", "Database", "Rows", "TaskStoreError", "Tx", "migrations_due"]

T = TypeVar("T")


class Rows(Protocol):
    """What a statement returns: its rows, and how many rows it changed."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Tx(Protocol):
    """One transaction: statements with `?` placeholders."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows: ...

    def notify(self, task_id: str, what: str) -> None:
        """Tell the other replicas that task `task_id` changed (`what`: its new state, or
        `logs` for its kept log), once this transaction commits; nothing where one process is
        all there is."""
        ...


class Database(Protocol):
    """A database the store runs its transactions on, each in a worker thread."""

    where: str
    """How errors name it: the file's path, or the server's URL without its password."""

    async def run(self, fn: Callable[[Tx], T]) -> T:
        """`fn` in one transaction, committed when it returns, rolled back when it raises;
        its errors and the database's translated (`TaskStoreError`, `ApiError`s kept)."""
        ...

    async def watch_changes(
        self,
        on_change: Callable[[str, str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call `on_change(task_id, what)` whenever another replica's transaction notified
        (`Tx.notify`), until cancelled."""
        ...

    async def aclose(self) -> None: ...


class TaskStoreError(ApiError):
    """The task database could not be used (locked, unreachable, from a newer controlplane)."""


def migrations_due(version: int, known: int, where: str) -> range:
    """The numbers of the migrations a database at schema `version` needs to reach `known`;
    a database from a newer controlplane is refused."""
    if version > known:
        raise TaskStoreError(
            ErrorCode.FAILED_PRECONDITION,
            f"task database {where} has schema version {version}, newer than "
            f"this controlplane knows ({known}); run a controlplane at least as "
            "new as the one that wrote it",
        )
    return range(version + 1, known + 1)


class CasConflict(Exception):
    """The row changed between our read and our write: read again."""
