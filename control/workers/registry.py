"""The worker registry: "the client for worker X", whichever way X is reached.

A direct worker registers its address and certificate fingerprint; the registry dials it
(TLS, certificate pinned to that fingerprint) when first asked and keeps the connection. A
tunnel worker dials us; the acceptor hands its connection here. Callers ask `client_for(id)`
and get a `WorkerClient` either way, waiting (under their own deadline) for a tunnel that is
reconnecting. When a tunnel is replaced (maximum age, reconnect), new requests take the new
one while the old one drains.

With several replicas (`Replication`), what one replica learns is kept in the directory
(`control.workers.directory`) for the others: each worker's token as a hash (a tunnel is
authenticated wherever it lands), its registration, and which replica owns it. The owner holds
its tunnel (taken by force when a tunnel arrives: an agent keeps exactly one), or for a direct
worker or a worker with tasks and no live owner, took it when nobody held it. Only the owner
schedules onto a worker and watches its tasks; `client_for` on any other replica gives a
client whose requests the owner forwards (`control.workers.forward`), and a direct worker is
dialed by any replica that knows its token. `sync` (every third of the lease) renews this
replica's claims and reads everyone else's.
"""

from __future__ import annotations

import builtins
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from control.workers.cards import CardNews, card_news, problem_facts, problems, problems_from_facts
from control.workers.directory import Directory, OwnerAddress, WorkerRow, token_hash
from control.workers.forward import Peers, dial_pinned
from wire.connection import Http2Connection, KeepaliveConfig
from wire.errors import ApiError, ErrorCode
from wire.http2 import Http2Settings
from workerapi.client import WorkerClient
from workerapi.models import CardInfo, CardState, Registration, WorkerInfo, WorkerSummary

log = logging.getLogger("levers9.registry")

OWNER_POLL_S = 0.5
"""How often a caller waiting for a worker with no reachable owner looks again."""
OWNER_CACHE_S = 1.0
"""How long a worker's owner, once read from the directory, is taken as known: a forwarded
call then costs no database round trip; a tunnel that moved meanwhile is found within it."""


@attrs.define(eq=False)
class Replication:
    """This replica's part in several: its name, the shared directory, and (with a replica
    secret) the connections it forwards on."""

    directory: Directory
    replica: str
    lease_s: float
    peers: Peers | None = None
    """None: no replica secret is configured; a worker owned elsewhere is waited for."""


@attrs.define
class WorkerEntry:
    worker_id: str
    token: str = attrs.field(repr=False)
    mode: str | None = None
    version: str | None = None
    address: str | None = None
    fingerprint: str | None = None
    node: str | None = None
    registered_at: float | None = None
    cards: int = 0
    card_ids: tuple[str, ...] = ()
    card_model: str | None = None
    """The model of its serving cards (the first one's, as reported)."""
    problem_cards: tuple[CardInfo, ...] = ()
    """Its cards out of placement (refused, unhealthy, occupied), as last reported."""
    connected_at: float | None = None
    """When this replica's current tunnel or direct connection to it opened."""
    cpu_millis: int = 0
    memory_bytes: int = 0
    runs_containers: bool = False
    draining: bool = False
    """The worker deregistered (it is winding down): it takes no more tasks."""
    tunnel: WorkerClient | None = None
    direct: WorkerClient | None = None

    def connected(self) -> bool:
        for client in (self.tunnel, self.direct):
            if client is not None and client.conn.usable:
                return True
        return False


@asynccontextmanager
async def open_worker_registry(
    tokens: Mapping[str, str],
    *,
    settings: Http2Settings | None = None,
    keepalive: KeepaliveConfig | None = None,
    replication: Replication | None = None,
    clock: Callable[[], float] = time.time,
    on_connection: Callable[[Http2Connection, str], None] | None = None,
) -> AsyncIterator[WorkerRegistry]:
    """A `WorkerRegistry` whose direct connections run in a nursery of its own, closed as the
    block ends. `on_connection` is told of each tunnel that lands and each direct connection
    dialed, with its mode (metrics count their bytes and round trips)."""
    async with trio.open_nursery() as nursery:
        yield WorkerRegistry(
            tokens,
            nursery,
            settings=settings,
            keepalive=keepalive,
            replication=replication,
            clock=clock,
            on_connection=on_connection,
        )
        nursery.cancel_scope.cancel()


class WorkerRegistry:
    """Opened by `open_worker_registry`, which runs the connections it dials."""

    def __init__(
        self,
        tokens: Mapping[str, str],
        nursery: trio.Nursery,
        *,
        settings: Http2Settings | None = None,
        keepalive: KeepaliveConfig | None = None,
        replication: Replication | None = None,
        clock: Callable[[], float] = time.time,
        on_connection: Callable[[Http2Connection, str], None] | None = None,
    ) -> None:
        self._entries = {wid: WorkerEntry(wid, token) for wid, token in tokens.items()}
        self._configured = dict(tokens)
        self.replication = replication
        self._rows: dict[str, WorkerRow] = {}
        """The directory's workers as last read (every replica's)."""
        self._hashes: dict[str, str] = {}
        """Token hash → worker id, from the directory."""
        self._owned: set[str] = set()
        """Workers this replica holds a claim on (with replication)."""
        self._owner_cache: dict[str, tuple[OwnerAddress, float]] = {}
        self._clock = clock
        self._nursery = nursery
        self.on_connection = on_connection
        self._settings = settings
        self._keepalive = keepalive
        self._changed = trio.lowlevel.ParkingLot()
        self._dial_locks: dict[str, trio.Lock] = {}
        self.listeners: list[Callable[[], None]] = []
        """Called after any change a scheduler cares about (registration, tunnel, removal)."""
        self.card_listeners: list[Callable[[tuple[CardNews, ...]], None]] = []
        """Told once of each card that became unhealthy or occupied (or serves again), as a
        registration or the worker's info reports it (the pools post Events on its Job)."""

    def _notify(self) -> None:
        self._changed.unpark_all()
        for listener in self.listeners:
            listener()

    # -- who is who --

    async def add_worker(self, worker_id: str, token: str) -> None:
        """Accept a worker the controlplane started (its token minted for its Job)."""
        entry = self._entries.get(worker_id)
        if entry is None:
            self._entries[worker_id] = WorkerEntry(worker_id, token)
        else:
            entry.token = token
        if self.replication is not None:
            hashed = token_hash(token)
            self._hashes[hashed] = worker_id
            await self.replication.directory.add_worker(worker_id, hashed)

    async def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (its Job is gone): its token stops working, its clients close."""
        if self.replication is not None:
            await self.replication.directory.remove_worker(worker_id)
            self._forget_row(worker_id)
        self._owned.discard(worker_id)
        entry = self._entries.pop(worker_id, None)
        if entry is None:
            return
        await self._close_clients(entry)
        self._notify()

    def _forget_row(self, worker_id: str) -> None:
        row = self._rows.pop(worker_id, None)
        if row is not None and row.token_hash is not None:
            self._hashes.pop(row.token_hash, None)

    async def _close_clients(self, entry: WorkerEntry) -> None:
        for client in (entry.direct, entry.tunnel):
            if client is not None:
                await client.aclose()

    def has_token(self, worker_id: str) -> bool:
        """Whether this replica holds the worker's token itself (not only its hash)."""
        return worker_id in self._entries

    def token_of(self, worker_id: str) -> str | None:
        """The worker's token, where this replica holds it (to write its Secret again)."""
        entry = self._entries.get(worker_id)
        return entry.token if entry is not None else None

    def knows(self, worker_id: str) -> bool:
        return worker_id in self._entries or worker_id in self._rows

    def last_seen(self, worker_id: str, now: float) -> float | None:
        """When the worker was last heard from: now while it is connected, else when it last
        registered or opened a tunnel; None if never."""
        entry = self._entries.get(worker_id)
        row = self._rows.get(worker_id)
        if entry is not None and entry.tunnel is not None and entry.tunnel.conn.usable:
            return now
        if row is not None and row.owner is not None and (row.owner_expires or 0) > now:
            return now  # another replica holds it
        seen = (entry.registered_at if entry is not None else None, _registered_at(row))
        times = [t for t in seen if t is not None]
        return max(times) if times else None

    def authenticate_worker(self, presented: str) -> str | None:
        """The worker id whose token this is, or None. Constant-time per comparison; a token
        another replica accepted is known by its hash in the directory."""
        found = None
        for entry in self._entries.values():
            if hmac.compare_digest(entry.token.encode(), presented.encode()):
                found = entry.worker_id
        if found is None and self._hashes:
            found = self._hashes.get(token_hash(presented))
            if found is not None:
                self._learn_token(found, presented)
        return found

    def check_token(self, worker_id: str, presented: str) -> bool:
        entry = self._entries.get(worker_id)
        expected = entry.token if entry is not None else "\0" * 32
        if hmac.compare_digest(expected.encode(), presented.encode()) and entry is not None:
            return True
        if entry is None and self._hashes.get(token_hash(presented)) == worker_id:
            self._learn_token(worker_id, presented)
            return True
        return False

    def _learn_token(self, worker_id: str, token: str) -> None:
        if worker_id not in self._entries:
            self._entries[worker_id] = WorkerEntry(worker_id, token)

    def _entry(self, worker_id: str) -> WorkerEntry:
        entry = self._entries.get(worker_id)
        if entry is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no worker {worker_id!r} is known")
        return entry

    # -- direct mode --

    async def register(self, registration: Registration) -> None:
        self._apply_registration(registration, time.time())
        if self.replication is not None:
            entry = self._entry(registration.worker_id)
            await self.replication.directory.save_facts(entry.worker_id, _facts(entry))
            if entry.mode == "direct":
                await self._claim(entry.worker_id, force=False)

    def _apply_registration(self, registration: Registration, now: float) -> None:
        entry = self._entry(registration.worker_id)
        if registration.mode == "direct":
            if not registration.address or not registration.fingerprint:
                raise ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    "a direct worker must register its address and certificate fingerprint",
                    field="address" if not registration.address else "fingerprint",
                )
            if entry.fingerprint not in (None, registration.fingerprint) or (
                entry.address not in (None, registration.address)
            ):
                # A new worker process (new key) or a new address: forget the old connection.
                self._drop_direct(entry)
        if entry.direct is not None and not entry.direct.conn.usable:
            self._drop_direct(entry)  # the next call dials again
        entry.mode = registration.mode
        entry.version = registration.version
        entry.address = registration.address
        entry.fingerprint = registration.fingerprint
        entry.node = registration.node
        self._take_cards(entry, registration.cards)
        entry.cpu_millis = registration.cpu_millis or 0
        entry.memory_bytes = registration.memory_bytes or 0
        entry.runs_containers = registration.containers
        entry.registered_at = now
        self._notify()

    async def deregister(self, worker_id: str) -> None:
        """The worker is winding down: it stays reachable (its tasks' logs) but takes no more
        tasks."""
        entry = self._entry(worker_id)
        entry.draining = True
        if self.replication is not None:
            await self.replication.directory.save_facts(worker_id, _facts(entry))
        self._notify()

    def entries(self) -> list[WorkerEntry]:
        return list(self._entries.values())

    def entry(self, worker_id: str) -> WorkerEntry | None:
        return self._entries.get(worker_id)

    def _drop_direct(self, entry: WorkerEntry) -> None:
        if entry.direct is not None:
            old = entry.direct
            entry.direct = None
            self._nursery.start_soon(old.aclose)

    async def _dial_direct(self, entry: WorkerEntry) -> WorkerClient:
        assert entry.address is not None and entry.fingerprint is not None
        where = f"worker {entry.worker_id} at {entry.address}"
        tls = await dial_pinned(entry.address, entry.fingerprint, where, "registered")
        conn = Http2Connection(
            tls,
            client_side=True,
            settings=self._settings,
            keepalive=self._keepalive,
            name=entry.worker_id,
        )
        await self._nursery.start(conn.run)
        entry.connected_at = time.time()
        if self.on_connection is not None:
            self.on_connection(conn, "direct")
        return WorkerClient(conn, token=entry.token, authority=entry.worker_id)

    # -- tunnel mode --

    async def attach_tunnel(
        self, worker_id: str, client: WorkerClient, *, version: str | None = None
    ) -> None:
        """The worker's tunnel landed here: this replica owns it now, whoever did before."""
        self._attach(worker_id, client, version)
        await self._claim(worker_id, force=True, tunnel=True)

    def _attach(self, worker_id: str, client: WorkerClient, version: str | None) -> None:
        entry = self._entry(worker_id)
        old = entry.tunnel
        entry.tunnel = client
        entry.mode = "tunnel"
        entry.version = version or entry.version
        entry.registered_at = entry.connected_at = time.time()
        if self.on_connection is not None and old is not client:
            self.on_connection(client.conn, "tunnel")
        if old is not None and old is not client and not old.conn.closed:
            # The agent drains the old tunnel itself (GOAWAY); we just stop using it.
            log.info("worker %s opened a new tunnel; the old one drains", worker_id)
        self._notify()

    def learn(self, info: WorkerInfo) -> None:
        """Record what a worker said about itself."""
        entry = self._entries.get(info.worker_id)
        if entry is None:
            return
        entry.version = info.version
        entry.node = info.node
        self._take_cards(entry, info.cards)

    def _take_cards(self, entry: WorkerEntry, cards: Sequence[CardInfo]) -> None:
        """The worker's cards as it reports them; a card's change of state is told once."""
        news = card_news(entry.worker_id, entry.node, entry.problem_cards, cards)
        entry.card_ids = tuple(c.uuid for c in cards if c.state is CardState.SERVING)
        entry.cards = len(entry.card_ids)
        entry.card_model = _model_of(cards)
        entry.problem_cards = problems(cards)
        if news:
            for listener in self.card_listeners:
                listener(news)

    def card_problems(self) -> dict[str, tuple[CardInfo, ...]]:
        """Node → the cards out of placement of the worker there, from this replica's own
        registrations and the directory's (another replica's)."""
        out: dict[str, tuple[CardInfo, ...]] = {}
        for row in self._rows.values():
            node = (row.facts or {}).get("node")
            found = problems_from_facts((row.facts or {}).get("problemCards"))
            if isinstance(node, str) and found:
                out[node] = found
        for entry in self._entries.values():
            if entry.node is not None and entry.registered_at is not None:
                out[entry.node] = entry.problem_cards
        return {node: cards for node, cards in out.items() if cards}

    def detach_tunnel(self, worker_id: str, client: WorkerClient) -> None:
        entry = self._entries.get(worker_id)
        if entry is not None and entry.tunnel is client:
            entry.tunnel = None
            self._notify()
        # The claim stays until it lapses or the next tunnel lands elsewhere and takes it:
        # the agent reconnects within its backoff, most likely here again.

    # -- callers --

    async def client_for(self, worker_id: str) -> WorkerClient:
        """A usable client for the worker; waits for it to (re)connect under the caller's
        deadline (wrap the call in trio.fail_after)."""
        if self.replication is None:
            self._entry(worker_id)  # NOT_FOUND for an unknown worker
        elif not self.knows(worker_id):
            raise ApiError(ErrorCode.NOT_FOUND, f"no worker {worker_id!r} is known")
        while True:
            local = await self._local(worker_id)
            if local is not None:
                return local
            if self.replication is None:
                await self._changed.park()
                continue
            remote = await self._forwarded(worker_id)
            if remote is not None:
                return remote
            with trio.move_on_after(OWNER_POLL_S):
                await self._changed.park()

    async def local_client(self, worker_id: str) -> WorkerClient:
        """This replica's own connection to the worker (its tunnel, or a direct dial), never a
        forwarded one: what a forwarded request is served from."""
        local = await self._local(worker_id)
        if local is None:
            raise ApiError(
                ErrorCode.UNAVAILABLE, f"worker {worker_id} is not connected to this replica"
            )
        return local

    async def _local(self, worker_id: str) -> WorkerClient | None:
        entry = self._entries.get(worker_id)
        if entry is None:
            return None
        if entry.tunnel is not None and entry.tunnel.conn.usable:
            return entry.tunnel
        if entry.mode == "direct" and entry.address and entry.fingerprint:
            lock = self._dial_locks.setdefault(worker_id, trio.Lock())
            async with lock:
                if entry.direct is None or not entry.direct.conn.usable:
                    entry.direct = await self._dial_direct(entry)
                return entry.direct
        return None

    async def _forwarded(self, worker_id: str) -> WorkerClient | None:
        """A client through the worker's owner, when another live replica owns it."""
        assert self.replication is not None
        if self.replication.peers is None:
            return None
        now = self._clock()
        cached = self._owner_cache.get(worker_id)
        if cached is not None and cached[1] > now:
            owner: OwnerAddress | None = cached[0]
        else:
            owner = await self.replication.directory.owner(worker_id, now)
            if owner is not None:
                self._owner_cache[worker_id] = (owner, now + OWNER_CACHE_S)
        if owner is None or owner.replica == self.replication.replica:
            self._owner_cache.pop(worker_id, None)
            return None
        if worker_id in self._owned:
            # Taken by the replica its tunnel landed on: its watchers hand over now, not at
            # the next renewal.
            self._owned.discard(worker_id)
            self._notify()
        try:
            return await self.replication.peers.client_for(owner, worker_id)
        except ApiError as exc:
            self._owner_cache.pop(worker_id, None)
            if exc.code is not ErrorCode.UNAVAILABLE:
                raise
            # The owner is gone (killed: its claim lapses within the lease) or unreachable
            # for now: look again.
            return None

    def list(self) -> builtins.list[WorkerSummary]:
        """Every worker any replica knows: this replica's own view of those it holds, the
        directory's of the rest."""
        now = self._clock()
        out = {
            e.worker_id: WorkerSummary(
                worker_id=e.worker_id,
                mode=e.mode or "unknown",
                connected=e.connected() or (e.mode == "direct" and e.registered_at is not None),
                version=e.version,
                address=e.address,
                node=e.node,
                registered_at=e.registered_at,
                cards=e.cards,
                replica=self._holder(e.worker_id, now),
                connected_at=e.connected_at if e.connected() else None,
                rtt_ms=_rtt_ms(e),
                card_model=e.card_model,
            )
            for e in self._entries.values()
            if self.replication is None
            or e.worker_id in self._owned
            or e.worker_id not in self._rows
        }
        for row in self._rows.values():
            if row.worker_id in out:
                continue
            facts = row.facts or {}
            out[row.worker_id] = WorkerSummary(
                worker_id=row.worker_id,
                mode=str(facts.get("mode") or "unknown"),
                connected=row.owner is not None and (row.owner_expires or 0) > now,
                version=facts.get("version"),
                address=facts.get("address"),
                node=facts.get("node"),
                registered_at=facts.get("registeredAt"),
                cards=int(facts.get("cards") or 0),
                replica=self._holder(row.worker_id, now),
                card_model=facts.get("cardModel"),
            )
        return [out[k] for k in sorted(out)]

    # -- ownership (several replicas) ---------------------------------------------------------

    def _holder(self, worker_id: str, now: float) -> str | None:
        if self.replication is None:
            return None
        if worker_id in self._owned:
            return self.replication.replica
        row = self._rows.get(worker_id)
        if row is None or row.owner is None or (row.owner_expires or 0) <= now:
            return None
        return row.owner

    def _reached_here(self, worker_id: str, row: WorkerRow) -> bool:
        """The worker's newest tunnel landed on this replica and is open."""
        assert self.replication is not None
        entry = self._entries.get(worker_id)
        return (
            row.tunnel_replica == self.replication.replica
            and entry is not None
            and entry.tunnel is not None
            and entry.tunnel.conn.usable
        )

    def owns(self, worker_id: str) -> bool:
        """Whether this replica schedules onto the worker and watches its tasks (always, with
        no replication)."""
        return self.replication is None or worker_id in self._owned

    def owned_ids(self) -> set[str]:
        """The workers this replica holds a claim on (with replication), known here or not."""
        return set(self._owned)

    def owned_entries(self) -> builtins.list[WorkerEntry]:
        return [e for e in self._entries.values() if self.owns(e.worker_id)]

    async def _claim(self, worker_id: str, *, force: bool, tunnel: bool = False) -> bool:
        assert self.replication is not None
        now = self._clock()
        taken = await self.replication.directory.claim(
            worker_id,
            self.replication.replica,
            now=now,
            until=now + self.replication.lease_s,
            force=force,
            tunnel=tunnel,
        )
        if taken:
            self._owner_cache.pop(worker_id, None)
        if taken and worker_id not in self._owned:
            self._owned.add(worker_id)
            log.info("this replica owns worker %s now", worker_id, extra={"worker": worker_id})
            self._notify()
        return taken

    async def sync(self, claim: Collection[str] = ()) -> None:
        """Renew this replica's claims, read the directory, and take the workers in `claim`
        (those with tasks and no live owner) and the direct workers this replica can dial that
        nobody holds."""
        assert self.replication is not None
        replication = self.replication
        now = self._clock()
        until = now + replication.lease_s
        held = await replication.directory.renew(replication.replica, sorted(self._owned), until)
        lost = self._owned - held
        rows = {row.worker_id: row for row in await replication.directory.workers()}
        self._rows = rows
        self._hashes = {r.token_hash: r.worker_id for r in rows.values() if r.token_hash}
        changed = bool(lost)
        for worker_id in lost:
            self._owned.discard(worker_id)
            row = rows.get(worker_id)
            # Taken while this replica renewed late (a loaded machine, a slow database), by
            # one that cannot reach the worker: its tunnel is here, so is its owner.
            if (
                row is not None
                and self._reached_here(worker_id, row)
                and await self._claim(worker_id, force=True)
            ):
                log.info(
                    "worker %s: taken back from %s; its tunnel is here",
                    worker_id,
                    row.owner or "nobody",
                    extra={"worker": worker_id, "replica": row.owner or ""},
                )
                continue
            owner = row.owner if row is not None else None
            log.info(
                "worker %s is owned by %s now",
                worker_id,
                owner or "nobody",
                extra={"worker": worker_id, "replica": owner or ""},
            )
        for worker_id, entry in list(self._entries.items()):
            row = rows.get(worker_id)
            if row is None and worker_id not in self._configured:
                # Removed by the replica leading its pool.
                del self._entries[worker_id]
                self._owned.discard(worker_id)
                await self._close_clients(entry)
                changed = True
                continue
            if row is not None and row.facts:
                changed |= _refresh(entry, row.facts)
        for worker_id, row in rows.items():
            if worker_id in self._owned:
                continue
            lapsed = row.owner is None or (row.owner_expires or 0) <= now
            if not lapsed:
                continue
            known = self._entries.get(worker_id)
            tunnel_here = known is not None and known.tunnel is not None and known.connected()
            dialable = (
                known is not None
                and (row.facts or {}).get("mode") == "direct"
                and (row.facts or {}).get("address")
            )
            # A worker with tasks is taken even when its token is not known here: its watchers
            # wait for it, and lose it to the replica its tunnel lands on. Not while its
            # owner may only be renewing late: that one holds its tunnel.
            orphaned = worker_id in claim and (
                row.owner is None or (row.owner_expires or 0) + replication.lease_s <= now
            )
            if tunnel_here or dialable or orphaned:
                changed |= await self._claim(worker_id, force=False)
        if changed:
            self._notify()

    async def leave(self) -> None:
        """Stopping: the workers this replica held are free to take at once."""
        if self.replication is not None:
            await self.replication.directory.leave(self.replication.replica)
            self._owned.clear()

    async def aclose(self) -> None:
        for entry in self._entries.values():
            await self._close_clients(entry)
        if self.replication is not None and self.replication.peers is not None:
            await self.replication.peers.aclose()


def _facts(entry: WorkerEntry) -> dict[str, object]:
    """What the directory keeps of a worker's registration (no token)."""
    return {
        "mode": entry.mode,
        "version": entry.version,
        "address": entry.address,
        "fingerprint": entry.fingerprint,
        "node": entry.node,
        "cards": entry.cards,
        "cardIds": list(entry.card_ids),
        "cardModel": entry.card_model,
        "problemCards": problem_facts(entry.problem_cards),
        "cpuMillis": entry.cpu_millis,
        "memoryBytes": entry.memory_bytes,
        "containers": entry.runs_containers,
        "draining": entry.draining,
        "registeredAt": entry.registered_at,
    }


def _rtt_ms(entry: WorkerEntry) -> float | None:
    """The last keepalive round trip to the worker on this replica's connection, if any."""
    for client in (entry.tunnel, entry.direct):
        if client is not None and client.conn.usable:
            rtt = client.conn.statistics().last_rtt_s
            return round(rtt * 1000, 3) if rtt is not None else None
    return None


def _model_of(cards: Sequence[CardInfo]) -> str | None:
    """The model of a worker's serving cards, as its first one names it."""
    return next((c.model for c in cards if c.state is CardState.SERVING), None)


def _registered_at(row: WorkerRow | None) -> float | None:
    if row is None or not row.facts:
        return None
    value = row.facts.get("registeredAt")
    return float(value) if isinstance(value, int | float) else None


def _refresh(entry: WorkerEntry, facts: dict[str, object]) -> bool:
    """Take a registration another replica received, if newer than what this one has."""
    at = facts.get("registeredAt")
    if not isinstance(at, int | float) or (entry.registered_at or 0) >= at:
        return False
    entry.mode = str(facts.get("mode") or entry.mode or "")
    entry.version = facts.get("version") or entry.version  # type: ignore[assignment]
    entry.address = facts.get("address")  # type: ignore[assignment]
    entry.fingerprint = facts.get("fingerprint")  # type: ignore[assignment]
    entry.node = facts.get("node")  # type: ignore[assignment]
    entry.card_ids = tuple(facts.get("cardIds") or ())  # type: ignore[arg-type]
    entry.cards = int(facts.get("cards") or 0)  # type: ignore[call-overload]
    entry.card_model = facts.get("cardModel")  # type: ignore[assignment]
    entry.problem_cards = problems_from_facts(facts.get("problemCards"))
    entry.cpu_millis = int(facts.get("cpuMillis") or 0)  # type: ignore[call-overload]
    entry.memory_bytes = int(facts.get("memoryBytes") or 0)  # type: ignore[call-overload]
    entry.runs_containers = bool(facts.get("containers"))
    entry.draining = bool(facts.get("draining"))
    entry.registered_at = float(at)
    return True
