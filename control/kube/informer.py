"""A cache of one collection of a cluster's objects, kept by list + watch, as client-go's
informers keep theirs.

Why this module exists: a pool that re-lists every node and every pod each period reads
megabytes per pass and makes the API server (and its priority-and-fairness queues) pay for
it; at a few thousand nodes a pass no longer fits its period. An `Informer` lists its
collection once, in pages, then watches it from the list's resourceVersion with bookmarks,
so in steady state only changes (and a bookmark a minute) cross the wire. A watch the server
ends or a connection that drops resumes from the last version seen, with no list; only a 410
Gone (the version is older than the server keeps) lists again, and the store is then replaced,
its differences told as changes.

Objects are kept as their facts (`control.kube.planner.node_facts` and friends), never as
whole objects: what a pass reads of a pod is a few numbers. Listeners get every change as
(key, old, new) after it was applied; two facts are equal when the rules read the same from
them, so a change of an ignored field (a node's heartbeat, a pod's conditions) is no change.

The decoding of a watch stream and the store are sans-IO (`WatchDecoder`, `Store`) and tested
without sockets; `Informer.run` is the thin loop around them. A watch's bytes are read in a
worker thread of the informer's own (a blocked read holds no thread the API calls need), and a
read that waits is ended by shutting the connection down when the informer stops.

`fill` serves a cache that keeps a subset of its collection (pods of the pools' nodes only):
when the subset grows, the objects that now belong are listed with a narrower field selector
and merged; a key deleted by the watch while that list ran is not brought back.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio

from agent.wire.backoff import Backoff, BackoffState, next_delay, record_failure
from agent.wire.errors import ErrorCode
from control.kube.adapter import (
    Collection,
    KubeError,
    KubeExpired,
    KubeUnreachable,
    Page,
    WatchResponse,
    object_key,
)

__all__ = [
    "CacheApi",
    "Change",
    "Informer",
    "Store",
    "WatchDecoder",
    "WatchEvent",
]

log = logging.getLogger("levers9.cache")
T = TypeVar("T")

ADDED, MODIFIED, DELETED, BOOKMARK, ERROR = "ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"
WATCH_TIMEOUT_S = 300
"""A watch asks the server to end it after 5 to 10 minutes (client-go's range), so watches
of many controllers do not all restart together and a stale connection cannot last."""
RETRY = Backoff(initial_s=0.5, factor=2.0, cap_s=30.0, stable_s=0.0, jitter=0.5)
QUICK_END_S = 1.0
"""A watch that ends this soon after it opened, with nothing in it, counts as a failure."""


@attrs.frozen
class WatchEvent(Generic[T]):
    """One line of a watch: its type, the object's key and version, and its facts (None for
    a bookmark, or for an object the facts leave out)."""

    type: str
    key: str
    resource_version: str
    fact: T | None


class WatchDecoder(Generic[T]):
    """Bytes of a watch stream in, events out: one JSON object per line, split anywhere."""

    def __init__(self, facts: Callable[[dict[str, Any]], T | None], what: str) -> None:
        self._facts = facts
        self._what = what
        self._partial = b""

    def feed(self, data: bytes) -> list[WatchEvent[T]]:
        """The events completed by `data`. An ERROR event raises: `KubeExpired` for 410."""
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return [self._event(line) for line in lines if line.strip()]

    def _event(self, line: bytes) -> WatchEvent[T]:
        try:
            event = json.loads(line)
            kind = str(event["type"])
            obj = event["object"]
        except (ValueError, KeyError, TypeError):
            raise KubeError(
                ErrorCode.INTERNAL, f"watch of {self._what}: a line is not a watch event"
            ) from None
        if kind == ERROR:
            code = obj.get("code") if isinstance(obj, dict) else None
            message = str(obj.get("message", "")) if isinstance(obj, dict) else ""
            if code == 410:
                raise KubeExpired(f"watch of {self._what}: its version has expired ({message})")
            raise KubeError(
                ErrorCode.UNAVAILABLE,
                f"watch of {self._what}: the API server ended it with {code}: {message}",
                status=code if isinstance(code, int) else None,
            )
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if kind == BOOKMARK:
            return WatchEvent(kind, "", version, None)
        return WatchEvent(kind, object_key(obj), version, self._facts(obj))


@attrs.frozen
class Change(Generic[T]):
    """What one key went from and to (None: absent)."""

    key: str
    old: T | None
    new: T | None


@attrs.define
class Store(Generic[T]):
    """Facts by key, the version they are at, and which of them the cache keeps."""

    keep: Callable[[T], bool] | None = None
    items: dict[str, T] = attrs.field(factory=dict)
    resource_version: str = ""
    _fills: int = 0
    _gone: set[str] = attrs.field(factory=set)

    def _kept(self, fact: T | None) -> bool:
        return fact is not None and (self.keep is None or self.keep(fact))

    def replace(self, items: dict[str, T], resource_version: str) -> list[Change[T]]:
        """A whole list: the store becomes it; the differences are the changes."""
        new = {key: fact for key, fact in items.items() if self._kept(fact)}
        old = self.items
        changes = [
            Change(key, old.get(key), fact) for key, fact in new.items() if old.get(key) != fact
        ]
        changes += [Change(key, fact, None) for key, fact in old.items() if key not in new]
        self.items = new
        self.resource_version = resource_version
        return changes

    def apply(self, event: WatchEvent[T]) -> Change[T] | None:
        """One watch event; the change it made, if any."""
        if event.resource_version:
            self.resource_version = event.resource_version
        if event.type == BOOKMARK:
            return None
        old = self.items.get(event.key)
        if event.type != DELETED and self._kept(event.fact):
            assert event.fact is not None
            self.items[event.key] = event.fact
            return Change(event.key, old, event.fact) if old != event.fact else None
        if self._fills and event.type == DELETED:
            self._gone.add(event.key)
        if old is None:
            return None
        del self.items[event.key]
        return Change(event.key, old, None)

    def begin_fill(self) -> None:
        self._fills += 1

    def end_fill(self, items: dict[str, T]) -> list[Change[T]]:
        """Merge what a narrower list found: keys the store has are newer there already, and
        keys deleted since the list began stay deleted."""
        changes = []
        for key, fact in items.items():
            if key in self.items or key in self._gone or not self._kept(fact):
                continue
            self.items[key] = fact
            changes.append(Change(key, None, fact))
        self._fills -= 1
        if not self._fills:
            self._gone.clear()
        return changes

    def drop(self, leaves: Callable[[T], bool]) -> list[Change[T]]:
        """Forget the facts `leaves` picks (the subset the cache keeps shrank)."""
        gone = [key for key, fact in self.items.items() if leaves(fact)]
        return [Change(key, self.items.pop(key), None) for key in gone]


class CacheApi(Protocol):
    """What an informer needs of the cluster (`KubeClient` has it)."""

    async def list_page(
        self,
        collection: Collection,
        facts: Callable[[dict[str, Any]], T | None],
        *,
        continue_token: str | None = None,
    ) -> Page[T]: ...

    async def watch(
        self, collection: Collection, resource_version: str, *, timeout_s: int
    ) -> WatchResponse: ...


Listener = Callable[[list[Change[T]]], None]


class Informer(Generic[T]):
    """One collection's cache; `run` in a nursery keeps it. `synced` is set after the first
    list; `error` is the failure that keeps it from the server now (None while it is fine)."""

    def __init__(
        self,
        api: CacheApi,
        collection: Collection,
        facts: Callable[[dict[str, Any]], T | None],
        *,
        label: str,
        keep: Callable[[T], bool] | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self.api = api
        self.collection = collection
        self.facts = facts
        self.label = label
        self.store: Store[T] = Store(keep=keep)
        self.synced = trio.Event()
        self.error: KubeError | None = None
        self.first_outcome = trio.Event()
        """Set by the first list's outcome: listed (`synced`) or failed (`error`)."""
        self.lists = 0
        """Full lists made (the first, and one per 410 Gone)."""
        self.watches = 0
        self.bytes_read = 0
        """Bytes of watch streams read, for the benchmark's steady-state figure."""
        self._watch_timeout_s = watch_timeout_s
        self._listeners: list[Listener[T]] = []
        self._reader = trio.CapacityLimiter(1)
        self._logged: str | None = None

    @property
    def items(self) -> dict[str, T]:
        return self.store.items

    def subscribe(self, listener: Listener[T]) -> Callable[[], None]:
        """Call `listener` with the changes of each list and watch read; returns the undo."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _tell(self, changes: list[Change[T]]) -> None:
        if changes:
            for listener in list(self._listeners):
                listener(changes)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        state = BackoffState()
        need_list = True
        while True:
            try:
                if need_list:
                    await self._list()
                    need_list = False
                    self._fine()
                if await self._watch():
                    state = BackoffState()
                    self._fine()
                    continue
                delay = next_delay(RETRY, state, random.random())
                record_failure(state)
            except KubeExpired as exc:
                # The version is too old to resume from: list again, at once.
                log.info(
                    "%s: %s; listing %s again",
                    self.label,
                    exc.message,
                    self.collection.describe(),
                    extra={"cache": self.collection.resource, "pool": self.label},
                )
                need_list = True
                continue
            except KubeError as exc:
                self._failed(exc)
                delay = next_delay(RETRY, state, random.random())
                record_failure(state)
            await trio.sleep(delay)

    def _fine(self) -> None:
        if self.error is not None:
            log.info(
                "%s: %s cache is back in step",
                self.label,
                self.collection.describe(),
                extra={"cache": self.collection.resource, "pool": self.label},
            )
        self.error = None
        self._logged = None

    def _failed(self, exc: KubeError) -> None:
        self.error = exc
        self.first_outcome.set()
        # Once per distinct failure, not once per retry.
        if exc.message != self._logged:
            self._logged = exc.message
            # The pools reading this cache report it in their passes' lines.
            log.debug(
                "cannot keep the %s cache: %s",
                self.collection.describe(),
                exc.message,
                extra={"cache": self.collection.resource, "pool": self.label},
            )

    async def _list_all(self, collection: Collection) -> tuple[dict[str, T], str]:
        items: dict[str, T] = {}
        token: str | None = None
        while True:
            page = await self.api.list_page(collection, self.facts, continue_token=token)
            items.update(page.items)
            token = page.continue_token
            if not token:
                return items, page.resource_version

    async def _list(self) -> None:
        items, version = await self._list_all(self.collection)
        self.lists += 1
        changes = self.store.replace(items, version)
        self.synced.set()
        self.first_outcome.set()
        self._tell(changes)

    async def fill(self, field_selector: str) -> None:
        """List the objects `field_selector` (added to the collection's) picks and merge
        those the store now keeps; see `Store.end_fill`."""
        narrower = self.collection.field_selector
        narrower = f"{narrower},{field_selector}" if narrower else field_selector
        self.store.begin_fill()
        items: dict[str, T] = {}
        try:
            items, _ = await self._list_all(attrs.evolve(self.collection, field_selector=narrower))
        finally:
            self._tell(self.store.end_fill(items))

    def drop(self, leaves: Callable[[T], bool]) -> None:
        self._tell(self.store.drop(leaves))

    async def _watch(self) -> bool:
        """One watch until the server ends it or its connection drops: True when it was a
        normal end (resume at once), False when it ended too soon to be one."""
        timeout_s = int(self._watch_timeout_s * (1 + random.random()))
        opened = trio.current_time()
        response = await self.api.watch(
            self.collection, self.store.resource_version, timeout_s=timeout_s
        )
        self.watches += 1
        self._fine()
        decoder: WatchDecoder[T] = WatchDecoder(self.facts, self.collection.describe())
        got_any = False

        def read() -> list[WatchEvent[T]] | None:
            data = response.read()
            if not data:
                return None
            self.bytes_read += len(data)
            return decoder.feed(data)

        try:
            while True:
                try:
                    events = await trio.to_thread.run_sync(
                        read, abandon_on_cancel=True, limiter=self._reader
                    )
                except KubeUnreachable:
                    events = None  # dropped: resume from the last version seen
                if events is None:
                    return got_any or trio.current_time() - opened >= QUICK_END_S
                got_any = True
                changes = [c for c in map(self.store.apply, events) if c is not None]
                self._fine()
                self._tell(changes)
        finally:
            response.shutdown()
            response.close()
