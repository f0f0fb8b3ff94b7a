"""Kubernetes Events about the worker Jobs levers9 creates and deletes.

Why: an operator who finds a worker Job appear or vanish asks the cluster, not the
controlplane's log, which they may not even read: `kubectl describe job` and `kubectl get
events` are where every controller (the Job controller, the scheduler, the kubelet) explains
what it did. levers9 writes its decisions there too ("created worker for 2 free cards on
node-1", "deleted: node is cordoned"), as an Event about the Job.

Design choices, after client-go's event recorder:
- `event_manifest` is pure: the core/v1 Event about a Job (its `involvedObject`, reason,
  message, type, both the legacy `source`/timestamps and the newer `eventTime`/`reporting*`
  fields the API requires once `eventTime` is set), named `<job>.<unix nanoseconds in hex>`.
- `EventRecorder` is the thin I/O. As client-go's correlator does, the same (Job uid, reason,
  message) recorded again within `correlate_window_s` of the last time PATCHes the Event it
  made (count + 1, lastTimestamp) instead of creating another one, so a Job that flaps shows
  as one line "(x12 over 1h)"; it remembers the last `cache_size` Events (an LRU). As
  client-go's spam filter does, a token bucket drops what comes beyond its burst.
- An Event is advisory: recording never fails a reconcile pass. A `KubeError` from the API (a
  Role without `events` permission, an API server that is down) is logged at debug and
  swallowed; only the first permission refusal per recorder is a warning, since it means
  `kubectl describe job` will stay silent until someone grants it.
"""

from __future__ import annotations

import collections
import logging
import re
import socket
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

import attrs

from control.kube.adapter import KubeAuthError, KubeError, KubeNotFound
from control.kube.ratelimit import TokenBucket
from wire.errors import ErrorCode

__all__ = [
    "COMPONENT",
    "NORMAL",
    "WARNING",
    "EventApi",
    "EventRecorder",
    "RecorderStatistics",
    "event_manifest",
    "event_name",
]

log = logging.getLogger("levers9.kube.events")

COMPONENT = "levers9"
"""`source.component` and `reportingComponent`: what `kubectl describe` shows under From."""
NORMAL, WARNING = "Normal", "Warning"
MAX_MESSAGE_CHARS = 1024
"""The API refuses a longer message on an Event with `eventTime`; longer ones are cut."""
MAX_INSTANCE_CHARS = 128
_REASON = re.compile(r"[A-Z][A-Za-z0-9]*\Z")


class EventApi(Protocol):
    """What the recorder needs of the cluster (`control.kube.adapter.KubeClient` has it)."""

    async def create_event(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    async def patch_event(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...


def event_name(job_name: str, unix_ns: int) -> str:
    """client-go's Event name: the object's name and the time in nanoseconds, in hex."""
    return f"{job_name}.{unix_ns:016x}"


def _seconds(now_s: float) -> str:
    """A metav1.Time (`firstTimestamp`, `lastTimestamp`): RFC 3339 in whole seconds, UTC."""
    return datetime.fromtimestamp(now_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micros(now_s: float) -> str:
    """A metav1.MicroTime (`eventTime`): RFC 3339 with six fractional digits, UTC."""
    return datetime.fromtimestamp(now_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _check(reason: str, type: str) -> None:
    if not _REASON.match(reason):
        raise ValueError(f"an Event's reason is one CamelCase word (Created), not {reason!r}")
    if type not in (NORMAL, WARNING):
        raise ValueError(f"an Event's type is {NORMAL!r} or {WARNING!r}, not {type!r}")


def _job_identity(job: Mapping[str, Any]) -> tuple[str, str, str]:
    """(namespace, name, uid) of a Job as the API returned it; uid "" when it has none."""
    meta = job.get("metadata") or {}
    name, namespace = meta.get("name"), meta.get("namespace")
    if not name or not namespace:
        raise ValueError("an Event needs the Job's metadata.name and metadata.namespace")
    return str(namespace), str(name), str(meta.get("uid") or "")


def event_manifest(
    job: Mapping[str, Any],
    reason: str,
    message: str,
    type: str = NORMAL,
    *,
    now_s: float,
    instance: str,
    name: str | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about `job` (the Job as the API returned it, or at least its
    metadata's name, namespace and uid) at wall-clock time `now_s`, reported by `instance`
    (which controlplane). `reason` is CamelCase, `type` Normal or Warning (ValueError
    otherwise); a message over 1024 characters is cut. `name` defaults to client-go's."""
    _check(reason, type)
    namespace, job_name, uid = _job_identity(job)
    meta = job.get("metadata") or {}
    involved = {"kind": "Job", "apiVersion": "batch/v1", "name": job_name, "namespace": namespace}
    if uid:
        involved["uid"] = uid
    if meta.get("resourceVersion"):
        involved["resourceVersion"] = str(meta["resourceVersion"])
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": name or event_name(job_name, int(now_s * 1e9)),
            "namespace": namespace,
        },
        "involvedObject": involved,
        "reason": reason,
        "message": message[:MAX_MESSAGE_CHARS],
        "type": type,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance[:MAX_INSTANCE_CHARS],
        # Required once eventTime is set; what was done is what the reason says.
        "action": reason,
        "firstTimestamp": _seconds(now_s),
        "lastTimestamp": _seconds(now_s),
        "eventTime": _micros(now_s),
        "count": 1,
    }


@attrs.frozen
class RecorderStatistics:
    """What a recorder did: Events created, patched (repeats counted), dropped by the spam
    filter, and writes that failed (swallowed)."""

    created: int
    patched: int
    dropped: int
    failed: int


@attrs.define
class _Recorded:
    namespace: str
    name: str
    count: int
    last_s: float


_Key = tuple[str, str, str]
"""(Job uid, or namespace/name without one; reason; message)."""


class EventRecorder:
    """Records Events about Jobs; `await record(job, reason, message, type)` never raises a
    `KubeError`. One per pool; `pool` names it in logs; `clock` is wall-clock seconds."""

    def __init__(
        self,
        api: EventApi,
        *,
        pool: str,
        instance: str | None = None,
        clock: Callable[[], float] = time.time,
        burst: int = 25,
        refill_every_s: float = 5.0,
        correlate_window_s: float = 600.0,
        cache_size: int = 4096,
    ) -> None:
        if burst < 1 or refill_every_s <= 0 or cache_size < 1:
            raise ValueError("burst and cache_size must be at least 1, refill_every_s above 0")
        self._api = api
        self._pool = pool
        self._instance = instance or socket.gethostname()
        self._clock = clock
        self._bucket = TokenBucket(rate=1.0 / refill_every_s, burst=burst)
        self._window_s = correlate_window_s
        self._cache_size = cache_size
        self._seen: collections.OrderedDict[_Key, _Recorded] = collections.OrderedDict()
        self._last_ns = 0
        self._warned = False
        self._created = self._patched = self._dropped = self._failed = 0

    def __repr__(self) -> str:
        return f"EventRecorder(pool={self._pool!r})"

    def statistics(self) -> RecorderStatistics:
        return RecorderStatistics(self._created, self._patched, self._dropped, self._failed)

    async def record(
        self, job: Mapping[str, Any], reason: str, message: str, type: str = NORMAL
    ) -> None:
        """An Event about `job`, or one more of the same on the Event made for it lately.
        ValueError for a reason or type the API would not take (a bug in the caller)."""
        _check(reason, type)
        namespace, job_name, uid = _job_identity(job)
        message = message[:MAX_MESSAGE_CHARS]
        fields = {"pool": self._pool, "namespace": namespace, "job": job_name, "reason": reason}
        now_s = self._clock()
        if not self._bucket.try_take(now_s):
            self._dropped += 1
            log.debug("event dropped: too many events from this pool lately", extra=fields)
            return
        key = (uid or f"{namespace}/{job_name}", reason, message)
        try:
            if await self._repeat(key, now_s):
                return
            # Unique per recorder even when the clock stands still (as a test's does).
            self._last_ns = max(int(now_s * 1e9), self._last_ns + 1)
            manifest = event_manifest(
                job,
                reason,
                message,
                type,
                now_s=now_s,
                instance=self._instance,
                name=event_name(job_name, self._last_ns),
            )
            await self._api.create_event(namespace, manifest)
        except KubeError as exc:
            self._failed += 1
            self._log_failure(exc, fields)
            return
        self._created += 1
        self._remember(key, _Recorded(namespace, manifest["metadata"]["name"], 1, now_s))

    async def _repeat(self, key: _Key, now_s: float) -> bool:
        """Counts one more on the Event recorded for `key` within the window; False when there
        is none (or it has gone: deleted, or expired after the API's Event TTL)."""
        seen = self._seen.get(key)
        if seen is None or now_s - seen.last_s >= self._window_s:
            return False
        patch = {"count": seen.count + 1, "lastTimestamp": _seconds(now_s)}
        try:
            await self._api.patch_event(seen.namespace, seen.name, patch)
        except KubeNotFound:
            del self._seen[key]
            return False
        seen.count += 1
        seen.last_s = now_s
        self._seen.move_to_end(key)
        self._patched += 1
        return True

    def _remember(self, key: _Key, recorded: _Recorded) -> None:
        self._seen[key] = recorded
        self._seen.move_to_end(key)
        while len(self._seen) > self._cache_size:
            self._seen.popitem(last=False)

    def _log_failure(self, exc: KubeError, fields: Mapping[str, str]) -> None:
        extra = {**fields, "error": str(exc)}
        denied = isinstance(exc, KubeAuthError) and exc.code is ErrorCode.PERMISSION_DENIED
        if denied and not self._warned:
            self._warned = True
            log.warning(
                "pool %s may not write Events in namespace %s; `kubectl describe job` will not "
                "show what levers9 did until its Role grants events create and patch",
                self._pool,
                fields["namespace"],
                extra=extra,
            )
            return
        log.debug("event not recorded: %s", exc, extra=extra)
