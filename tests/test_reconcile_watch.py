"""Pools reconciled from watch-fed caches, against the Kubernetes API stand-in over TLS through
the official client: a dropped watch resumes without listing, an expired version lists once,
a burst of changes makes one or two passes, and the caches keep only what the pools read."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import attrs
import pytest
import trio

from control.api.server import Controlplane
from control.cli.main import main as cli_main
from control.kube.caches import open_clusters
from control.kube.planner import PodFacts
from control.kube.pools import load_pools
from sim.configs import API_TOKEN, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.kubeapi.objects import make_node, make_pod
from sim.kubeapi.store import KubeStandin
from sim.pools import gpu_node, jobs_created, pool_block
from tests.test_pool_reconcile import cards, gpu_request, reconciler, run_pods_of_jobs, until

pytest_plugins = ["tests.kube_fixtures"]

CACHES = ("nodes", "pods", "jobs", "secrets")
"""Each pool watches these four collections: four watch streams."""


async def watches_open(kube: KubeStandin, count: int) -> None:
    assert await trio.to_thread.run_sync(kube.wait_watches, count), kube.watch_count()


def lists(kube: KubeStandin) -> dict[str, int]:
    return {plural: kube.list_count(plural) for plural in CACHES}


async def test_a_dropped_watch_resumes_from_its_version_without_a_list(
    kube: KubeStandin,
) -> None:
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    kube.add_pod(make_pod("neighbour", "node-1", gpu_limit=1))
    async with reconciler(kube) as r:
        await until(r, lambda: cards(r) == (3, 1, 0))
        await watches_open(kube, len(CACHES))
        listed = lists(kube)
        assert listed == dict.fromkeys(CACHES, 1)
        assert kube.drop_watches() == len(CACHES)
        # Changed while no watch is open: the resumed watch brings it.
        kube.remove_pod("neighbour")
        await until(r, lambda: cards(r) == (3, 0, 1))
        await watches_open(kube, len(CACHES))
        assert lists(kube) == listed
        assert all(cache.lists == 1 for cache in r.caches.all())


async def test_an_expired_version_lists_each_cache_once_again(kube: KubeStandin) -> None:
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    kube.add_pod(make_pod("neighbour", "node-1", gpu_limit=1))
    async with reconciler(kube) as r:
        await until(r, lambda: cards(r) == (3, 1, 0))
        await watches_open(kube, len(CACHES))
        listed = lists(kube)
        # A change no cache watches, so that every cache's version is older than the
        # compaction, then the history is compacted and the watches dropped.
        kube.add_namespace("unwatched")
        kube.expire_history()
        kube.drop_watches()
        kube.remove_pod("neighbour")
        kube.update("nodes", gpu_node("node-1", labels={"zone": "b"}))
        await until(r, lambda: cards(r) == (3, 0, 1))
        await watches_open(kube, len(CACHES))
        assert lists(kube) == {plural: n + 1 for plural, n in listed.items()}
        assert all(cache.lists == 2 for cache in r.caches.all())


async def test_a_node_flapping_makes_at_most_two_passes_and_never_a_second_job(
    kube: KubeStandin,
) -> None:
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    # The wall clock: the node's Ready condition changes now, within the NotReady grace.
    async with reconciler(kube, clock=time.time, reconcileSeconds=600) as r:
        await until(r, lambda: cards(r) == (4, 0, 0))
        passes = r.pass_count
        for _ in range(5):
            kube.update("nodes", gpu_node("node-1", ready=False))
            kube.update("nodes", gpu_node("node-1", ready=True))
        # The last change is one a pass shows: every flap before it was seen by then.
        kube.update("nodes", gpu_node("node-1", gpus=8))
        await until(
            r, lambda: len(r.status.machines) == 1 and r.status.machines[0].cards.total == 8
        )
        assert r.pass_count - passes <= 2
    assert jobs_created(kube) == 1
    assert len(kube.jobs()) == 1


async def test_a_node_not_ready_past_its_grace_loses_its_worker(kube: KubeStandin) -> None:
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    async with reconciler(kube, clock=time.time) as r:
        await until(r, lambda: cards(r) == (4, 0, 0))
        node = gpu_node("node-1", ready=False)
        # Not Ready for longer than Kubernetes' own pods tolerate it.
        node["status"]["conditions"][0]["lastTransitionTime"] = "2020-01-01T00:00:00Z"
        kube.update("nodes", node)
        await until(r, lambda: not kube.jobs())
    assert [(n.node, n.reason) for n in r.status.skipped] == [("node-1", "node is not Ready")]


async def test_the_pod_cache_keeps_only_live_pods_bound_to_the_pools_nodes(
    kube: KubeStandin,
) -> None:
    kube.add_node(gpu_node("in-1"))
    kube.add_node(make_node("out-1", labels={"levers9.dev/test-pool": "other"}))
    kube.add_pod(make_pod("on-in", "in-1", gpu_limit=1))
    kube.add_pod(make_pod("on-out", "out-1", gpu_limit=1))
    kube.add_pod(make_pod("finished", "in-1", gpu_limit=1, phase="Succeeded"))
    kube.add_pod(make_pod("unscheduled", None, gpu_limit=1, phase="Pending"))
    async with reconciler(kube) as r:
        await until(r, lambda: True)
        pods = r.caches.pods.items
        assert list(pods) == ["default/on-in"]
        assert pods["default/on-in"] == PodFacts(
            node="in-1", phase="Running", request=(1, 1000, 1 << 30), ours=False
        )
        # The other node joins the pool: its pods are read then; it leaves: they go.
        kube.update("nodes", make_node("out-1", labels={"levers9.dev/test-pool": "gpu"}))
        await until(r, lambda: "default/on-out" in r.caches.pods.items)
        kube.update("nodes", make_node("out-1", labels={"levers9.dev/test-pool": "other"}))
        await until(r, lambda: "default/on-out" not in r.caches.pods.items)
        # A pod finishing leaves the cache (it holds nothing any more).
        kube.set_pod_phase("on-in", "Succeeded")
        await until(r, lambda: not r.caches.pods.items)
        assert [m.cards.free for m in r.status.machines] == [4]


async def test_a_node_that_enters_later_is_planned_only_once_its_pods_are_listed(
    kube: KubeStandin,
) -> None:
    # A node labelled into the pool after the pod cache's first list has its pods listed on
    # their own; that listing is held up here. Planned before it, all four cards look free and
    # the worker's Job asks for four, which the neighbour's three leave it never to get.
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("in-1"))
    kube.add_node(gpu_node("late-1", labels={"levers9.dev/test-pool": "other"}))
    kube.add_pod(make_pod("neighbour", "late-1", gpu_limit=3))
    async with reconciler(kube) as r:
        await until(r, lambda: len(kube.jobs()) == 1)
        kube.inject_fault("delay", path_prefix="/api/v1/pods", verb="list", delay_s=2.0)
        kube.update("nodes", gpu_node("late-1"))
        await until(r, lambda: len(kube.jobs()) == 2, timeout_s=30)
    late = [job for job in kube.jobs() if "late-1" in job["metadata"]["name"]]
    assert [gpu_request(job) for job in late] == ["1"]


async def test_a_neighbour_scaling_down_shows_in_machine_list_long_before_the_period(
    kube: KubeStandin, tmp_path: Path, nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]
) -> None:
    kube.add_node(gpu_node("node-7"))
    kube.add_pod(make_pod("neighbour", "node-7", gpu_limit=4))
    pki = make_pki(tmp_path)
    config = control_config(pki)
    block = pool_block(kube, reconcileSeconds=3600)
    config = attrs.evolve(config, worker=attrs.evolve(config.worker, pools=(block,)))
    control: Controlplane = await nursery.start(run_controlplane, config)
    (reconciling,) = control.runner.pools
    await until(reconciling, lambda: True)
    args = ["--controlplane", f"https://127.0.0.1:{control.port}", "--token", API_TOKEN]
    args += ["--ca", str(pki.ca_file), "machine", "list", "--json"]
    list_machines = functools.partial(cli_main, args)
    assert await trio.to_thread.run_sync(list_machines) == 0
    assert json.loads(capsys.readouterr().out) == []  # full: no machine

    kube.remove_pod("neighbour")
    with trio.fail_after(30):  # the period is an hour
        while True:
            assert await trio.to_thread.run_sync(list_machines) == 0
            listed = json.loads(capsys.readouterr().out)
            if listed:
                break
            await reconciling.passes.park()
    assert listed[0]["cards"]["free"] + listed[0]["cards"]["ours"] == 4


async def test_two_pools_of_one_cluster_share_its_pod_and_job_caches(
    kube: KubeStandin, tmp_path: Path, nursery: trio.Nursery
) -> None:
    kube.add_node(gpu_node("a-1"))
    kube.add_node(make_node("b-1", labels={"levers9.dev/test-pool": "other"}))
    kube.add_pod(make_pod("on-b", "b-1", gpu_limit=1))
    pki = make_pki(tmp_path)
    config = control_config(pki)
    other = pool_block(kube, selector={"levers9.dev/test-pool": "other"})
    other["name"] = "other"
    config = attrs.evolve(
        config, worker=attrs.evolve(config.worker, pools=(pool_block(kube), other))
    )
    control: Controlplane = await nursery.start(run_controlplane, config)
    first, second = control.runner.pools
    await until(first, lambda: bool(first.status.machines))
    await until(second, lambda: bool(second.status.machines))
    assert first.caches.pods is second.caches.pods
    assert first.caches.jobs is second.caches.jobs
    assert first.caches.nodes is not second.caches.nodes
    # Two node caches, one each of pods, Jobs and Secrets.
    await watches_open(kube, 5)
    assert {m.node for p in (first, second) for m in p.status.machines} == {"a-1", "b-1"}
    assert second.status.machines[0].cards.others == 1


async def test_a_storm_of_creates_keeps_to_the_pools_request_budget(kube: KubeStandin) -> None:
    kube.add_nodes(gpu_node(f"node-{i}") for i in range(12))
    async with reconciler(kube, qps=20, burst=4) as r:
        await until(r, lambda: len(kube.jobs()) == 12)
        assert r.kube.throttled_s > 0  # type: ignore[attr-defined]
    # Each worker is a Job, a Secret and an Event: 36 writes, never more at once than the
    # budget lets through (4 at once, then 20 a second; one more for the edges of a window).
    writes = sorted(q.at for q in kube.requests if q.verb == "create")
    assert len(writes) >= 36
    busiest = max(sum(1 for t in writes if start <= t < start + 1.0) for start in writes)
    assert busiest <= 4 + 20 + 1


class _CancelAtStep(trio.abc.Instrument):
    """Cancels `scope` when `task` is about to take its `steps`th step: a pool that stops
    leading at any moment of taking its caches."""

    def __init__(self, task: trio.lowlevel.Task, scope: trio.CancelScope, steps: int) -> None:
        self.task, self.scope, self.left = task, scope, steps

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.left -= 1
            if self.left == 0:
                self.scope.cancel()


async def test_a_pool_that_stops_leading_while_it_takes_its_caches_leaves_them_usable(
    kube: KubeStandin,
) -> None:
    """Seen in a chaos campaign: a pool's leadership flapped while it took its caches, and the
    next leader's reconciler waited forever for a cache that never ran."""
    kube.add_node(gpu_node("node-1"))
    pool = load_pools([pool_block(kube)]).pools[0]
    # Another pool of the cluster keeps it, and the caches both read, alive throughout.
    other = attrs.evolve(
        load_pools([pool_block(kube, selector={"levers9.dev/test-pool": "other"})]).pools[0],
        name="other",
    )
    async with open_clusters() as clusters:
        async with clusters.use(other):
            for steps in range(1, 25):
                with trio.CancelScope() as scope:
                    instrument = _CancelAtStep(trio.lowlevel.current_task(), scope, steps)
                    trio.lowlevel.add_instrument(instrument)
                    try:
                        async with clusters.use(pool):
                            scope.cancel()  # it stops leading now, at the latest
                            await trio.lowlevel.checkpoint()
                    finally:
                        trio.lowlevel.remove_instrument(instrument)
                with trio.fail_after(10):
                    async with clusters.use(pool) as cluster:
                        for cache in cluster.caches.all():
                            await cache.first_outcome.wait()
                            assert cache.error is None, (steps, cache.collection)
