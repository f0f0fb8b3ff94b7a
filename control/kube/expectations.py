"""What a pool's reconciler wrote and its caches have not shown yet: controller expectations.

Why this module exists: a pass plans from list + watch caches, and a busy API server delivers
watch events a second or more after the write they report. A pass that runs in that gap does not
see the worker Job the previous pass created, finds the node without a worker, and creates the
next generation: two workers on one node. client-go's controllers (the ReplicaSet and Job
controllers) keep *expectations* for this: the creates and deletes a controller issued are
remembered per key, and the key is not planned again until the cache has observed each of them,
or until a timeout says the observation was lost.

Here the key is the node (one worker per node is the invariant), and what is expected is an
object by name: a Job or its token Secret created (observed once the cache holds it), or a Job
deleted (observed once the cache no longer holds it as active). `Expectations` is pure: times
are passed in, observations are the caches' current names, and the loop (`control.kube.loop`)
holds back every action on a node that `unsettled` names.

An expectation that is never observed (the event was lost, or the object was removed by someone
else before the cache saw it) lapses after `timeout_s` (client-go uses five minutes): the key is
planned again from what the caches say then, and the lapse is reported so that it is logged.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping

import attrs

__all__ = ["EXPECTATION_TIMEOUT_S", "Expectation", "Expectations", "Expecting"]

EXPECTATION_TIMEOUT_S = 300.0
"""How long a write may stay unobserved before its key is planned again (client-go's
`ExpectationsTimeout`)."""


class Expecting(enum.Enum):
    JOB_CREATED = "job created"
    SECRET_CREATED = "secret created"
    JOB_DELETED = "job deleted"


@attrs.frozen
class Expectation:
    """One write not observed yet: on `node`, `kind` of the object `name`, issued at `since`
    (the caller's monotonic clock). A Job create also keeps its generation and wall-clock
    creation time, so the pass can count the Job before the cache shows it."""

    node: str
    kind: Expecting
    name: str
    since: float
    generation: int = 0
    created_at: float = 0.0

    def describe(self) -> str:
        what = "Job" if self.kind is not Expecting.SECRET_CREATED else "Secret"
        verb = "deleted" if self.kind is Expecting.JOB_DELETED else "created"
        return f"{what} {self.name} {verb}"


@attrs.define
class Expectations:
    """The writes of one pool's reconciler that its caches have not shown yet."""

    timeout_s: float = EXPECTATION_TIMEOUT_S
    _pending: dict[tuple[Expecting, str], Expectation] = attrs.field(factory=dict)

    def expect(self, expectation: Expectation) -> None:
        """Remember a write about to be issued (issue it after: a cache may report it at once)."""
        self._pending[(expectation.kind, expectation.name)] = expectation

    def forget(self, kind: Expecting, name: str) -> None:
        """The write failed: nothing will be observed."""
        self._pending.pop((kind, name), None)

    def observe(
        self, active_jobs: Collection[str], all_jobs: Collection[str], secrets: Collection[str]
    ) -> list[Expectation]:
        """Settle what the caches now show: `active_jobs` the names of Jobs that may still run,
        `all_jobs` every Job the cache holds, `secrets` the token Secrets. Returns those settled."""
        settled = []
        for key in list(self._pending):
            kind, name = key
            if (
                (kind is Expecting.JOB_CREATED and name in all_jobs)
                or (kind is Expecting.SECRET_CREATED and name in secrets)
                or (kind is Expecting.JOB_DELETED and name not in active_jobs)
            ):
                settled.append(self._pending.pop(key))
        return settled

    def lapse(self, now: float) -> list[Expectation]:
        """Drop (and return) the expectations older than the timeout: their keys are planned
        again from what the caches show."""
        lapsed = [e for e in self._pending.values() if now - e.since >= self.timeout_s]
        for expectation in lapsed:
            del self._pending[(expectation.kind, expectation.name)]
        return lapsed

    def unsettled(self) -> Mapping[str, Expectation]:
        """Each node with a write not observed yet, and the oldest such write."""
        held: dict[str, Expectation] = {}
        for expectation in sorted(self._pending.values(), key=lambda e: e.since, reverse=True):
            held[expectation.node] = expectation
        return held

    def created_jobs(self) -> list[Expectation]:
        """The Job creates not observed yet (the pass counts them as pending workers)."""
        return [e for e in self._pending.values() if e.kind is Expecting.JOB_CREATED]

    def __len__(self) -> int:
        return len(self._pending)
