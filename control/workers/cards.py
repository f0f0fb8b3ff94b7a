"""What a worker's cards' health means to an operator: which cards are out of placement and
why, and which changes are news worth a Kubernetes Event.

A worker registers every card it was given with its state (`workerapi.models.CardState`):
SERVING, REFUSED at the claim, UNHEALTHY (quarantined while it ran: a critical XID, off the
bus, uncorrectable ECC errors) or OCCUPIED (a process outside levers9 uses it). The registry
places only on SERVING cards; this module is the pure part of showing the others: `problems`
picks them out, `card_news` compares two registrations of one worker so that a transition is
told once (not on every heartbeat), and `news_event` words an Event about the worker's Job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from workerapi.models import CardInfo, CardState

NEWSWORTHY = frozenset({CardState.UNHEALTHY, CardState.OCCUPIED})
"""States a card entering is told as a Warning Event on its worker's Job."""


@attrs.frozen
class CardNews:
    """A card of `worker_id` (on `node`) whose state changed from `was` (None: not reported
    before) to `card.state`."""

    worker_id: str
    node: str | None
    card: CardInfo
    was: CardState | None


def problems(cards: Iterable[CardInfo]) -> tuple[CardInfo, ...]:
    """The cards out of placement (any state but SERVING), by index."""
    return tuple(sorted((c for c in cards if c.state is not CardState.SERVING), key=_index))


def _index(card: CardInfo) -> int:
    return card.index


def card_news(
    worker_id: str, node: str | None, before: Sequence[CardInfo], after: Sequence[CardInfo]
) -> tuple[CardNews, ...]:
    """The transitions between two registrations worth telling: a card that became UNHEALTHY
    or OCCUPIED, and an OCCUPIED card that serves again. The same state again is no news."""
    was = {c.uuid: c.state for c in before}
    out = []
    for card in after:
        old = was.get(card.uuid)
        if old is card.state:
            continue
        if card.state in NEWSWORTHY or (
            old is CardState.OCCUPIED and card.state is CardState.SERVING
        ):
            out.append(CardNews(worker_id, node, card, old))
    return tuple(out)


def card_name(card: CardInfo) -> str:
    """`card 2 (GPU-...)`: how every message names a card."""
    return f"card {card.index} ({card.uuid})"


def news_event(news: CardNews) -> tuple[str, str, str]:
    """(reason, message, type) of the Event about the worker's Job."""
    card = news.card
    where = f"{card_name(card)} on node {news.node or 'unknown'}"
    if card.state is CardState.UNHEALTHY:
        return (
            "CardUnhealthy",
            f"{where}: {card.reason}; no new task is placed on it; it comes back when the "
            "worker is replaced",
            "Warning",
        )
    if card.state is CardState.OCCUPIED:
        return (
            "CardOccupied",
            f"{where}: {card.reason}; no new task is placed on it until that process ends",
            "Warning",
        )
    return (
        "CardFreed",
        f"{where}: the process outside levers9 is gone; tasks are placed on it again",
        "Normal",
    )


def problem_facts(cards: Iterable[CardInfo]) -> list[dict[str, object]]:
    """The problem cards as the directory keeps them (for the other replicas)."""
    return [
        {
            "index": c.index,
            "uuid": c.uuid,
            "model": c.model,
            "state": c.state.value,
            "reason": c.reason,
        }
        for c in cards
    ]


def problems_from_facts(facts: object) -> tuple[CardInfo, ...]:
    """`problem_facts` read back; whatever does not parse is left out."""
    if not isinstance(facts, list):
        return ()
    out = []
    for item in facts:
        if not isinstance(item, Mapping):
            continue
        try:
            out.append(
                CardInfo(
                    uuid=str(item["uuid"]),
                    index=int(item["index"]),
                    model=str(item.get("model") or ""),
                    memory_total_bytes=0,
                    state=CardState(str(item["state"])),
                    reason=str(item.get("reason") or ""),
                )
            )
        except (KeyError, ValueError, TypeError):
            continue
    return tuple(out)
