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

A watch that never streams must not leave its cache silently stale. A proxy or load balancer
that ends each long request at once, or one that holds the stream back, looks like a watch that
ends or waits normally, and the cache would never learn of a new object. The API server sends
a BOOKMARK about every `bookmark_period_s` (a minute), so a watch hears something (an event or
a bookmark) at least that often; `WatchHealth` decides from what was heard, with the time
passed in:

- a watch that hears nothing for `SILENT_PERIODS` (2) bookmark periods is ended and the cache
  lists again (reason `silent`): a stale cache is found within two periods;
- `EMPTY_WATCHES_TO_RELIST` (3) watches in a row that end at once with nothing in them (each a
  failure, backed off as before) list again (reason `empty_watches`) without waiting;
- listed again for either cause `STALE_RELISTS_TO_UNUSABLE` (2) times with no watch having
  streamed in between, the cache is unusable: `error` says why and what to check, and the
  pools reading it write nothing. Only a watch that streams clears it (not a list, not a
  watch merely opened); meanwhile the informer goes on listing and watching, its retries
  backed off up to `RETRY`'s cap, so it recovers by itself once the proxy is fixed.

Lists made again (`expired` for a 410 as well) and caches turning unusable are counted on the
informer and told to `on_event` (the controlplane's metrics).

The decoding of a watch stream, the store and `WatchHealth` are sans-IO (`WatchDecoder`,
`Store`) and tested without sockets; `Informer.run` is the thin loop around them. A watch's
bytes are read in a worker thread of the informer's own (a blocked read holds no thread the API
calls need, and one informer has one reader thread at most); a read that waits is ended by
shutting the connection down, when the informer stops or when the watch has been silent too
long.

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

from control.kube.adapter import (
    Collection,
    KubeError,
    KubeExpired,
    KubeUnreachable,
    Page,
    WatchResponse,
    object_key,
)
from wire.backoff import Backoff, BackoffState, next_delay, record_failure
from wire.errors import ErrorCode

__all__ = [
    "BOOKMARK_PERIOD_S",
    "RELIST_REASONS",
    "CacheApi",
    "CacheEvent",
    "Change",
    "Informer",
    "Store",
    "Verdict",
    "WatchDecoder",
    "WatchEvent",
    "WatchHealth",
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
BOOKMARK_PERIOD_S = 60.0
"""How often the API server sends a BOOKMARK on a watch that asked for them (about once a
minute); a watch quiet for much longer is not streaming."""
SILENT_PERIODS = 2
"""A watch that hears no event and no bookmark for this many bookmark periods is ended, and
its cache lists again."""
EMPTY_WATCHES_TO_RELIST = 3
"""Watches in a row that end at once with nothing in them before the cache lists again."""
STALE_RELISTS_TO_UNUSABLE = 2
"""Lists made again for staleness, with no watch streaming in between, that make a cache
unusable."""
EXPIRED, SILENT, EMPTY_WATCHES = "expired", "silent", "empty_watches"
RELIST_REASONS = (EXPIRED, SILENT, EMPTY_WATCHES)
"""Why a cache lists again: a 410 Gone, a watch silent too long, watches ending at once empty."""
UNUSABLE = "unusable"
PROXY_ADVICE = (
    "a proxy or load balancer in front of the API server may end long requests; "
    "let watches through for at least 10 minutes"
)


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


@attrs.frozen
class Verdict:
    """What the end of one watch calls for (`WatchHealth.ended`, `WatchHealth.silent`)."""

    relist: str | None = None
    """List again before the next watch, and why (`SILENT`, `EMPTY_WATCHES`); None: resume
    from the last version seen."""
    back_off: bool = False
    """The watch failed (it ended at once, empty): wait out `RETRY` before the next call."""
    reset_backoff: bool = False
    """Start `RETRY`'s delays afresh (after this verdict's own wait)."""
    seen: str = ""
    """What was seen, for the warning and the error (when `relist` is set)."""
    warn: bool = False
    """The first list made again for staleness since a watch last streamed: warn, once."""
    unusable: bool = False
    """The cache became unusable with this verdict."""


@attrs.define
class WatchHealth:
    """Whether a cache's watches stream, decided from what they hear and when (the time is
    passed in; no clock, no I/O). The informer tells it each watch's opening (`opened`), each
    event or bookmark (`heard`) and its end (`ended`), or that it was cut after `deadline`
    (`silent`), and carries out the `Verdict`."""

    bookmark_period_s: float = BOOKMARK_PERIOD_S
    unusable: bool = False
    """Listed again for staleness `STALE_RELISTS_TO_UNUSABLE` times with no watch having
    streamed since: what the cache holds cannot be trusted."""
    stale_relists: int = 0
    """Lists made again for staleness since a watch last streamed."""
    empty_in_row: int = 0
    """Watches in a row that ended at once with nothing in them."""
    quiet_since: float | None = None
    """When a watch last streamed (before any did: when the first one opened)."""
    _since: float = 0.0
    """When the open watch opened or last heard something: its silence counts from there."""

    def opened(self, now: float) -> None:
        self._since = now
        if self.quiet_since is None:
            self.quiet_since = now

    def deadline(self) -> float:
        """When the open watch has been silent too long, unless it hears something first."""
        return self._since + SILENT_PERIODS * self.bookmark_period_s

    def heard(self, now: float) -> bool:
        """An event or a bookmark came: the watch streams, whatever was before. True when that
        ends the cache's being unusable."""
        recovered = self.unusable
        self._since = self.quiet_since = now
        self.unusable = False
        self.stale_relists = self.empty_in_row = 0
        return recovered

    def ended(self, now: float, *, heard: bool) -> Verdict:
        """The server ended the open watch, or its connection dropped."""
        if heard:
            return Verdict(reset_backoff=True)
        if now - self._since >= QUICK_END_S:
            # A server's normal end of a watch of a quiet collection, or a dropped connection:
            # the next watch resumes from the last version seen, as before.
            self.empty_in_row = 0
            return Verdict(reset_backoff=True)
        self.empty_in_row += 1
        if self.empty_in_row % EMPTY_WATCHES_TO_RELIST:
            return Verdict(back_off=True)
        seen = f"every watch ended at once with nothing in it, {self.empty_in_row} in a row"
        return self._relist(EMPTY_WATCHES, seen, back_off=True)

    def silent(self, now: float) -> Verdict:
        """The open watch heard nothing until `deadline`; the caller ended it."""
        self.empty_in_row = 0
        quiet_s = now - (now if self.quiet_since is None else self.quiet_since)
        return self._relist(SILENT, f"no event or bookmark for {quiet_s:.0f} s", back_off=False)

    def _relist(self, reason: str, seen: str, *, back_off: bool) -> Verdict:
        self.stale_relists += 1
        became = not self.unusable and self.stale_relists >= STALE_RELISTS_TO_UNUSABLE
        self.unusable = self.unusable or became
        return Verdict(
            relist=reason,
            back_off=back_off,
            # Found soon while it is usable; once it is not, its lists and watches slow down
            # to RETRY's cap (a full list is costly).
            reset_backoff=not self.unusable,
            seen=seen,
            warn=self.stale_relists == 1,
            unusable=became,
        )


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
CacheEvent = Callable[[str, str], None]
"""Told (the cache's resource plural, what happened): one of `RELIST_REASONS` when it listed
again, `UNUSABLE` when it became unusable."""


class Informer(Generic[T]):
    """One collection's cache; `run` in a nursery keeps it. `synced` is set after the first
    list; `error` is what keeps it from the server now (None while it is fine): the last call's
    failure, else its being unusable (see the module's docstring)."""

    def __init__(
        self,
        api: CacheApi,
        collection: Collection,
        facts: Callable[[dict[str, Any]], T | None],
        *,
        label: str,
        keep: Callable[[T], bool] | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        bookmark_period_s: float = BOOKMARK_PERIOD_S,
        on_event: CacheEvent | None = None,
    ) -> None:
        self.api = api
        self.collection = collection
        self.facts = facts
        self.label = label
        self.store: Store[T] = Store(keep=keep)
        self.synced = trio.Event()
        self.first_outcome = trio.Event()
        """Set by the first list's outcome: listed (`synced`) or failed (`error`)."""
        self.lists = 0
        """Full lists made (the first, and one per list made again)."""
        self.relists = dict.fromkeys(RELIST_REASONS, 0)
        """Lists made again, by reason."""
        self.unusable_count = 0
        """How many times the cache became unusable."""
        self.watches = 0
        self.bytes_read = 0
        """Bytes of watch streams read, for the benchmark's steady-state figure."""
        self.health = WatchHealth(bookmark_period_s)
        self.on_event = on_event
        self._watch_timeout_s = watch_timeout_s
        self._listeners: list[Listener[T]] = []
        self._reader = trio.CapacityLimiter(1)
        self._logged: str | None = None
        self._failure: KubeError | None = None
        self._unusable: KubeError | None = None

    @property
    def error(self) -> KubeError | None:
        return self._failure if self._failure is not None else self._unusable

    @property
    def stale_relists(self) -> int:
        """Lists made again because watches did not stream (silent or ended at once, empty)."""
        return self.relists[SILENT] + self.relists[EMPTY_WATCHES]

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
            delay = 0.0
            try:
                if need_list:
                    await self._list()
                    need_list = False
                    self._fine()
                verdict = await self._watch()
            except KubeExpired as exc:
                # The version is too old to resume from: list again, at once.
                log.info(
                    "%s: %s; listing %s again",
                    self.label,
                    exc.message,
                    self.collection.describe(),
                    extra={"cache": self.collection.resource, "pool": self.label},
                )
                if not need_list:  # not a list's own continue token
                    self._relisted(EXPIRED)
                need_list = True
                continue
            except KubeError as exc:
                self._failed(exc)
                delay = next_delay(RETRY, state, random.random())
                record_failure(state)
            else:
                if verdict.relist is not None:
                    self._stale(verdict)
                    need_list = True
                if verdict.back_off:
                    delay = next_delay(RETRY, state, random.random())
                    record_failure(state)
                if verdict.reset_backoff:
                    state = BackoffState()
            if delay:
                await trio.sleep(delay)

    def _fine(self, *, streamed: bool = False) -> None:
        """A call went through: its failure is over. Only a watch that `streamed` (an event
        or a bookmark) ends the cache's being unusable."""
        was = self.error
        self._failure = None
        self._logged = None
        if streamed and self.health.heard(trio.current_time()):
            self._unusable = None
        if was is not None and self.error is None:
            log.info(
                "%s: %s cache is back in step",
                self.label,
                self.collection.describe(),
                extra={"cache": self.collection.resource, "pool": self.label},
            )

    def _failed(self, exc: KubeError) -> None:
        self._failure = exc
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

    def _relisted(self, reason: str) -> None:
        self.relists[reason] += 1
        if self.on_event is not None:
            self.on_event(self.collection.resource, reason)

    def _stale(self, verdict: Verdict) -> None:
        """The watches do not stream: list again, warn once, and past the bound refuse."""
        assert verdict.relist is not None
        self._relisted(verdict.relist)
        what = self.collection.describe()
        fields = {"cache": self.collection.resource, "pool": self.label, "reason": verdict.relist}
        if verdict.warn:
            log.warning(
                "%s: the %s cache is not kept by its watch (%s); listing it again; %s",
                self.label,
                what,
                verdict.seen,
                PROXY_ADVICE,
                extra=fields,
            )
        if verdict.unusable:
            self.unusable_count += 1
            self._unusable = KubeError(
                ErrorCode.UNAVAILABLE,
                f"pool {self.label}: the {what} cache is out of step, its watches do not "
                f"stream ({verdict.seen}); {PROXY_ADVICE}",
            )
            if self.on_event is not None:
                self.on_event(self.collection.resource, UNUSABLE)
            # The pools reading this cache report it in their passes' lines.
            log.debug("%s", self._unusable.message, extra=fields)

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

    async def _watch(self) -> Verdict:
        """One watch until the server ends it, its connection drops or it has been silent
        too long; what that calls for."""
        timeout_s = int(self._watch_timeout_s * (1 + random.random()))
        response = await self.api.watch(
            self.collection, self.store.resource_version, timeout_s=timeout_s
        )
        self.watches += 1
        self.health.opened(trio.current_time())
        self._fine()
        decoder: WatchDecoder[T] = WatchDecoder(self.facts, self.collection.describe())
        heard = False

        def read() -> list[WatchEvent[T]] | None:
            data = response.read()
            if not data:
                return None
            self.bytes_read += len(data)
            return decoder.feed(data)

        try:
            while True:
                events: list[WatchEvent[T]] | None = None
                # A read that waits past the deadline is abandoned; shutting the connection
                # down (below) ends its thread, so the next watch's read can have the one.
                with trio.move_on_at(self.health.deadline()) as bound:
                    try:
                        events = await trio.to_thread.run_sync(
                            read, abandon_on_cancel=True, limiter=self._reader
                        )
                    except KubeUnreachable:
                        events = None  # dropped: resume from the last version seen
                if bound.cancelled_caught:
                    return self.health.silent(trio.current_time())
                if events is None:
                    return self.health.ended(trio.current_time(), heard=heard)
                if events:
                    heard = True
                    self._fine(streamed=True)
                changes = [c for c in map(self.store.apply, events) if c is not None]
                self._tell(changes)
        finally:
            response.shutdown()
            response.close()
