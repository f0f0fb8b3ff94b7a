"""Pools against an API server that misbehaves as busy ones do: worker Jobs created behind a
lagging watch, and how soon a cache whose watches do not stream is found.

- `duplicate_jobs_lag_<L>`: a pool of `nodes` fresh GPU nodes reconciled every 0.5 s behind a
  watch whose events arrive `L` s after the write (0, 0.8, 3 and 5 s), for `L` + 10 s; the worker
  Jobs created beyond one per node. The anchor is the same run with expectations that lapse at
  once (`expectation_timeout_s=0`: each pass plans from the caches alone, as passes did before
  the loop kept expectations): its `..._without_expectations`.
- `stale_relist_s_<fault>` and `stale_unusable_s_<fault>`: with bookmarks every `period` s (the
  stand-in's and the caches'), from the moment watches start ending at once empty
  (`end_at_once`) or stop sending anything (`stall`) to the Job cache's first list made again,
  and to the pool's error saying its caches are unusable. The anchor is the bookmark period: the
  ratio `stale_detect_periods_<fault>` is the detection in periods (the target: 2 at most).
- `max_generation_end_at_once`: the highest Job generation on any node after `window` s of
  watches ending at once empty (before the caches were kept honest: 38 in 100 s).

    python -m bench.watchfaults [--quick] --json FILE
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from bench.report import Results, publish, ratios_of
from control.kube.caches import open_clusters
from control.kube.expectations import EXPECTATION_TIMEOUT_S
from control.kube.loop import PoolReconciler
from control.kube.manifests import GENERATION_LABEL
from control.kube.pools import load_pools
from control.workers.registry import open_worker_registry
from sim.kubeapi.http import start_kube_standin
from sim.kubeapi.store import KubeStandin, WatchFaults
from sim.pools import gpu_node, jobs_created, pool_block, schedule_pods_of_jobs

LAGS_S = (0.0, 0.8, 3.0, 5.0)
TARGET = "targets: duplicate_jobs_lag_* = 0 at every lag up to 5 s; stale_detect_periods_* <= 2"


@attrs.frozen
class Size:
    nodes: int
    period_s: float
    window_s: float
    lags_s: tuple[float, ...] = LAGS_S
    settle_s: float = 10.0
    """How long past the lag the pool is watched for a second Job."""


FULL = Size(nodes=20, period_s=1.0, window_s=30.0)
QUICK = Size(nodes=8, period_s=1.0, window_s=12.0)


def _say(message: str) -> None:
    print(f"bench.watchfaults: {message}", flush=True)


@asynccontextmanager
async def _pool(
    kube: KubeStandin, period_s: float, *, expectation_timeout_s: float = EXPECTATION_TIMEOUT_S
) -> AsyncIterator[PoolReconciler]:
    pool = load_pools([pool_block(kube, reconcileSeconds=0.5)]).pools[0]
    async with (
        open_worker_registry({}) as registry,
        open_clusters(bookmark_period_s=period_s) as clusters,
        trio.open_nursery() as nursery,
    ):
        async with clusters.use(pool) as cluster:
            reconciler = PoolReconciler(
                pool,
                cluster,
                registry,
                controlplane_url="https://bench.example.test",
                expectation_timeout_s=expectation_timeout_s,
            )
            await nursery.start(reconciler.run)
            yield reconciler
        nursery.cancel_scope.cancel()


def _add_nodes(kube: KubeStandin, count: int) -> None:
    kube.add_nodes(gpu_node(f"node-{i}") for i in range(count))


async def duplicates_at_lag(workdir: Path, size: Size, lag_s: float, *, expectations: bool) -> int:
    running = start_kube_standin(workdir / f"lag-{lag_s}-{expectations}")
    try:
        kube = running.kube
        kube.bookmark_interval_s = size.period_s
        schedule_pods_of_jobs(kube)
        kube.set_watch_faults(WatchFaults(lag_s=lag_s))
        timeout = EXPECTATION_TIMEOUT_S if expectations else 0.0
        async with _pool(kube, size.period_s, expectation_timeout_s=timeout):
            _add_nodes(kube, size.nodes)
            await trio.sleep(lag_s + size.settle_s)
        return jobs_created(kube) - size.nodes
    finally:
        running.stop()


async def _until(condition: Callable[[], bool]) -> float:
    began = trio.current_time()
    while not condition():  # noqa: ASYNC110 - counters and statuses with no event to wait on
        await trio.sleep(0.02)
    return trio.current_time() - began


async def stale_detection(workdir: Path, size: Size, fault: str) -> tuple[float, float]:
    running = start_kube_standin(workdir / f"stale-{fault}")
    try:
        kube = running.kube
        kube.bookmark_interval_s = size.period_s
        schedule_pods_of_jobs(kube)
        _add_nodes(kube, 2)
        async with _pool(kube, size.period_s) as r:
            with trio.fail_after(60):
                await _until(lambda: len(kube.jobs()) == 2 and r.status.error is None)
                await trio.sleep(3 * size.period_s)
            jobs = r.caches.jobs
            relists = jobs.stale_relists
            kube.set_watch_faults(WatchFaults(**{fault: True}))
            with trio.fail_after(30 * size.period_s):
                relist_s = await _until(lambda: jobs.stale_relists > relists)
            with trio.fail_after(60 * size.period_s):
                unusable_s = relist_s + await _until(lambda: r.status.error is not None)
        return relist_s, unusable_s
    finally:
        running.stop()


async def generation_climb(workdir: Path, size: Size) -> int:
    running = start_kube_standin(workdir / "climb")
    try:
        kube = running.kube
        kube.bookmark_interval_s = size.period_s
        schedule_pods_of_jobs(kube)
        async with _pool(kube, size.period_s):
            kube.set_watch_faults(WatchFaults(end_at_once=True))
            _add_nodes(kube, size.nodes)
            await trio.sleep(size.window_s)
        generations = [
            int(job["metadata"]["labels"].get(GENERATION_LABEL, "0")) for job in kube.jobs()
        ]
        return max(generations, default=0)
    finally:
        running.stop()


async def measure(workdir: Path, size: Size) -> Results:
    figures: dict[str, float] = {}
    anchors: dict[str, float] = {"bookmark_period_s": size.period_s}
    for lag in size.lags_s:
        name = f"duplicate_jobs_lag_{lag:g}"
        figures[name] = float(await duplicates_at_lag(workdir, size, lag, expectations=True))
        anchors[f"{name}_without_expectations"] = float(
            await duplicates_at_lag(workdir, size, lag, expectations=False)
        )
        _say(
            f"lag {lag:g} s: {figures[name]:g} duplicate Job(s); "
            f"{anchors[name + '_without_expectations']:g} without expectations"
        )
    for fault in ("end_at_once", "stall"):
        relist_s, unusable_s = await stale_detection(workdir, size, fault)
        figures[f"stale_relist_s_{fault}"] = relist_s
        figures[f"stale_unusable_s_{fault}"] = unusable_s
        _say(f"{fault}: listed again after {relist_s:.2f} s, unusable after {unusable_s:.2f} s")
    figures["max_generation_end_at_once"] = float(await generation_climb(workdir, size))
    pairs = {
        f"stale_detect_periods_{fault}": (f"stale_relist_s_{fault}", "bookmark_period_s")
        for fault in ("end_at_once", "stall")
    }
    return Results(figures=figures, anchors=anchors, ratios=ratios_of(pairs, figures, anchors))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.watchfaults",
        description="Worker Jobs behind a lagging watch, and how soon caches whose watches do "
        "not stream are found, against the stand-in API server.",
    )
    parser.add_argument("--quick", action="store_true", help="8 nodes, a 12 s climb window")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="levers9-bench-watchfaults-") as tmp:
        results = trio.run(measure, Path(tmp), size)
    inputs = {"nodes": float(size.nodes), "period_s": size.period_s, "window_s": size.window_s}
    publish(results, inputs, args.json, target=TARGET)


if __name__ == "__main__":
    main()
