"""Which connections a listener takes: counts per source address and in total, and the limits
that bound what one connection may cost before it has sent a request.

Both listeners (the controlplane's public endpoint and a direct agent's) ask `Admissions.admit`
right after accept, before TLS: the cheapest moment to say no, since a refused connection costs
one accept and one close. The core is sans-IO, as `wire.http2` is: plain counters, time
passed in, tested without a socket. The listener carries the decision out (close, or serve and
`release` when done) and logs refusals through a `ReportThrottle`, so a flood of refused
connections is one line per source per minute, not a flood of lines.

What a connection may cost once admitted is bounded by the timeouts: `handshake_timeout_s` for
TLS, `first_request_timeout_s` from the end of the handshake to the first request's HEADERS,
and `idle_timeout_s` for a connection with no stream open and nothing heard from its peer (a
PING counts: a client keeping its connection alive keeps it). `Http2Connection` enforces the
last two.
"""

from __future__ import annotations

import ipaddress
import logging
import resource

import attrs

from wire.untrusted import clip

log = logging.getLogger("levers9.connections")

DEFAULT_IDLE_TIMEOUT_S = 300.0
"""Far above any keepalive PING interval (15 s by default), which keeps a connection alive."""

OPEN_FILES_RESERVE = 256
"""File descriptors besides the connections' own (logs, databases, clients, pipes)."""


@attrs.frozen
class ConnectionLimits:
    """How many connections a listener holds, and how long one may take to become useful.

    The defaults: a legitimate source holds few connections (the controlplane one pooled
    connection per direct worker, a worker one tunnel, two while it rolls over, a CLI one per
    command), so 256 per source is far above any of them, short of a NAT gateway in front of
    a couple of hundred unauthenticated connections (a worker's tunnel stops counting against its
    source once its token is checked: see `Admissions.vouch`), while one address cannot take more
    than 1/16 of the 4096 in total. An idle TLS + HTTP/2 connection costs some tens of
    kilobytes (90 KiB measured for both ends in one process), so 4096 of them stay within a
    few hundred MiB, and under the usual open files limit once it is raised to the hard limit
    at start.
    """

    max_per_source: int = 256
    max_total: int = 4096
    handshake_timeout_s: float = 10.0
    first_request_timeout_s: float = 10.0
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S
    """None: a connection with no stream open stays as long as its peer keeps it."""

    def __attrs_post_init__(self) -> None:
        for name in ("max_per_source", "max_total"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("handshake_timeout_s", "first_request_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a number of seconds above 0, not {value}")


@attrs.frozen
class Admission:
    """A connection taken: hand it back to `Admissions.release` when it closes."""

    source: str
    number: int


@attrs.frozen
class Refusal:
    """A connection refused: which limit it met (`max_per_source` or `max_total`)."""

    source: str
    limit: str
    max_connections: int


@attrs.frozen
class AdmissionStatistics:
    open_total: int
    sources: int
    refused_total: int


@attrs.define
class Admissions:
    """Open connections per source address and in total, against `ConnectionLimits`."""

    limits: ConnectionLimits
    _per_source: dict[str, int] = attrs.field(factory=dict, init=False)
    _live: set[int] = attrs.field(factory=set, init=False)
    _vouched: set[int] = attrs.field(factory=set, init=False)
    _next: int = attrs.field(default=0, init=False)
    _refused: int = attrs.field(default=0, init=False)

    def admit(self, source: str) -> Admission | Refusal:
        held = self._per_source.get(source, 0)
        if held >= self.limits.max_per_source:
            self._refused += 1
            return Refusal(source, "max_per_source", self.limits.max_per_source)
        if len(self._live) >= self.limits.max_total:
            self._refused += 1
            return Refusal(source, "max_total", self.limits.max_total)
        self._next += 1
        self._live.add(self._next)
        self._per_source[source] = held + 1
        return Admission(source, self._next)

    def release(self, admission: Admission) -> None:
        """Give the connection's place back; a second release of the same one does nothing."""
        if admission.number not in self._live:
            return
        self._live.remove(admission.number)
        if admission.number in self._vouched:
            self._vouched.remove(admission.number)
        else:
            self._drop_source(admission.source)

    def _drop_source(self, source: str) -> None:
        left = self._per_source[source] - 1
        if left:
            self._per_source[source] = left
        else:
            # No entry stays for a source with nothing open: the table is bounded by max_total.
            del self._per_source[source]

    def vouch(self, admission: Admission) -> None:
        """The connection proved who it is (a worker's tunnel with its token): it no longer
        counts against its source, only against the total. Workers behind one NAT gateway
        share an address; the per-source limit is for connections nobody vouched for."""
        if admission.number not in self._live or admission.number in self._vouched:
            return
        self._vouched.add(admission.number)
        self._drop_source(admission.source)

    def held_by(self, source: str) -> int:
        return self._per_source.get(source, 0)

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            open_total=len(self._live),
            sources=len(self._per_source),
            refused_total=self._refused,
        )


MANY_SOURCES = "many sources"
"""The key `ReportThrottle` counts under once it tracks as many keys as it may."""


@attrs.frozen
class Report:
    """Log now: `count` events for `key` since the last line about it (this one included)."""

    key: str
    count: int


@attrs.define
class ReportThrottle:
    """At most one report per key per `interval_s`; the events in between are counted into
    the next report. Keys are bounded: past `max_keys` (after forgetting those whose interval
    is over), new keys are counted together under `MANY_SOURCES`."""

    interval_s: float = 60.0
    max_keys: int = 1024
    _windows: dict[str, tuple[float, int]] = attrs.field(factory=dict, init=False)

    def note(self, key: str, now: float) -> Report | None:
        if key not in self._windows and len(self._windows) >= self.max_keys:
            self._forget_before(now - self.interval_s)
            if len(self._windows) >= self.max_keys:
                key = MANY_SOURCES
        reported_at, held = self._windows.get(key, (None, 0))
        if reported_at is not None and now - reported_at < self.interval_s:
            self._windows[key] = (reported_at, held + 1)
            return None
        self._windows[key] = (now, 0)
        return Report(key, held + 1)

    def _forget_before(self, cutoff: float) -> None:
        for key, (reported_at, _) in list(self._windows.items()):
            if reported_at <= cutoff:
                del self._windows[key]


@attrs.define
class ConnectionLog:
    """A listener's lines about connections that never got as far as a request (refused, TLS
    failed, silent), at most one per source per minute each: a flood of them is what these
    lines are about, and a line per connection would be a flood of its own."""

    fields: dict[str, object] = attrs.field(factory=dict)
    refusals: ReportThrottle = attrs.field(factory=ReportThrottle)
    failures: ReportThrottle = attrs.field(factory=ReportThrottle)

    def refused(self, refusal: Refusal, now: float) -> None:
        report = self.refusals.note(refusal.source, now)
        if report is None:
            return
        log.warning(
            "connections from %s refused: over %s (%d); %d refused since the last such line "
            "(one a minute at most)",
            report.key,
            refusal.limit,
            refusal.max_connections,
            report.count,
            extra={
                **self.fields,
                "peer": report.key,
                "limit": refusal.limit,
                "max_connections": refusal.max_connections,
                "refused": report.count,
            },
        )

    def failed(self, peer: str, source: str, reason: str, now: float) -> None:
        report = self.failures.note(source, now)
        if report is None:
            return
        reason = clip(reason)  # it may quote what the peer sent
        log.info(
            "connection from %s closed before any request: %s; %d from %s since the last such "
            "line (one a minute at most)",
            peer,
            reason,
            report.count,
            report.key,
            extra={**self.fields, "peer": peer, "reason": reason, "failed": report.count},
        )


def source_address(peername: object) -> str:
    """The address a connection comes from, as limits count it: the host of `getpeername()`,
    an IPv4-mapped IPv6 address as the IPv4 one. Pure."""
    if isinstance(peername, tuple) and peername and isinstance(peername[0], str):
        host = peername[0]
    elif isinstance(peername, str) and peername:
        return peername  # a unix socket's path
    else:
        return "unknown"
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


@attrs.frozen
class OpenFilesPlan:
    """What to do with RLIMIT_NOFILE at start: `soft` is the limit to set (None: keep it)."""

    soft: int | None
    enough: bool


def plan_open_files(soft: int, hard: int, max_total: int) -> OpenFilesPlan:
    """Raise the soft limit to the hard one; say whether that leaves room for `max_total`
    connections. Pure. (An unlimited hard limit cannot be the soft one on Linux, which caps
    it at fs.nr_open: 2^20 is asked for then.)"""
    target = (1 << 20) if hard == resource.RLIM_INFINITY else hard
    wanted = max_total + OPEN_FILES_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= target:
        return OpenFilesPlan(None, soft == resource.RLIM_INFINITY or soft >= wanted)
    return OpenFilesPlan(target, target >= wanted)


def raise_open_files_limit(max_total: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit, logging what was set and
    warning when it stays below what `max_total` connections need. Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    plan = plan_open_files(soft, hard, max_total)
    fields: dict[str, object] = {
        "open_files_before": soft,
        "open_files_hard": hard,
        "max_total": max_total,
    }
    target = plan.soft
    if target is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning(
                "cannot raise the open files limit from %d to %d: %s",
                soft,
                target,
                exc,
                extra={**fields, "reason": str(exc)},
            )
            plan = plan_open_files(soft, soft, max_total)
        else:
            log.info(
                "open files limit raised from %d to %d",
                soft,
                target,
                extra={**fields, "open_files": target},
            )
            soft = target
    if not plan.enough:
        log.warning(
            "the open files limit (%d) leaves no room for %d connections; raise the hard "
            "limit (ulimit -Hn) or lower the connection limit",
            soft,
            max_total,
            extra={**fields, "open_files": soft},
        )
    return soft


__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "MANY_SOURCES",
    "Admission",
    "AdmissionStatistics",
    "Admissions",
    "ConnectionLimits",
    "ConnectionLog",
    "OpenFilesPlan",
    "Refusal",
    "Report",
    "ReportThrottle",
    "plan_open_files",
    "raise_open_files_limit",
    "source_address",
]
