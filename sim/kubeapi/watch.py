"""Watch in the stand-in: the bounded history of changes every watch is served from, what one
watcher is sent of a change, and the lines of a watch stream.

A real apiserver serves watches from a window of recent changes (its watch cache over etcd's
history) and ends a watch that starts before that window with an ERROR event carrying a 410
Expired Status. The stand-in keeps one global window, the last `limit` changes of every
resource, under the store's lock. A watcher owns no queue, only a cursor (the newest
resourceVersion it has looked at), so memory is bounded by the window whatever the watchers do,
a slow client holds up only its own thread, and a watcher that falls out of the window gets the
same 410 a real one would. What a watcher is sent of a change is the cacher's rule: an object
that starts matching its selectors arrives as ADDED, one that stops matching as DELETED (its
previous state at the change's resourceVersion).

Watch faults (`WatchFaults`) are applied where a watcher takes its events, not by a task of
their own: every change records when it was stored, so a lagging watcher simply takes only the
changes old enough and sleeps until the next one is; its cursor stays at what it was sent, so a
lag costs no memory beyond the window either.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import socket
import time
from collections import deque

import attrs

from sim.kubeapi.model import Key, KubeError, Obj, Resource
from sim.kubeapi.selectors import FieldTerm, Requirement, selected

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"


def dump(obj: Obj) -> bytes:
    """The compact JSON the store keeps next to every object."""
    return json.dumps(obj, separators=(",", ":")).encode()


def at_version(obj: Obj, rv: int) -> Obj:
    """`obj` as a DELETED event carries it: its last state, at the deletion's resourceVersion."""
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(rv)}}


@attrs.frozen
class Event:
    """One watch event: `obj` and its JSON `raw` are what the event's `object` holds."""

    type: str
    obj: Obj
    raw: bytes

    def line(self) -> bytes:
        return b'{"type":"%s","object":%s}\n' % (self.type.encode(), self.raw)


@attrs.frozen
class WatchFaults:
    """How the stand-in's watches misbehave, as a loaded apiserver's or a proxy's do; set with
    `KubeStandin.set_watch_faults`, which applies them to open watches as well as new ones.
    The default misbehaves in no way."""

    lag_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    """Every watch event reaches watchers no sooner than lag_s after its change was stored (in
    order; a real apiserver's watch cache lags etcd under load). Bookmarks never name a
    resourceVersion past what that watcher was sent. Lists (and GETs) are NOT lagged: they read
    the current state, as a consistent read from etcd does."""
    end_at_once: bool = False
    """Every watch request is answered 200 (chunked, headers as now) and ended at once with no
    event at all, as a proxy or load balancer that ends every long request does. Also applies
    to open watches: they end (cleanly, with the final chunk) at their next wake-up."""
    stall: bool = False
    """Watches send nothing at all (no event, no bookmark) while set, but stay open, as a proxy
    buffering a stream does; when cleared, they go on (what was held back is sent, in order)."""


@attrs.frozen
class Change:
    """One stored change at `rv`: `obj` is the object after it (None once deleted), `prev` the
    object before it (None when created); `sent` and `raw` are what an unfiltered watcher gets."""

    rv: int
    plural: str
    key: Key
    obj: Obj | None
    prev: Obj | None
    sent: Obj
    raw: bytes
    at: float = attrs.field(factory=time.monotonic)
    """When it was stored (`time.monotonic()`): a lagging watch sends it `lag_s` later."""

    @property
    def type(self) -> str:
        return ADDED if self.prev is None else DELETED if self.obj is None else MODIFIED


def put_change(rv: int, plural: str, key: Key, obj: Obj, raw: bytes, prev: Obj | None) -> Change:
    """A create (`prev` None) or an update; `raw` is the stored JSON of `obj`."""
    return Change(rv, plural, key, obj, prev, obj, raw)


def delete_change(rv: int, plural: str, key: Key, prev: Obj) -> Change:
    gone = at_version(prev, rv)
    return Change(rv, plural, key, None, prev, gone, dump(gone))


class Expired(Exception):
    """A watch wants changes after `rv`, but those up to `compacted_rv` are no longer kept."""

    def __init__(self, rv: int, compacted_rv: int) -> None:
        super().__init__(f"too old resource version: {rv} ({compacted_rv})")
        self.rv = rv
        self.compacted_rv = compacted_rv

    def line(self) -> bytes:
        """The ERROR event a real apiserver ends such a watch with."""
        status = KubeError(410, "Expired", str(self)).status()
        return json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"


@attrs.define
class History:
    """The last `limit` changes, oldest first; every change up to `compacted_rv` is gone."""

    limit: int
    compacted_rv: int = 0
    _changes: deque[Change] = attrs.field(factory=deque)

    def __len__(self) -> int:
        return len(self._changes)

    def record(self, change: Change) -> None:
        self._changes.append(change)
        while len(self._changes) > self.limit:
            self.compacted_rv = self._changes.popleft().rv

    @property
    def newest_at(self) -> float:
        """When the newest change kept was stored (-inf when none is kept)."""
        return self._changes[-1].at if self._changes else -math.inf

    def since(self, rv: int) -> list[Change]:
        """The changes after `rv`, oldest first; `Expired` when some of them are gone."""
        if rv < self.compacted_rv:
            raise Expired(rv, self.compacted_rv)
        newer = list(itertools.takewhile(lambda c: c.rv > rv, reversed(self._changes)))
        newer.reverse()
        return newer

    def expire(self, rv: int) -> None:
        """Forgets every change up to `rv` (a compaction)."""
        while self._changes and self._changes[0].rv <= rv:
            self._changes.popleft()
        self.compacted_rv = max(self.compacted_rv, rv)


@attrs.frozen
class Selection:
    """What one watch asks for: a resource, a namespace ("" for all) and its selectors."""

    res: Resource
    namespace: str
    labels: tuple[Requirement, ...] = ()
    fields: tuple[FieldTerm, ...] = ()

    def matches(self, key: Key, obj: Obj) -> bool:
        if self.namespace and key[0] != self.namespace:
            return False
        return selected(obj, self.labels, self.fields)

    def event_of(self, change: Change) -> Event | None:
        """What this watcher is sent of `change`, if anything."""
        if change.plural != self.res.plural:
            return None
        now = change.obj is not None and self.matches(change.key, change.obj)
        was = change.prev is not None and self.matches(change.key, change.prev)
        if now:
            return Event(MODIFIED if was else ADDED, change.sent, change.raw)
        if not was:
            return None
        if change.obj is None:
            return Event(DELETED, change.sent, change.raw)
        assert change.prev is not None
        # It no longer matches: gone for this watcher, as it last matched, at this version.
        gone = at_version(change.prev, change.rv)
        return Event(DELETED, gone, dump(gone))


@attrs.define(eq=False)
class Watcher:
    """One open watch: its selection, its cursor (it has been sent everything up to that
    resourceVersion), the connection `drop_watches` cuts, and its `first` events (a snapshot
    of what matched when it opened) until they are sent; the state they show was stored by
    `first_at`, None once they are sent."""

    selection: Selection
    cursor: int
    sock: socket.socket | None
    dropped: bool = False
    first: list[Event] = attrs.field(factory=list)
    first_at: float | None = None

    def take(self, history: History, rv: int, stored_by: float) -> tuple[list[Event], float]:
        """What this watcher is sent now of the changes after its cursor that were stored by
        `stored_by` (a `time.monotonic()` instant; its first events ahead of them), with when
        the oldest change held back was stored (inf when none is). Advances the cursor past
        what it takes, or to `rv` (the store's version) when it holds nothing back. Raises
        `Expired` when the changes after its cursor are no longer kept."""
        events: list[Event] = []
        if self.first_at is not None:
            if self.first_at > stored_by:
                return events, self.first_at
            events, self.first, self.first_at = self.first, [], None
        changes = history.since(self.cursor)
        ready = bisect.bisect_right(changes, stored_by, key=lambda c: c.at)
        events += [e for c in changes[:ready] if (e := self.selection.event_of(c)) is not None]
        if ready == len(changes):
            self.cursor = rv
            return events, math.inf
        if ready:
            self.cursor = changes[ready - 1].rv
        return events, changes[ready].at


def bookmark_line(res: Resource, rv: int) -> bytes:
    """A BOOKMARK event: only the resourceVersion the watcher has seen everything up to."""
    meta = {"resourceVersion": str(rv)}
    obj = {"kind": res.kind, "apiVersion": res.api_version, "metadata": meta}
    return json.dumps({"type": "BOOKMARK", "object": obj}).encode() + b"\n"
