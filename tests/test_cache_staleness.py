"""A pool's caches against the Kubernetes API stand-in over TLS, through the official client,
when a proxy spoils its watches: every watch ended at once with nothing in it, or watches left
open but sent nothing. Either way the caches list again within a few bookmark periods, and past
the bound the pool refuses to write, says why in its status (`levers9 cluster list`), counts it
in the metrics, and goes back to work by itself once the watches stream again.

The stand-in sends a BOOKMARK every `bookmark_interval_s`; the caches are told to expect one
as often (`Clusters(bookmark_period_s=)`), so the test runs in seconds, not minutes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from control.kube.caches import open_clusters
from control.kube.loop import PoolReconciler
from control.kube.pools import load_pools
from control.metrics import ControlMetrics
from control.workers.registry import open_worker_registry
from sim.kubeapi.store import KubeStandin, WatchFaults
from sim.pools import gpu_node, jobs_created, pool_block
from tests.test_pool_reconcile import CONTROLPLANE_URL, Clock, cards, run_pods_of_jobs, until

pytest_plugins = ["tests.kube_fixtures"]

ADVICE = "let watches through for at least 10 minutes"


@asynccontextmanager
async def watched_pool(
    kube: KubeStandin, period_s: float
) -> AsyncIterator[tuple[PoolReconciler, ControlMetrics]]:
    """A pool's reconciler over caches that expect a bookmark every `period_s` (as the
    stand-in now sends them), counting into the controlplane's metrics as it does."""
    kube.bookmark_interval_s = period_s
    # Failed passes are retried from 1 s on, not from the default 15 s.
    pool = load_pools([pool_block(kube, reconcileSeconds=1)]).pools[0]
    metrics = ControlMetrics("test")
    async with (
        open_worker_registry({}) as registry,
        open_clusters(bookmark_period_s=period_s, on_cache_event=metrics.cache_event) as clusters,
        trio.open_nursery() as nursery,
    ):
        async with clusters.use(pool) as cluster:
            r = PoolReconciler(
                pool, cluster, registry, controlplane_url=CONTROLPLANE_URL, clock=Clock()
            )
            await nursery.start(r.run)
            yield r, metrics
        nursery.cancel_scope.cancel()


async def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until `condition` holds: what it reads (a cache's lists, counts and items) changes in
    the caches' own tasks, and a list that changes nothing tells no one, so it is polled."""
    with trio.fail_after(timeout_s):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.02)


async def pass_until(r: PoolReconciler, condition: Callable[[], bool]) -> None:
    """Passes (made here, not after the pool's failure backoff) until one makes `condition`
    true."""
    with trio.fail_after(30):
        while (await r.reconcile_once()) is None or not condition():  # noqa: ASYNC110
            await trio.sleep(0.1)


def sample(metrics: ControlMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


def job_nodes(kube: KubeStandin) -> list[str]:
    def node(job: dict[str, Any]) -> str:
        return str(job["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"])

    return sorted(node(job) for job in kube.jobs())


async def test_watches_ended_at_once_stop_the_pool_until_they_stream_again(
    kube: KubeStandin,
) -> None:
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    async with watched_pool(kube, 0.2) as (r, metrics):
        await until(r, lambda: cards(r) == (4, 0, 0))
        nodes = r.caches.nodes
        assert r.status.error is None and nodes.lists == 1
        kube.set_watch_faults(WatchFaults(end_at_once=True))
        # Listed again after three empty watches; a node added after that list is not in it.
        await wait_for(lambda: nodes.lists == 2)
        kube.add_node(gpu_node("node-2"))
        # Three more: the cache is unusable, and its next list brings the node in.
        await wait_for(lambda: "node-2" in nodes.items)
        assert nodes.unusable_count == 1
        assert await r.reconcile_once() is None
        error = r.status.error
        assert error is not None
        assert error.startswith("pool gpu: the nodes (levers9.dev/test-pool=gpu) cache")
        assert "every watch ended at once with nothing in it, 6 in a row" in error
        assert ADVICE in error
        assert job_nodes(kube) == ["node-1"]
        assert (
            sample(metrics, "levers9_cache_relists_total", cache="nodes", reason="empty_watches")
            >= 2
        )
        assert sample(metrics, "levers9_cache_unusable_total", cache="nodes") == 1
        assert sample(metrics, "levers9_cache_relists_total", cache="nodes", reason="silent") == 0

        # The watches stream again: the pool writes again, the Job it held back once.
        kube.set_watch_faults(WatchFaults())
        await pass_until(r, lambda: r.status.error is None and len(r.status.machines) == 2)
        await pass_until(r, lambda: all(m.cards.ours == 4 for m in r.status.machines))
        await r.reconcile_once()
        assert job_nodes(kube) == ["node-1", "node-2"]
        assert jobs_created(kube) == 2
        assert all(cache.error is None for cache in r.caches.all())


async def test_watches_that_stall_are_ended_within_two_bookmark_periods(
    kube: KubeStandin,
) -> None:
    period_s = 0.5
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    async with watched_pool(kube, period_s) as (r, metrics):
        await until(r, lambda: cards(r) == (4, 0, 0))
        nodes = r.caches.nodes
        assert nodes.lists == 1
        stalled_at = trio.current_time()
        kube.set_watch_faults(WatchFaults(stall=True))
        await wait_for(lambda: nodes.lists == 2)
        # The last bookmark came at most a period before the stall: two periods after it the
        # watch is ended and the list made (the slack is for a busy machine; without the bound
        # it would take the read timeout, minutes).
        assert trio.current_time() - stalled_at < 2 * period_s + 1.0
        assert nodes.relists["silent"] >= 1
        await wait_for(lambda: nodes.unusable_count == 1)
        assert await r.reconcile_once() is None
        assert r.status.error is not None
        assert "no event or bookmark for" in r.status.error and ADVICE in r.status.error
        assert sample(metrics, "levers9_cache_relists_total", cache="nodes", reason="silent") >= 2

        kube.set_watch_faults(WatchFaults())
        await pass_until(r, lambda: r.status.error is None)
        assert job_nodes(kube) == ["node-1"]
