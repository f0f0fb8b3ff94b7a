"""Opens the database `config.database` names: PostgreSQL when it gives a URL, else SQLite.

Why a module of its own: this is the one place that knows both backends, importing only the
driver the settings need; the tables' owners (`control.tasks`, `control.workers`,
`control.ui`) see only the `Database` interface.
"""

from __future__ import annotations

import os

from control.config import DatabaseSettings
from control.db.base import Database

__all__ = ["DatabaseWhere", "open_database"]

DatabaseWhere = str | os.PathLike[str] | DatabaseSettings


async def open_database(where: DatabaseWhere) -> Database:
    # Imported here: each backend pulls in its driver, and a store needs only one.
    if isinstance(where, DatabaseSettings) and where.url is not None:
        from control.db.postgres import open_postgres

        return await open_postgres(where)
    from control.db.sqlite import open_sqlite

    path = where.path if isinstance(where, DatabaseSettings) else os.fspath(where)
    return await open_sqlite(path)
