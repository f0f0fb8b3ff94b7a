"""Card health while the worker runs: which claimed card turns UNHEALTHY or OCCUPIED, decided
by pure functions over what NVML said (`decide_health`), and whose a process is (`is_ours`).

The claim at start decides once; this goes on deciding. A critical XID in the configured set,
uncorrectable ECC errors that grew, or a card that no longer answers (NVML's GPU_IS_LOST, fallen
off the bus) quarantine the card for good: UNHEALTHY is final for this worker, only a new worker
(after a reset) serves it again. A compute process that is not one of our containers' makes the
card OCCUPIED while it runs; it serves again once no such process is left.

"Ours" is decided by cgroup, not by a pid list kept in memory, so it survives an agent restart:
our containers run under `/levers9/<container id>` (agent/runtime/ocispec.py `CGROUP_PARENT`).
The runner (agent/daemon/health.py) reads NVML and /proc and carries the decisions out.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from agent.gpus.claim import CARD_FAULT_XIDS
from nvml.model import Health, Process, XidEvent
from workerapi.models import CardState

DEFAULT_FAULT_XIDS: frozenset[int] = frozenset(CARD_FAULT_XIDS)
"""The XIDs that quarantine a card unless LEVERS9_GPU_FAULT_XIDS says otherwise."""
CGROUP_PARENT = "/levers9"
"""Where our containers' cgroups are: agent/runtime/ocispec.py's CGROUP_PARENT (this layer may
not import the runtime; a test holds the two equal)."""
SERVING_REASON = "healthy, and nothing else runs on it"
_MIB = 1 << 20


def xid_meaning(xid: int) -> str:
    return CARD_FAULT_XIDS.get(xid, "a critical error NVIDIA lists as a card fault")


@attrs.frozen
class CardWatch:
    """What is known about one watched card between two observations."""

    uuid: str
    index: int
    state: CardState
    reason: str
    ecc_uncorrected_volatile: int | None = None
    """The last count seen; the baseline growth is measured from."""
    xid: int | None = None
    """The XID that made it UNHEALTHY, if one did."""

    def describe(self) -> str:
        return f"card {self.index} ({self.uuid})"


@attrs.frozen
class CardObservation:
    """What one poll read about one card: its health (or the error NVML raised reading it) and
    its compute processes (None: NVML could not list them)."""

    uuid: str
    health: Health | None = None
    error: str | None = None
    """Why NVML could not read the card at all (it does not answer: lost, off the bus)."""
    processes: tuple[Process, ...] | None = ()


@attrs.frozen
class Transition:
    """A card's change of state (or of reason, for OCCUPIED), to log, count and register."""

    uuid: str
    index: int
    before: CardState
    after: CardState
    reason: str
    xid: int | None = None

    @property
    def quarantined(self) -> bool:
        return self.after is CardState.UNHEALTHY


def _clock(at: datetime.datetime) -> str:
    return at.astimezone(datetime.UTC).strftime("%H:%M:%S")


def _unhealthy(card: CardWatch, reason: str, xid: int | None = None) -> CardWatch:
    return attrs.evolve(
        card,
        state=CardState.UNHEALTHY,
        reason=f"{reason}; it is quarantined until the worker is replaced (reset the card or "
        "drain the node)",
        xid=xid,
    )


def _fault(
    card: CardWatch,
    xids: Sequence[int],
    observation: CardObservation | None,
    fault_xids: Collection[int],
    at: datetime.datetime,
) -> CardWatch | None:
    """The card quarantined, or None when nothing says it is at fault."""
    faults = [x for x in xids if x in fault_xids]
    if faults:
        xid = faults[0]
        return _unhealthy(
            card,
            f"XID {xid} at {_clock(at)} UTC on {card.describe()}: {xid_meaning(xid)}",
            xid,
        )
    if observation is None:
        return None
    health = observation.health
    if observation.error is not None or (health is not None and not health.responsive):
        error = observation.error or (health.error if health is not None else None)
        return _unhealthy(
            card, f"{card.describe()} stopped answering NVML at {_clock(at)} UTC ({error})"
        )
    ecc = None if health is None else health.ecc_uncorrected_volatile
    before = card.ecc_uncorrected_volatile
    if ecc is not None and before is not None and ecc > before:
        return _unhealthy(
            card,
            f"{card.describe()} reported {ecc - before} new uncorrectable ECC error(s) at "
            f"{_clock(at)} UTC ({ecc} since the driver loaded)",
        )
    return None


def occupied_reason(foreign: Sequence[Process]) -> str:
    """ "used by a process outside levers9: pid 4242, 1024 MiB" (one entry per process)."""
    parts = []
    for process in sorted(foreign, key=lambda p: p.pid):
        used = process.used_memory_bytes
        memory = "memory unknown" if used is None else f"{used // _MIB} MiB"
        parts.append(f"pid {process.pid}, {memory}")
    noun = "process" if len(parts) == 1 else "processes"
    return f"used by {noun} outside levers9: " + "; ".join(parts)


def _sharing(card: CardWatch, observation: CardObservation, ours: Collection[int]) -> CardWatch:
    """SERVING <-> OCCUPIED by the processes on the card; unchanged when NVML cannot list them."""
    if observation.processes is None:
        return card
    foreign = [p for p in observation.processes if p.pid not in ours]
    if foreign:
        return attrs.evolve(card, state=CardState.OCCUPIED, reason=occupied_reason(foreign))
    if card.state is CardState.OCCUPIED:
        return attrs.evolve(card, state=CardState.SERVING, reason=SERVING_REASON)
    return card


def decide_card(
    card: CardWatch,
    xids: Sequence[int],
    observation: CardObservation | None,
    ours: Collection[int],
    fault_xids: Collection[int],
    at: datetime.datetime,
) -> CardWatch:
    """One card's next state. Pure. UNHEALTHY (and any state other than SERVING or OCCUPIED)
    stays as it is."""
    if card.state not in (CardState.SERVING, CardState.OCCUPIED):
        return card
    faulted = _fault(card, xids, observation, fault_xids, at)
    if faulted is not None:
        return faulted
    if observation is None:
        return card
    ecc = None if observation.health is None else observation.health.ecc_uncorrected_volatile
    if ecc is not None:
        card = attrs.evolve(card, ecc_uncorrected_volatile=ecc)
    return _sharing(card, observation, ours)


def decide_health(
    known: Iterable[CardWatch],
    events: Sequence[XidEvent],
    observed: Mapping[str, CardObservation],
    ours: Collection[int],
    fault_xids: Collection[int],
    at: datetime.datetime,
) -> tuple[tuple[CardWatch, ...], tuple[Transition, ...]]:
    """Every watched card's next state, and the transitions (a change of state, or of an
    OCCUPIED card's reason), in card order. Pure.

    `events` are the XIDs heard since the last call; `observed` what the poll read, by UUID (a
    card absent from it was not polled this time); `ours` the pids of our containers."""
    cards: list[CardWatch] = []
    changes: list[Transition] = []
    for card in known:
        xids = [e.xid for e in events if e.uuid == card.uuid]
        if observation := observed.get(card.uuid):
            xids += list(observation.health.xids or ()) if observation.health else []
        after = decide_card(card, xids, observation, ours, fault_xids, at)
        cards.append(after)
        if after.state is not card.state or (
            after.state is CardState.OCCUPIED and after.reason != card.reason
        ):
            changes.append(
                Transition(card.uuid, card.index, card.state, after.state, after.reason, after.xid)
            )
    return tuple(cards), tuple(changes)


def is_ours(cgroup_text: str) -> bool:
    """Whether /proc/<pid>/cgroup text puts the process in one of our containers: a cgroup
    path with `/levers9/<container id>` in it (also seen from a cgroup namespace, where the
    path may start with `/..`, and also in a cgroup the container made below its own). Pure."""
    parent = CGROUP_PARENT.strip("/")
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts[:-1]):
            if part == parent and parts[i + 1] not in ("", ".", ".."):
                return True
    return False


def our_pids(pids: Iterable[int], proc: Path = Path("/proc")) -> frozenset[int]:
    """Those of `pids` that run in one of our containers. Blocks (reads /proc); a pid that
    is gone, or that we may not read, is not ours."""
    found = set()
    for pid in pids:
        try:
            text = (proc / str(pid) / "cgroup").read_text()
        except OSError:
            continue
        if is_ours(text):
            found.add(pid)
    return frozenset(found)


def all_our_pids(proc: Path = Path("/proc")) -> frozenset[int]:
    """Every pid on this host (as our /proc shows it) that runs in one of our containers.
    Blocks; for the claim at start, where a restarted agent's containers still run."""
    try:
        pids = [int(p.name) for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return frozenset()
    return our_pids(pids, proc)
