"""Opens the task store on the database `config.database` names.

Why a module of its own: the store and each backend depend on one another's types one way only
(a backend implements the store's `Database`), and this is the one place that knows both
backends, importing only the driver the settings need.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from control.config import DatabaseSettings
from control.database import Database
from control.tasks.store import TaskStore

__all__ = ["DatabaseWhere", "open_database", "open_task_store"]

DatabaseWhere = str | os.PathLike[str] | DatabaseSettings


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


async def open_database(where: DatabaseWhere) -> Database:
    # Imported here: each backend pulls in its driver, and a store needs only one.
    if isinstance(where, DatabaseSettings) and where.url is not None:
        from control.tasks.postgres import open_postgres

        return await open_postgres(where)
    from control.tasks.sqlite import open_sqlite

    path = where.path if isinstance(where, DatabaseSettings) else os.fspath(where)
    return await open_sqlite(path)
