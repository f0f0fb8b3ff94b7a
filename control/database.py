"""The interface the controlplane's databases offer: one transaction at a time in a worker
thread, and word of other replicas' changes.

Why a module of its own: the task records (`control.tasks`) and the replicas' directory
(`control.replicas`) keep their tables in the same database, and neither should import the
other to name it. `control.tasks.sqlite` and `control.tasks.postgres` implement it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import trio

__all__ = ["Database", "Rows", "Tx"]

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
