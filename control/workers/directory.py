"""Who is where, kept in the task database so every replica reads the same answer.

Several controlplane replicas share one database (`control.tasks`); this module keeps in it
what they must agree on beyond task records:

- `replicas`: each live replica, the address the others dial it at and its certificate's
  fingerprint (a replica's certificate names the Service, not the pod, so peers pin the
  fingerprint as the controlplane pins a direct worker's), and until when it counts as alive
  (renewed by its heartbeat).
- `workers`: each worker known to any replica: the SHA-256 of its token (so a tunnel that lands
  on any replica is authenticated, while the token itself never reaches the database), what it
  last said about itself at registration, and which replica owns it until when. The owner is
  the replica holding its tunnel, or for a direct worker the one that took it; a request for
  the worker arriving at another replica is forwarded one hop to the owner.

Every ownership change is one conditional UPDATE, so two replicas never both take a worker:
`claim` takes a worker that nobody holds, whose owner's claim lapsed, or (with `force`, for a
tunnel that just arrived here: an agent keeps exactly one) from whoever held it. Times are the
replicas' wall clocks; a lease of 15 s leaves room for clocks a few seconds apart.

Everything here is one short transaction through `Database.run`; nothing is cached, the
callers (`control.workers.registry`) keep what they read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from control.db.base import Database, Tx

__all__ = ["Directory", "OwnerAddress", "WorkerRow", "token_hash"]


def token_hash(token: str) -> str:
    """What the database keeps of a worker's token."""
    return hashlib.sha256(token.encode()).hexdigest()


@attrs.frozen
class OwnerAddress:
    """Where the replica owning a worker is reached."""

    replica: str
    address: str
    fingerprint: str


@attrs.frozen
class WorkerRow:
    worker_id: str
    token_hash: str | None
    facts: dict[str, Any] | None
    owner: str | None
    owner_expires: float | None
    tunnel_replica: str | None = None
    """The replica the worker's newest tunnel landed on (tunnel mode), whoever owns it now."""


def _in(ids: Sequence[str]) -> str:
    return ",".join("?" for _ in ids)


class Directory:
    """The replicas' shared records, over the task database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    # -- replicas ----------------------------------------------------------------------------

    async def heartbeat(self, replica: str, address: str, fingerprint: str, until: float) -> None:
        def upsert(tx: Tx) -> None:
            tx.execute(
                "INSERT INTO replicas (id, address, fingerprint, expires_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET address=excluded.address, "
                "fingerprint=excluded.fingerprint, expires_at=excluded.expires_at",
                (replica, address, fingerprint, until),
            )

        await self._db.run(upsert)

    async def leave(self, replica: str) -> None:
        """This replica stops: its workers are free to take at once, and it is no peer."""

        def delete(tx: Tx) -> None:
            tx.execute(
                "UPDATE workers SET owner=NULL, owner_expires=NULL WHERE owner=?", (replica,)
            )
            tx.execute("DELETE FROM replicas WHERE id=?", (replica,))

        await self._db.run(delete)

    async def live_replicas(self, now: float) -> list[OwnerAddress]:
        def select(tx: Tx) -> list[OwnerAddress]:
            rows = tx.execute(
                "SELECT id, address, fingerprint FROM replicas WHERE expires_at > ? ORDER BY id",
                (now,),
            ).fetchall()
            return [OwnerAddress(str(r[0]), str(r[1]), str(r[2])) for r in rows]

        return await self._db.run(select)

    # -- workers -----------------------------------------------------------------------------

    async def add_worker(self, worker_id: str, hashed_token: str) -> None:
        """A worker whose token is known (minted for its Job, or from the config)."""

        def upsert(tx: Tx) -> None:
            tx.execute(
                "INSERT INTO workers (id, token_hash) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET token_hash=excluded.token_hash",
                (worker_id, hashed_token),
            )

        await self._db.run(upsert)

    async def remove_worker(self, worker_id: str) -> None:
        await self._db.run(lambda tx: tx.execute("DELETE FROM workers WHERE id=?", (worker_id,)))

    async def save_facts(self, worker_id: str, facts: dict[str, Any]) -> None:
        """What the worker last said about itself (its registration), for every replica."""
        text = json.dumps(facts, sort_keys=True)

        def upsert(tx: Tx) -> None:
            tx.execute(
                "INSERT INTO workers (id, facts) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET facts=excluded.facts",
                (worker_id, text),
            )

        await self._db.run(upsert)

    async def workers(self) -> list[WorkerRow]:
        def select(tx: Tx) -> list[WorkerRow]:
            rows = tx.execute(
                "SELECT id, token_hash, facts, owner, owner_expires, tunnel_replica FROM workers "
                "ORDER BY id"
            ).fetchall()
            return [
                WorkerRow(
                    worker_id=str(r[0]),
                    token_hash=r[1],
                    facts=json.loads(r[2]) if r[2] else None,
                    owner=r[3],
                    owner_expires=r[4],
                    tunnel_replica=r[5],
                )
                for r in rows
            ]

        return await self._db.run(select)

    async def claim(
        self,
        worker_id: str,
        replica: str,
        *,
        now: float,
        until: float,
        force: bool,
        tunnel: bool = False,
    ) -> bool:
        """Take the worker for `replica` until `until`: when nobody holds it, its owner's claim
        has lapsed, `replica` holds it already, or with `force`. True if taken. With `tunnel`
        (its tunnel just landed on `replica`), `replica` is recorded as where it is reached."""

        def take(tx: Tx) -> bool:
            tx.execute(
                "INSERT INTO workers (id) VALUES (?) ON CONFLICT (id) DO NOTHING", (worker_id,)
            )
            changed = tx.execute(
                "UPDATE workers SET owner=?, owner_expires=? WHERE id=? AND "
                "(? OR owner IS NULL OR owner=? OR owner_expires IS NULL OR owner_expires <= ?)",
                (replica, until, worker_id, force, replica, now),
            ).rowcount
            if tunnel and changed == 1:
                tx.execute(
                    "UPDATE workers SET tunnel_replica=?, tunnel_at=? WHERE id=?",
                    (replica, now, worker_id),
                )
            return changed == 1

        return await self._db.run(take)

    async def renew(self, replica: str, worker_ids: Sequence[str], until: float) -> set[str]:
        """Extend this replica's claims; returns those it still holds (another may have taken
        one meanwhile)."""
        if not worker_ids:
            return set()
        ids = list(worker_ids)

        def extend(tx: Tx) -> set[str]:
            tx.execute(
                f"UPDATE workers SET owner_expires=? WHERE owner=? AND id IN ({_in(ids)})",
                (until, replica, *ids),
            )
            rows = tx.execute(
                f"SELECT id FROM workers WHERE owner=? AND id IN ({_in(ids)})", (replica, *ids)
            ).fetchall()
            return {str(r[0]) for r in rows}

        return await self._db.run(extend)

    async def release(self, replica: str, worker_ids: Iterable[str]) -> None:
        ids = list(worker_ids)
        if not ids:
            return

        def free(tx: Tx) -> None:
            tx.execute(
                "UPDATE workers SET owner=NULL, owner_expires=NULL "
                f"WHERE owner=? AND id IN ({_in(ids)})",
                (replica, *ids),
            )

        await self._db.run(free)

    async def owner(self, worker_id: str, now: float) -> OwnerAddress | None:
        """The live replica owning the worker, or None."""

        def select(tx: Tx) -> OwnerAddress | None:
            row = tx.execute(
                "SELECT r.id, r.address, r.fingerprint FROM workers w JOIN replicas r "
                "ON r.id = w.owner WHERE w.id=? AND w.owner_expires > ? AND r.expires_at > ?",
                (worker_id, now, now),
            ).fetchone()
            return None if row is None else OwnerAddress(str(row[0]), str(row[1]), str(row[2]))

        return await self._db.run(select)
