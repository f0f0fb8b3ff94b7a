"""The worker registry: "the client for worker X", whichever way X is reached.

A direct worker registers its address and certificate fingerprint; the registry dials it
(TLS, certificate pinned to that fingerprint) when first asked and keeps the connection. A
tunnel worker dials us; the acceptor hands its connection here. Callers ask `client_for(id)`
and get a `WorkerClient` either way, waiting (under their own deadline) for a tunnel that is
reconnecting. When a tunnel is replaced (maximum age, reconnect), new requests take the new
one while the old one drains.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Mapping

import attrs
import trio

from agent.api.client import WorkerClient
from agent.api.models import Registration, WorkerInfo, WorkerSummary
from agent.wire.connection import Http2Connection, KeepaliveConfig
from agent.wire.errors import ApiError, ErrorCode
from agent.wire.http2 import Http2Settings
from agent.wire.tls import PinMismatchError, TLSStream, pinned_client_context

log = logging.getLogger("levers9.registry")


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


class WorkerRegistry:
    def __init__(
        self,
        tokens: Mapping[str, str],
        nursery: trio.Nursery,
        *,
        settings: Http2Settings | None = None,
        keepalive: KeepaliveConfig | None = None,
    ) -> None:
        self._entries = {wid: WorkerEntry(wid, token) for wid, token in tokens.items()}
        self._nursery = nursery
        self._settings = settings
        self._keepalive = keepalive
        self._changed = trio.lowlevel.ParkingLot()
        self._dial_locks: dict[str, trio.Lock] = {}
        self.listeners: list[Callable[[], None]] = []
        """Called after any change a scheduler cares about (registration, tunnel, removal)."""

    def _notify(self) -> None:
        self._changed.unpark_all()
        for listener in self.listeners:
            listener()

    # -- who is who --

    def add_worker(self, worker_id: str, token: str) -> None:
        """Accept a worker the controlplane started (its token minted for its Job)."""
        entry = self._entries.get(worker_id)
        if entry is None:
            self._entries[worker_id] = WorkerEntry(worker_id, token)
        else:
            entry.token = token

    async def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (its Job is gone): its token stops working, its clients close."""
        entry = self._entries.pop(worker_id, None)
        if entry is None:
            return
        for client in (entry.direct, entry.tunnel):
            if client is not None:
                await client.aclose()
        self._notify()

    def knows(self, worker_id: str) -> bool:
        return worker_id in self._entries

    def last_seen(self, worker_id: str, now: float) -> float | None:
        """When the worker was last heard from: now while it is connected, else when it last
        registered or opened a tunnel; None if never."""
        entry = self._entries.get(worker_id)
        if entry is None:
            return None
        if entry.tunnel is not None and entry.tunnel.conn.usable:
            return now
        return entry.registered_at

    def authenticate_worker(self, presented: str) -> str | None:
        """The worker id whose token this is, or None. Constant-time per comparison."""
        found = None
        for entry in self._entries.values():
            if hmac.compare_digest(entry.token.encode(), presented.encode()):
                found = entry.worker_id
        return found

    def check_token(self, worker_id: str, presented: str) -> bool:
        entry = self._entries.get(worker_id)
        expected = entry.token if entry is not None else "\0" * 32
        return hmac.compare_digest(expected.encode(), presented.encode()) and entry is not None

    def _entry(self, worker_id: str) -> WorkerEntry:
        entry = self._entries.get(worker_id)
        if entry is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no worker {worker_id!r} is known")
        return entry

    # -- direct mode --

    def register(self, registration: Registration) -> None:
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
        serving = tuple(c.uuid for c in registration.cards if c.state == "serving")
        entry.cards = len(serving)
        entry.card_ids = serving
        entry.cpu_millis = registration.cpu_millis or 0
        entry.memory_bytes = registration.memory_bytes or 0
        entry.runs_containers = registration.containers
        entry.registered_at = time.time()
        self._notify()

    def deregister(self, worker_id: str) -> None:
        """The worker is winding down: it stays reachable (its tasks' logs) but takes no more
        tasks."""
        self._entry(worker_id).draining = True
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
        host, _, port = entry.address.rpartition(":")
        host = host.strip("[]")
        try:
            tcp = await trio.open_tcp_stream(host, int(port))
        except OSError as exc:
            raise ApiError(
                ErrorCode.UNAVAILABLE,
                f"worker {entry.worker_id} at {entry.address} is unreachable: {exc.strerror}",
            ) from None
        tls = TLSStream(
            tcp,
            pinned_client_context(alpn=("h2",)),
            server_side=False,
            expected_fingerprint=entry.fingerprint,
        )
        try:
            await tls.do_handshake()
        except PinMismatchError:
            await tls.aclose()
            raise ApiError(
                ErrorCode.UNAVAILABLE,
                f"worker {entry.worker_id} at {entry.address} presented a certificate that is "
                "not the one it registered; refusing to talk to it",
            ) from None
        except trio.BrokenResourceError as exc:
            await tls.aclose()
            raise ApiError(
                ErrorCode.UNAVAILABLE,
                f"TLS with worker {entry.worker_id} at {entry.address} failed: {exc}",
            ) from None
        conn = Http2Connection(
            tls,
            client_side=True,
            settings=self._settings,
            keepalive=self._keepalive,
            name=entry.worker_id,
        )
        await self._nursery.start(conn.run)
        return WorkerClient(conn, token=entry.token, authority=entry.worker_id)

    # -- tunnel mode --

    def attach_tunnel(
        self, worker_id: str, client: WorkerClient, *, version: str | None = None
    ) -> None:
        entry = self._entry(worker_id)
        old = entry.tunnel
        entry.tunnel = client
        entry.mode = "tunnel"
        entry.version = version or entry.version
        entry.registered_at = time.time()
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
        entry.card_ids = tuple(c.uuid for c in info.cards if c.state == "serving")
        entry.cards = len(entry.card_ids)

    def detach_tunnel(self, worker_id: str, client: WorkerClient) -> None:
        entry = self._entries.get(worker_id)
        if entry is not None and entry.tunnel is client:
            entry.tunnel = None
            self._notify()

    # -- callers --

    async def client_for(self, worker_id: str) -> WorkerClient:
        """A usable client for the worker; waits for it to (re)connect under the caller's
        deadline (wrap the call in trio.fail_after)."""
        entry = self._entry(worker_id)
        while True:
            if entry.tunnel is not None and entry.tunnel.conn.usable:
                return entry.tunnel
            if entry.mode == "direct" and entry.address and entry.fingerprint:
                lock = self._dial_locks.setdefault(worker_id, trio.Lock())
                async with lock:
                    if entry.direct is None or not entry.direct.conn.usable:
                        entry.direct = await self._dial_direct(entry)
                    return entry.direct
            await self._changed.park()

    def list(self) -> list[WorkerSummary]:
        return [
            WorkerSummary(
                worker_id=e.worker_id,
                mode=e.mode or "unknown",
                connected=e.connected() or (e.mode == "direct" and e.registered_at is not None),
                version=e.version,
                address=e.address,
                node=e.node,
                registered_at=e.registered_at,
                cards=e.cards,
            )
            for e in sorted(self._entries.values(), key=lambda e: e.worker_id)
        ]

    async def aclose(self) -> None:
        for entry in self._entries.values():
            for client in (entry.direct, entry.tunnel):
                if client is not None:
                    await client.aclose()
