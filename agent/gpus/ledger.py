"""Which container holds which claimed card, rebuilt from records after a restart."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from agent.gpus.allocator import Allocation, Refusal, choose_cards
from agent.gpus.claim import Card, Claim
from nvml import Topology


@attrs.define
class CardLedger:
    """Which container holds which of this worker's cards. One per agent; not thread-safe (the
    agent uses it from its trio thread only)."""

    cards: tuple[Card, ...]
    topology: Topology = attrs.field(factory=Topology)
    _holders: dict[str, str] = attrs.field(factory=dict)
    """card UUID -> container id"""

    @classmethod
    def for_claim(cls, claim: Claim) -> CardLedger:
        return cls(cards=claim.serving, topology=claim.topology)

    def in_use(self) -> frozenset[str]:
        return frozenset(self._holders)

    def holder(self, uuid: str) -> str | None:
        return self._holders.get(uuid)

    def cards_of(self, container_id: str) -> tuple[str, ...]:
        return tuple(sorted(u for u, c in self._holders.items() if c == container_id))

    def free_count(self) -> int:
        return sum(1 for c in self.cards if c.uuid not in self._holders)

    def assign(self, container_id: str, count: int) -> Allocation | Refusal:
        """Gives `container_id` `count` cards, or refuses saying how many are free."""
        if self.cards_of(container_id):
            raise ValueError(f"container {container_id} already holds cards")
        result = choose_cards(self.cards, self.in_use(), count, self.topology)
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

    @classmethod
    def rebuild(
        cls, claim: Claim, running: Mapping[str, Iterable[str]]
    ) -> tuple[CardLedger, tuple[str, ...]]:
        """The ledger after an agent restart, from the containers still running and the card
        UUIDs each was given. Returns it with one line per conflict found.

        A card claimed by two running containers stays with the first (by container id) and the
        conflict is reported; a running container's card that this worker no longer serves is
        still counted as in use, so it is never handed to another container.
        """
        ledger = cls.for_claim(claim)
        serving = {c.uuid for c in ledger.cards}
        problems: list[str] = []
        for container_id in sorted(running):
            for uuid in sorted(set(running[container_id])):
                holder = ledger._holders.get(uuid)
                if holder is not None:
                    problems.append(
                        f"card {uuid} is held by running containers {holder} and {container_id}; "
                        f"it stays with {holder}, stop {container_id}"
                    )
                    continue
                if uuid not in serving:
                    problems.append(
                        f"running container {container_id} holds card {uuid}, which this "
                        "worker does not serve now; it stays in use until the container ends"
                    )
                ledger._holders[uuid] = container_id
        return ledger, tuple(problems)
