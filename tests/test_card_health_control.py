"""What the controlplane does with a worker's report that a card went bad (issue 40): the
card is counted and named in `machine list` and its JSON, in /metrics, and told once as a
Kubernetes Event on the worker's Job (`kubectl describe job`), against the API stand-in.

The registrations are fabricated here (no agent): one card UNHEALTHY (an XID), one OCCUPIED
(a process outside levers9), the rest SERVING."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from control.api.pools import machine_list
from control.kube.caches import open_clusters
from control.kube.loop import PoolReconciler
from control.kube.pools import load_pools
from control.metrics import ControlMetrics
from control.workers.cards import (
    card_news,
    news_event,
    problem_facts,
    problems,
    problems_from_facts,
)
from control.workers.registry import WorkerRegistry, open_worker_registry
from sim.kubeapi.store import KubeStandin
from sim.pools import gpu_node, pool_block
from workerapi.models import CardInfo, CardState, Registration

pytest_plugins = ["tests.kube_fixtures"]

XID_79 = "XID 79 at 12:03:01: the GPU has fallen off the bus"
SQUATTER = "used by a process outside levers9: pid 4242, 1024 MiB"


def card(index: int, state: CardState = CardState.SERVING, reason: str = "") -> CardInfo:
    return CardInfo(
        uuid=f"GPU-{index}{index}{index}{index}",
        index=index,
        model="NVIDIA A100",
        memory_total_bytes=40 << 30,
        state=state,
        reason=reason,
    )


HEALTHY = (card(0), card(1), card(2), card(3))
TROUBLED = (
    card(0),
    card(1, CardState.OCCUPIED, SQUATTER),
    card(2, CardState.UNHEALTHY, XID_79),
    card(3),
)


# -- pure --------------------------------------------------------------------------------------


def test_a_card_going_bad_is_news_once_and_a_squatter_leaving_is_news_too() -> None:
    news = card_news("w", "node-1", HEALTHY, TROUBLED)
    assert [(n.card.index, n.card.state, n.was) for n in news] == [
        (1, CardState.OCCUPIED, CardState.SERVING),
        (2, CardState.UNHEALTHY, CardState.SERVING),
    ]
    assert card_news("w", "node-1", TROUBLED, TROUBLED) == ()  # a heartbeat says it again
    (freed,) = card_news("w", "node-1", TROUBLED, (*HEALTHY[:2], TROUBLED[2], HEALTHY[3]))
    assert news_event(freed) == (
        "CardFreed",
        "card 1 (GPU-1111) on node node-1: the process outside levers9 is gone; tasks are "
        "placed on it again",
        "Normal",
    )
    assert news_event(news[1]) == (
        "CardUnhealthy",
        f"card 2 (GPU-2222) on node node-1: {XID_79}; no new task is placed on it; it comes "
        "back when the worker is replaced",
        "Warning",
    )
    # A card refused at the claim is no transition to tell (the worker said so at its start).
    assert card_news("w", None, (), (card(0, CardState.REFUSED, "ECC"),)) == ()


def test_problem_cards_survive_the_directory_and_unknown_words_stay_bad() -> None:
    bad = problems(TROUBLED)
    assert [c.index for c in bad] == [1, 2]
    back = problems_from_facts(problem_facts(bad))
    assert [(c.index, c.uuid, c.state, c.reason) for c in back] == [
        (c.index, c.uuid, c.state, c.reason) for c in bad
    ]
    assert problems_from_facts([{"index": "x"}, "junk"]) == ()
    newer = problems((card(0, CardState("throttled"), "too hot"),))
    assert len(newer) == 1


# -- registry ----------------------------------------------------------------------------------


async def register(registry: WorkerRegistry, worker: str, cards: tuple[CardInfo, ...]) -> None:
    await registry.register(
        Registration(worker_id=worker, version="1", mode="tunnel", node="node-1", cards=cards)
    )


async def test_the_registry_tells_each_transition_once_and_places_only_on_serving() -> None:
    told: list[tuple[str, CardState]] = []
    async with open_worker_registry({"w": "t" * 32}) as registry:
        registry.card_listeners.append(
            lambda news: told.extend((n.card.uuid, n.card.state) for n in news)
        )
        await register(registry, "w", HEALTHY)
        await register(registry, "w", TROUBLED)
        await register(registry, "w", TROUBLED)
        entry = registry.entry("w")
        assert entry is not None and entry.cards == 2
        assert entry.card_ids == ("GPU-0000", "GPU-3333")
        assert {n: [c.index for c in cs] for n, cs in registry.card_problems().items()} == {
            "node-1": [1, 2]
        }
    assert told == [("GPU-1111", CardState.OCCUPIED), ("GPU-2222", CardState.UNHEALTHY)]


# -- against the Kubernetes stand-in ------------------------------------------------------------


@asynccontextmanager
async def pool_with_a_worker(kube: KubeStandin) -> AsyncIterator[PoolReconciler]:
    """A pool of one four-card node whose worker Job is created (and its token known)."""
    kube.on_job_created(lambda server, job: server.run_job_pod(job))
    kube.add_node(gpu_node("node-1"))
    pool = load_pools([pool_block(kube)]).pools[0]
    async with (
        open_worker_registry({}) as registry,
        open_clusters() as clusters,
        trio.open_nursery() as nursery,
    ):
        async with clusters.use(pool) as cluster:
            r = PoolReconciler(pool, cluster, registry, controlplane_url="https://cp.test:8443")
            await nursery.start(r.run)
            await until(r, lambda: bool(r.status.machines) and bool(kube.jobs()))
            yield r
        nursery.cancel_scope.cancel()


async def until(r: PoolReconciler, condition: Any) -> None:
    with trio.fail_after(30):
        while not (r.status.passed_at is not None and condition()):
            await r.passes.park()


def card_events(kube: KubeStandin) -> list[tuple[str, str, str, int]]:
    return sorted(
        (e["type"], e["reason"], e["message"], int(e.get("count") or 1))
        for e in kube.objects("events", "levers9")
        if str(e["reason"]).startswith("Card")
    )


async def test_a_bad_card_is_an_event_on_the_job_and_counted_everywhere(
    kube: KubeStandin,
) -> None:
    async with pool_with_a_worker(kube) as r:
        (job,) = kube.jobs()
        name = job["metadata"]["name"]
        await register(r.registry, name, HEALTHY)
        await register(r.registry, name, TROUBLED)
        await until(r, lambda: len(card_events(kube)) == 2)
        # Heartbeats saying the same again post nothing more.
        await register(r.registry, name, TROUBLED)
        await register(r.registry, name, TROUBLED)
        await r.reconcile_once()
        assert card_events(kube) == [
            (
                "Warning",
                "CardOccupied",
                f"card 1 (GPU-1111) on node node-1: {SQUATTER}; no new task is placed on it "
                "until that process ends",
                1,
            ),
            (
                "Warning",
                "CardUnhealthy",
                f"card 2 (GPU-2222) on node node-1: {XID_79}; no new task is placed on it; it "
                "comes back when the worker is replaced",
                1,
            ),
        ]
        (event, _) = [
            e for e in kube.objects("events", "levers9") if e["reason"].startswith("Card")
        ]
        assert event["involvedObject"]["name"] == name
        assert event["involvedObject"]["uid"] == job["metadata"]["uid"]

        await until(r, lambda: r.status.machines[0].worker is not None)
        listing = machine_list([r.status], {"node-1": 1}, r.registry.card_problems())
        (view,) = listing.machines
        assert attrs.asdict(view.cards) == {
            "total": 4, "ours": 4, "others": 0, "free": 0, "busy": 1, "idle": 1,
            "unhealthy": 1, "occupied": 1, "refused": 0,
        }  # fmt: skip
        assert [(p.index, p.state, p.reason) for p in view.card_problems] == [
            (1, "occupied", SQUATTER),
            (2, "unhealthy", XID_79),
        ]

        metrics = ControlMetrics("r-1")
        metrics.refresh({}, listing, [], 0)
        text = generate_latest(metrics.registry).decode()
        cards = {
            s.labels["use"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "levers9_pool_cards"
            for s in f.samples
        }
        assert (cards["unhealthy"], cards["occupied"], cards["idle"], cards["free"]) == (
            1,
            1,
            1,
            0,
        )

        # The squatter leaves: a Normal Event, and the card counts as idle again.
        freed = (*TROUBLED[:1], card(1), *TROUBLED[2:])
        await register(r.registry, name, freed)
        await until(r, lambda: any(e[1] == "CardFreed" for e in card_events(kube)))
        (view,) = machine_list([r.status], {}, r.registry.card_problems()).machines
        assert (view.cards.idle, view.cards.occupied, view.cards.unhealthy) == (3, 0, 1)


@pytest.mark.parametrize("state", [CardState.UNHEALTHY, CardState.OCCUPIED])
async def test_a_worker_of_another_pool_gets_no_event_here(
    kube: KubeStandin, state: CardState
) -> None:
    async with pool_with_a_worker(kube) as r:
        await r.registry.add_worker("elsewhere", "e" * 32)
        await register(r.registry, "elsewhere", (card(0, state, "bad"),))
        await r.reconcile_once()
        assert card_events(kube) == []
