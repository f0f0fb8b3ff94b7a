"""Which container holds which claimed card, rebuilt from records after a restart.

The rebuild is a decision, not an action: `CardLedger.rebuild` says which running container
must give a card up (`CardConflict.must_stop`) and the container manager carries that out.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

import attrs

from agent.gpus.allocator import Allocation, Refusal, choose_cards
from agent.gpus.claim import Card, Claim
from nvml import Topology
from workerapi.models import CardState


class ConflictKind(enum.Enum):
    SHARED = "shared"
    """Two running containers' records name the card."""
    NOT_CLAIMED = "not-claimed"
    """This worker was not given the card this time (another pod may have it now)."""
    NOT_SERVING = "not-serving"
    """Still this worker's, but refused now (a compute process on it, ill health)."""


@attrs.frozen
class CardConflict:
    """A running container's card that a rebuilt ledger cannot simply give back to it."""

    kind: ConflictKind
    uuid: str
    container: str
    """The container the conflict is about (for SHARED, the one that must stop)."""
    holder: str | None = None
    """For SHARED: the container that keeps the card."""

    @property
    def must_stop(self) -> bool:
        """Whether `container` may not keep running: it shares the card, or the card is no
        longer this worker's to use. A card merely refused now stays with its container (the
        claim refuses a card that runs a process it does not know, which after a restart is
        the container's own)."""
        return self.kind is not ConflictKind.NOT_SERVING

    def describe(self) -> str:
        """One line naming the card and the container, for a log, an event or an error."""
        if self.kind is ConflictKind.SHARED:
            return (
                f"card {self.uuid} is named by running containers {self.holder} and "
                f"{self.container}; {self.holder} keeps it and {self.container} must stop"
            )
        if self.kind is ConflictKind.NOT_CLAIMED:
            return (
                f"card {self.uuid} of running container {self.container} was not given to this "
                f"worker this time; {self.container} must stop"
            )
        return (
            f"card {self.uuid} of running container {self.container} does not serve now; it "
            f"stays in use until {self.container} ends"
        )


def _uuids(cards: Iterable[Card]) -> frozenset[str]:
    return frozenset(c.uuid for c in cards)


@attrs.define
class CardLedger:
    """Which container holds which of this worker's cards. One per agent; not thread-safe (the
    agent uses it from its trio thread only)."""

    cards: tuple[Card, ...]
    """The cards that serve: the only ones ever assigned."""
    topology: Topology = attrs.field(factory=Topology)
    claimed: frozenset[str] = attrs.field(
        default=attrs.Factory(lambda self: _uuids(self.cards), takes_self=True)
    )
    """Every card this worker was given, serving or refused."""
    _holders: dict[str, str] = attrs.field(factory=dict)
    """card UUID -> container id"""
    _unhealthy: set[str] = attrs.field(factory=set)
    """Cards quarantined while the worker ran: never assigned again by this worker."""
    _occupied: set[str] = attrs.field(factory=set)
    """Cards a process outside levers9 uses now: not assigned while it does."""

    @classmethod
    def for_claim(cls, claim: Claim) -> CardLedger:
        return cls(cards=claim.serving, topology=claim.topology, claimed=_uuids(claim.cards))

    def in_use(self) -> frozenset[str]:
        return frozenset(self._holders)

    def holder(self, uuid: str) -> str | None:
        return self._holders.get(uuid)

    def cards_of(self, container_id: str) -> tuple[str, ...]:
        return tuple(sorted(u for u, c in self._holders.items() if c == container_id))

    def placeable(self) -> tuple[Card, ...]:
        """The serving cards that may be assigned now (not quarantined, not occupied)."""
        out = self._unhealthy | self._occupied
        return tuple(c for c in self.cards if c.uuid not in out)

    def free_count(self) -> int:
        return sum(1 for c in self.placeable() if c.uuid not in self._holders)

    def set_state(self, uuid: str, state: CardState) -> None:
        """What the health watch decided for a card: UNHEALTHY takes it out for good, OCCUPIED
        while it lasts, SERVING puts an occupied card back (never a quarantined one)."""
        if state is CardState.UNHEALTHY:
            self._unhealthy.add(uuid)
            self._occupied.discard(uuid)
        elif state is CardState.OCCUPIED:
            if uuid not in self._unhealthy:
                self._occupied.add(uuid)
        elif state is CardState.SERVING:
            self._occupied.discard(uuid)

    def assign(self, container_id: str, count: int) -> Allocation | Refusal:
        """Gives `container_id` `count` cards, or refuses saying how many are free."""
        if self.cards_of(container_id):
            raise ValueError(f"container {container_id} already holds cards")
        result = choose_cards(self.placeable(), self.in_use(), count, self.topology)
        if isinstance(result, Allocation):
            for card in result.cards:
                self._holders[card.uuid] = container_id
        return result

    def release(self, container_id: str) -> tuple[str, ...]:
        """Frees the cards of a container that ended; returns their UUIDs."""
        freed = self.cards_of(container_id)
        for uuid in freed:
            del self._holders[uuid]
        return freed

    def rebuild(self, running: Mapping[str, Iterable[str]]) -> tuple[CardConflict, ...]:
        """Who holds what after an agent restart: forgets every holder and gives each running
        container the card UUIDs its record names. Returns the conflicts found, in container
        id order. Deterministic and without I/O.

        A card named by two running containers stays with the first (by container id); the
        other must stop. Every card a running container names is counted as in use, served or
        not, so it is never handed to another container while that one runs.
        """
        self._holders.clear()
        serving = _uuids(self.cards)
        conflicts: list[CardConflict] = []
        for container_id in sorted(running):
            for uuid in sorted(set(running[container_id])):
                holder = self._holders.get(uuid)
                if holder is not None:
                    conflicts.append(
                        CardConflict(ConflictKind.SHARED, uuid, container_id, holder=holder)
                    )
                    continue
                if uuid not in self.claimed:
                    conflicts.append(CardConflict(ConflictKind.NOT_CLAIMED, uuid, container_id))
                elif uuid not in serving:
                    conflicts.append(CardConflict(ConflictKind.NOT_SERVING, uuid, container_id))
                self._holders[uuid] = container_id
        return tuple(conflicts)
