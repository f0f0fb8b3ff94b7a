"""Card assignment for one container: a pure choice that prefers cards joined by NVLink."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence

import attrs

from agent.gpus.claim import Card
from nvml import Link, Topology
from workerapi.models import CardState


@attrs.frozen
class Allocation:
    cards: tuple[Card, ...]
    worst_link: Link | None
    """The farthest link between two of the cards; None for a single card."""


@attrs.frozen
class Refusal:
    requested: int
    free: int
    total: int
    reason: str


# Beyond this many candidate sets, choose greedily instead of trying every one.
_MAX_CANDIDATE_SETS = 5_000


def _score(
    chosen: Sequence[Card], free: Sequence[Card], topology: Topology
) -> tuple[int, int, int, tuple[int, ...]]:
    """Lower is better: farthest link, then all links together, then how many close neighbours
    of the chosen cards stay behind split from them (so whole NVLink groups stay whole for later
    requests), then the lowest indices."""
    ranks = [topology.between(a.uuid, b.uuid).rank for a, b in itertools.combinations(chosen, 2)]
    chosen_ids = {c.uuid for c in chosen}
    stranded = sum(
        1
        for c in chosen
        for other in free
        if other.uuid not in chosen_ids
        and topology.between(c.uuid, other.uuid).rank <= Link.PCIE_SWITCH.rank
    )
    return (max(ranks, default=0), sum(ranks), stranded, tuple(c.index for c in chosen))


def _greedy(free: Sequence[Card], count: int, topology: Topology) -> tuple[Card, ...]:
    best: tuple[Card, ...] | None = None
    for seed in free:
        chosen = [seed]
        while len(chosen) < count:
            rest = [c for c in free if c not in chosen]
            chosen.append(min(rest, key=lambda c: _score([*chosen, c], free, topology)))
        if best is None or _score(chosen, free, topology) < _score(best, free, topology):
            best = tuple(chosen)
    assert best is not None
    return best


def choose_cards(
    cards: Sequence[Card], in_use: Collection[str], count: int, topology: Topology
) -> Allocation | Refusal:
    """The `count` free serving cards to give one container, best connected first. Pure.

    A request is served from this worker alone or refused: it is never split across workers.
    """
    serving = [c for c in cards if c.state is CardState.SERVING]
    free = [c for c in serving if c.uuid not in in_use]
    total = len(serving)
    if count < 1:
        return Refusal(
            count, len(free), total, f"a request must be for at least 1 card, not {count}"
        )
    if count > total:
        return Refusal(
            count,
            len(free),
            total,
            f"{count} cards requested but this worker serves {total}; a {count}-card job needs "
            f"one worker with {count} free cards (it is never split across workers)",
        )
    if count > len(free):
        return Refusal(
            count,
            len(free),
            total,
            f"{count} cards requested; {len(free)} of this worker's {total} are free "
            f"({total - len(free)} in use)",
        )
    if math.comb(len(free), count) <= _MAX_CANDIDATE_SETS:
        best = min(itertools.combinations(free, count), key=lambda s: _score(s, free, topology))
    else:
        best = _greedy(free, count, topology)
    chosen = tuple(sorted(best, key=lambda c: c.index))
    links = [topology.between(a.uuid, b.uuid) for a, b in itertools.combinations(chosen, 2)]
    worst = max(links, key=lambda link: link.rank) if links else None
    return Allocation(cards=chosen, worst_link=worst)
