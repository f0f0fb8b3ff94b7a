"""The dashboard's sessions, kept in the task database so that every replica honours them.

Why the database and not memory: behind one Service a browser's requests land on any replica,
and signing out on one must end the session on all of them. Each call is one short transaction
through `Database.run` (SQLite or PostgreSQL, table `ui_sessions`); nothing is cached, so a
deleted row is refused at the next request everywhere.

A row holds the SHA-256 of the session id (never the id, never the token it was made with),
the principal (`ws:NAME` or `api:NAME`), when it was made, last seen and its absolute expiry.
Whether a row still counts is `control.ui.session.session_live`, a pure function of the row,
the clock and `SessionLimits`; expired rows are deleted when met and swept at each sign-in.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from control.db.base import Database, Tx
from control.ui.session import (
    SessionLimits,
    SessionRow,
    new_session_id,
    session_hash,
    session_live,
    touch_due,
)

__all__ = ["SessionStore"]


class SessionStore:
    """Sessions over the task database; `clock` is the wall clock (replicas share rows)."""

    def __init__(
        self, db: Database, limits: SessionLimits, clock: Callable[[], float] = time.time
    ) -> None:
        self._db = db
        self.limits = limits
        self.clock = clock

    async def create(self, principal: str) -> str:
        """A new session for `principal`: its id, for the cookie (only its hash is stored).
        Expired rows of anyone are swept on the way."""
        session_id = new_session_id()
        now = self.clock()
        idle_before = now - self.limits.idle_s

        def insert(tx: Tx) -> None:
            tx.execute(
                "DELETE FROM ui_sessions WHERE expires_at <= ? OR last_seen_at <= ?",
                (now, idle_before),
            )
            tx.execute(
                "INSERT INTO ui_sessions (id_hash, principal, created_at, last_seen_at, "
                "expires_at) VALUES (?, ?, ?, ?, ?)",
                (session_hash(session_id), principal, now, now, now + self.limits.max_s),
            )

        await self._db.run(insert)
        return session_id

    async def principal(self, session_id: str) -> str | None:
        """Who the session stands for, or None when there is no such session or it expired
        (its row is then deleted). Marks it seen."""
        key = session_hash(session_id)
        now = self.clock()

        def look(tx: Tx) -> str | None:
            found = tx.execute(
                "SELECT principal, created_at, last_seen_at, expires_at FROM ui_sessions "
                "WHERE id_hash=?",
                (key,),
            ).fetchone()
            if found is None:
                return None
            row = SessionRow(str(found[0]), float(found[1]), float(found[2]), float(found[3]))
            if not session_live(row, now, self.limits):
                tx.execute("DELETE FROM ui_sessions WHERE id_hash=?", (key,))
                return None
            if touch_due(row, now, self.limits):
                tx.execute("UPDATE ui_sessions SET last_seen_at=? WHERE id_hash=?", (now, key))
            return row.principal

        return await self._db.run(look)

    async def revoke(self, session_id: str) -> None:
        """End the session (signing out): its row is deleted."""
        key = session_hash(session_id)
        await self._db.run(lambda tx: tx.execute("DELETE FROM ui_sessions WHERE id_hash=?", (key,)))

    async def sweep(self) -> int:
        """Delete every expired session; how many were."""
        now = self.clock()
        idle_before = now - self.limits.idle_s

        def delete(tx: Tx) -> int:
            rows = tx.execute(
                "DELETE FROM ui_sessions WHERE expires_at <= ? OR last_seen_at <= ?",
                (now, idle_before),
            )
            return int(rows.rowcount)

        return await self._db.run(delete)
