"""Which controlplane replica reconciles a pool: the holder of the pool's Lease.

With more than one controlplane replica, two reconcilers of one pool would each see a node's
free cards and each start a worker for them. So each pool is reconciled by exactly one replica
at a time: the holder of the Lease `levers9-pool-<pool>` (coordination.k8s.io/v1) in the
controlplane's own namespace, taken, renewed and handed over as client-go's leader election
does it, whose rules are what make it safe:

- A replica trusts only its own monotonic clock. A Lease held by another has expired when this
  replica has not seen it change for its `leaseDurationSeconds`; the remote `renewTime` is
  never compared with the local time, since the replicas' clocks differ.
- Every write is an update carrying the resourceVersion it was decided from (or a create when
  there is no Lease): of two replicas racing for a free Lease one wins and the other gets
  `KubeConflict` (or `KubeAlreadyExists`), never two leaders.
- A leader that could not renew for `renew_deadline_s` (less than the lease duration) stops
  leading at once, before the others may take over; a graceful stop releases the Lease (holder
  cleared, duration 1 s, client-go's ReleaseOnCancel) so the next replica takes over within a
  retry period instead of a lease duration.

The decisions (`LeaseRecord`, `observe`, `decide`) are pure and tested without sockets;
`LeaderElector` is the thin loop that reads and writes the Lease and runs the leader's work.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import random
import re
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

import attrs
import trio

from control.config import LeaderElectionSettings
from control.kube.adapter import KubeAlreadyExists, KubeConflict, KubeError
from control.kube.pools import PoolConfig, own_cluster_pool

__all__ = [
    "Decision",
    "ElectionSettings",
    "LeaderElector",
    "LeaseApi",
    "LeaseRecord",
    "Observation",
    "Verdict",
    "decide",
    "default_identity",
    "election_settings",
    "format_micro_time",
    "lease_cluster",
    "lease_name",
    "observe",
    "parse_micro_time",
]

log = logging.getLogger("levers9.lease")

RELEASE_S = 5.0
"""How long a stopping leader tries to release its Lease (shielded) before it gives up; the
others then take over once the Lease expires."""
LEASE_API_VERSION = "coordination.k8s.io/v1"
_MAX_NAME = 63
_NOT_DNS = re.compile(r"[^a-z0-9-]+")


# --- the record, pure ------------------------------------------------------------------------


def format_micro_time(when: datetime) -> str:
    """A MicroTime as the apiserver takes it: RFC 3339 in UTC with exactly six fractional digits
    (Python's `isoformat` drops them on a whole second, which the apiserver refuses)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(text: object) -> datetime | None:
    """A Lease's time, or None when it is missing or not RFC 3339."""
    if not isinstance(text, str) or not text:
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@attrs.frozen
class LeaseRecord:
    """What a Lease's spec says about its holder; `holder` None (or "") is a free Lease."""

    holder: str | None = None
    lease_duration_s: int = 0
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0

    @classmethod
    def of_lease(cls, lease: Mapping[str, Any]) -> LeaseRecord:
        """The record of a Lease object as the API returns it (any field may be missing: another
        program may have written it)."""
        spec = lease.get("spec")
        spec = spec if isinstance(spec, Mapping) else {}
        holder = spec.get("holderIdentity")
        return cls(
            holder=holder if isinstance(holder, str) and holder else None,
            lease_duration_s=_int(spec.get("leaseDurationSeconds")),
            acquire_time=parse_micro_time(spec.get("acquireTime")),
            renew_time=parse_micro_time(spec.get("renewTime")),
            transitions=_int(spec.get("leaseTransitions")),
        )

    def spec(self) -> dict[str, Any]:
        """The Lease's spec fields this record sets (a released Lease's holder is "", as
        client-go writes it)."""
        spec: dict[str, Any] = {
            "holderIdentity": self.holder or "",
            "leaseDurationSeconds": self.lease_duration_s,
            "leaseTransitions": self.transitions,
        }
        if self.acquire_time is not None:
            spec["acquireTime"] = format_micro_time(self.acquire_time)
        if self.renew_time is not None:
            spec["renewTime"] = format_micro_time(self.renew_time)
        return spec


@attrs.frozen
class Observation:
    """The Lease as this replica last read or wrote it, and when (this replica's monotonic
    clock, seconds) it last saw the record change."""

    record: LeaseRecord
    resource_version: str
    changed_at: float


def observe(
    previous: Observation | None, record: LeaseRecord, resource_version: str, now: float
) -> Observation:
    """What this replica knows after reading `record` at `now`: a record unchanged since the
    previous read keeps the time it was first seen, so a holder that stopped renewing expires
    a lease duration after its last renewal was seen, whatever the clocks say."""
    if previous is not None and previous.record == record:
        return attrs.evolve(previous, resource_version=resource_version)
    return Observation(record, resource_version, now)


class Verdict(enum.Enum):
    ACQUIRE = "acquire"
    """The Lease is absent, free or expired: take it (create when absent, else update)."""
    RENEW = "renew"
    """The Lease is ours: renew it."""
    WAIT = "wait"
    """Another replica holds the Lease and it has not expired."""


@attrs.frozen
class Decision:
    verdict: Verdict
    record: LeaseRecord | None = None
    """The record to write; None when waiting."""


def expired(observed: Observation, now: float, lease_duration_s: int) -> bool:
    """Whether the Lease has gone unchanged, as this replica saw it, for its duration (the
    record's, or `lease_duration_s` when it names none)."""
    duration = observed.record.lease_duration_s or lease_duration_s
    return now >= observed.changed_at + duration


def decide(
    observed: Observation | None,
    identity: str,
    now: float,
    wall: datetime,
    lease_duration_s: int,
) -> Decision:
    """Acquire, renew or wait, from the Lease as last observed (None: there is none), by the
    replica `identity`, at monotonic `now`; `wall` is only written into the record (its times
    are for people and for other tools, never for this decision)."""
    if observed is None:
        return Decision(Verdict.ACQUIRE, LeaseRecord(identity, lease_duration_s, wall, wall, 0))
    record = observed.record
    if record.holder == identity:
        renewed = attrs.evolve(record, lease_duration_s=lease_duration_s, renew_time=wall)
        return Decision(Verdict.RENEW, renewed)
    if record.holder and not expired(observed, now, lease_duration_s):
        return Decision(Verdict.WAIT)
    taken = LeaseRecord(identity, lease_duration_s, wall, wall, record.transitions + 1)
    return Decision(Verdict.ACQUIRE, taken)


def released(observed: Observation, wall: datetime) -> LeaseRecord:
    """The record a leader writes when it lets go (client-go's ReleaseOnCancel): no holder,
    a one-second duration, the transitions kept."""
    return LeaseRecord(None, 1, wall, wall, observed.record.transitions)


def lease_name(pool: str) -> str:
    """`levers9-pool-<pool>`, kept a DNS label (at most 63 characters, so it also fits a label
    value): anything else is made one, with a hash of the pool's name so two never meet."""
    name = f"levers9-pool-{pool}"
    if len(name) <= _MAX_NAME and _NOT_DNS.search(name) is None:
        return name
    digest = hashlib.sha256(pool.encode()).hexdigest()[:10]
    safe = _NOT_DNS.sub("-", name.lower())[: _MAX_NAME - len(digest) - 1].strip("-")
    return f"{safe}-{digest}"


def default_identity() -> str:
    """This replica's name in the Leases: the pod's name (HOSTNAME) and a short random suffix,
    so a restarted pod of the same name is never taken for its predecessor."""
    host = os.environ.get("HOSTNAME") or socket.gethostname() or "levers9-control"
    return f"{host}_{secrets.token_hex(3)}"


# --- the loop ------------------------------------------------------------------------------


@attrs.frozen
class ElectionSettings:
    """One Lease's election: who we are, where the Lease is, and client-go's timings (its
    defaults: 15 s, 10 s, 2 s; `jitter` as its JitterFactor, the wait between tries being the
    retry period times 1 to 1 + jitter)."""

    identity: str
    namespace: str
    lease_name: str
    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    jitter: float = 1.2

    def __attrs_post_init__(self) -> None:
        if not self.identity:
            raise ValueError("identity must not be empty")
        if not self.lease_duration_s >= 1:
            raise ValueError(f"lease_duration_s must be 1 or more, not {self.lease_duration_s}")
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "need 0 < retry_period_s < renew_deadline_s < lease_duration_s, not "
                f"{self.retry_period_s} < {self.renew_deadline_s} < {self.lease_duration_s}"
            )
        if self.jitter < 0:
            raise ValueError(f"jitter must be 0 or more, not {self.jitter}")


def election_settings(
    settings: LeaderElectionSettings, *, pool: str, identity: str, namespace: str
) -> ElectionSettings:
    """The election of one pool's Lease under `config.leaderElection`."""
    return ElectionSettings(
        identity=identity,
        namespace=namespace,
        lease_name=lease_name(pool),
        lease_duration_s=int(settings.lease_duration_s),
        renew_deadline_s=settings.renew_deadline_s,
        retry_period_s=settings.retry_period_s,
    )


def lease_cluster(settings: LeaderElectionSettings, *, pool: str) -> tuple[PoolConfig, str]:
    """How to reach the controlplane's own cluster (its pod's ServiceAccount, as
    `control.kube.joined.own_cluster`), and the namespace of the Leases. Raises `ConfigError`
    outside a pod; a test makes the process look like a pod (`sim.cluster.controlplane_pod`)."""
    # Named after the pool, so the client's errors say whose Lease could not be kept.
    return own_cluster_pool(pool, settings.namespace, "config.leaderElection")


class LeaseApi(Protocol):
    """What an election needs from the cluster (`KubeClient` has it)."""

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def create_lease(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    async def replace_lease(
        self, namespace: str, manifest: Mapping[str, Any]
    ) -> dict[str, Any]: ...


class _Outcome(enum.Enum):
    HELD = "held"
    """The Lease is ours now (taken or renewed)."""
    OTHERS = "others"
    """Someone else holds it, or took it meanwhile."""
    FAILED = "failed"
    """The API refused or did not answer, or another write came first: try again."""


def _utc_now() -> datetime:
    return datetime.now(UTC)


class LeaderElector:
    """Keeps trying to hold one Lease and runs the leader's work while it does.

    `is_leader` says whether this replica leads now, `holder` who held the Lease when it was
    last read (None: free, or unknown since a renewal failed)."""

    def __init__(
        self,
        api: LeaseApi,
        settings: ElectionSettings,
        *,
        pool: str,
        wall_clock: Callable[[], datetime] = _utc_now,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.is_leader = False
        self.holder: str | None = None
        self._api = api
        self._wall = wall_clock
        self._rand = rand
        self._observed: Observation | None = None
        self._lease: dict[str, Any] | None = None
        self._renewed_at = 0.0
        self._logged_error: str | None = None
        self._logged_holder: tuple[str | None] | None = None
        """The holder last logged, boxed (None before the first)."""

    def __repr__(self) -> str:
        s = self.settings
        return f"LeaderElector(pool={self.pool!r}, lease={s.namespace}/{s.lease_name})"

    async def run(self, lead: Callable[[], Awaitable[None]]) -> None:
        """Forever: take the Lease (a try every retry period), run `lead()` while it is held,
        renewing it every retry period; when no renewal went through for the renew deadline,
        or another replica holds it, cancel `lead()` at once and try again. Cancelled, it
        releases the Lease (shielded, at most `RELEASE_S`). If `lead()` returns, the Lease is
        released and `run` returns."""
        try:
            while True:
                await self._acquire()
                if await self._lead(lead):
                    return
        finally:
            self.is_leader = False
            with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_S):
                await self._release()

    # -- taking and keeping the Lease --------------------------------------------------------

    async def _acquire(self) -> None:
        while await self._try(leading=False) is not _Outcome.HELD:
            period = self.settings.retry_period_s
            await trio.sleep(period * (1.0 + self._rand() * self.settings.jitter))

    async def _lead(self, lead: Callable[[], Awaitable[None]]) -> bool:
        """Runs `lead()` until it returns (True) or the Lease is lost (False)."""
        self.is_leader = True
        returned = False
        async with trio.open_nursery() as nursery:

            async def leading() -> None:
                nonlocal returned
                await lead()
                returned = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(leading)
            why = await self._keep_renewing()
            # At once: the others may take the Lease once it expires.
            nursery.cancel_scope.cancel()
        self.is_leader = False
        if not returned:
            if why is not None:
                self._holder_is(None, why)
            return False
        return True

    async def _keep_renewing(self) -> str | None:
        """Renews every retry period until it cannot; why it stopped (None when another
        replica was seen holding the Lease: that change is logged already)."""
        s = self.settings
        while True:
            with trio.move_on_at(self._renewed_at + s.renew_deadline_s):
                while True:
                    await trio.sleep(s.retry_period_s)
                    outcome = await self._try(leading=True)
                    if outcome is _Outcome.HELD:
                        break
                    if outcome is _Outcome.OTHERS:
                        return None
                continue
            return f"no renewal of its Lease went through for {s.renew_deadline_s:g} s"

    async def _try(self, *, leading: bool) -> _Outcome:
        """One read, decision and write (client-go's tryAcquireOrRenew)."""
        s = self.settings
        started = trio.current_time()
        try:
            lease = await self._api.read_lease(s.namespace, s.lease_name)
            if lease is not None:
                # Seen when the answer came, not when the read began: never earlier than the
                # holder's write, so it expires no sooner than a lease duration after it.
                self._saw(lease, trio.current_time(), written=False)
            decision = decide(
                self._observed if lease is not None else None,
                s.identity,
                trio.current_time(),
                self._wall(),
                s.lease_duration_s,
            )
            if decision.verdict is Verdict.WAIT or (
                leading and decision.verdict is not Verdict.RENEW
            ):
                return _Outcome.OTHERS
            assert decision.record is not None
            if lease is None:
                manifest = {
                    "apiVersion": LEASE_API_VERSION,
                    "kind": "Lease",
                    "metadata": {
                        "name": s.lease_name,
                        "namespace": s.namespace,
                        "labels": {"app.kubernetes.io/managed-by": "levers9"},
                    },
                    "spec": decision.record.spec(),
                }
                written = await self._api.create_lease(s.namespace, manifest)
            else:
                # The object as read, its resourceVersion included: an update that lost a race
                # is a conflict, not a second leader.
                spec = {**(lease.get("spec") or {}), **decision.record.spec()}
                written = await self._api.replace_lease(s.namespace, {**lease, "spec": spec})
        except (KubeConflict, KubeAlreadyExists) as exc:
            log.debug(
                "pool %s: lost a race for lease %s: %s",
                self.pool,
                s.lease_name,
                exc.message,
                extra=self._fields(),
            )
            return _Outcome.FAILED
        except KubeError as exc:
            if exc.message != self._logged_error:
                self._logged_error = exc.message
                log.warning(
                    "pool %s: cannot keep lease %s: %s",
                    self.pool,
                    s.lease_name,
                    exc.message,
                    extra={**self._fields(), "error": exc.code.name},
                )
            return _Outcome.FAILED
        if self._logged_error is not None:
            self._logged_error = None
            log.info(
                "pool %s: lease %s is kept again", self.pool, s.lease_name, extra=self._fields()
            )
        self._saw(written, trio.current_time(), written=True)
        # From before the read: the renew deadline runs out no later than it would for others.
        self._renewed_at = started
        return _Outcome.HELD

    def _saw(self, lease: Mapping[str, Any], now: float, *, written: bool) -> None:
        record = LeaseRecord.of_lease(lease)
        version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
        self._observed = observe(self._observed, record, version, now)
        self._lease = dict(lease)
        # A Lease read naming us while we do not lead (ours from before a failed renewal) says
        # nothing yet: the write that follows does.
        if written or record.holder != self.settings.identity or self.is_leader:
            self._holder_is(record.holder, None)

    async def _release(self) -> None:
        observed, lease = self._observed, self._lease
        s = self.settings
        if observed is None or lease is None or observed.record.holder != s.identity:
            return
        record = released(observed, self._wall())
        spec = {**(lease.get("spec") or {}), **record.spec()}
        try:
            written = await self._api.replace_lease(s.namespace, {**lease, "spec": spec})
        except KubeError as exc:
            log.info(
                "pool %s: could not release lease %s; another replica takes over once it "
                "expires: %s",
                self.pool,
                s.lease_name,
                exc.message,
                extra=self._fields(),
            )
            return
        self._saw(written, trio.current_time(), written=True)

    # -- what changed, for people -------------------------------------------------------------

    def _fields(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "holder": self.holder or "",
            "identity": self.settings.identity,
            "lease": self.settings.lease_name,
        }

    def _holder_is(self, holder: str | None, why: str | None) -> None:
        """Notes who holds the Lease (None: free, or unknown when `why` says we stopped);
        logs each change of leadership once."""
        if self._logged_holder == (holder,):
            return
        was_ours = self._logged_holder == (self.settings.identity,)
        self._logged_holder = (holder,)
        self.holder = holder
        if why is not None:
            message = f"pool {self.pool}: this replica stops reconciling it: {why}"
        elif holder == self.settings.identity:
            message = f"pool {self.pool}: this replica ({holder}) leads and reconciles it"
        elif holder is not None:
            message = f"pool {self.pool}: replica {holder} leads and reconciles it"
        elif was_ours:
            message = f"pool {self.pool}: this replica let go of it; its lease is free"
        else:
            message = f"pool {self.pool}: no replica leads it; its lease is free"
        log.info(message, extra=self._fields())
