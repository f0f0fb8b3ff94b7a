"""The reconcile benchmark measures the watch-fed reconciler (initial sync, pass, change to plan,
memory, steady-state bytes) beside kubectl on the same stand-in, in one run, and reports the
sizes as inputs, not figures. How fast anything is belongs to the report."""

from __future__ import annotations

import math
from pathlib import Path

from bench.reconcile import FIGURE_RATIOS, RATIOS, Size, run_benchmark
from tests.kubectl import kubectl_binary

TINY = Size(nodes=6, pods=12, repeats=1, turns=1, passes=2, changes=2, steady_s=1.5)


def test_a_tiny_run_reports_the_watch_path_beside_kubectl(tmp_path: Path) -> None:
    kubectl_binary()  # the anchor: required, as everywhere in the suite
    results, inputs = run_benchmark(TINY, tmp_path)

    assert set(results.figures) == {
        "initial_sync_s",
        "pass_wall_s",
        "pass_cpu_s",
        "change_to_plan_s",
        "cache_rss_mb",
        "steady_bytes_per_min",
        "full_list_bytes",
        "planner_cpu_s",
        "facts_cpu_s",
    }
    assert set(results.anchors) == {"kubectl_list_pods_s", "kubectl_startup_s"}
    assert set(results.ratios) == set(RATIOS) | set(FIGURE_RATIOS)
    for section in (results.figures, results.anchors, results.ratios):
        for name, value in section.items():
            assert math.isfinite(value), (name, value)
            # Six nodes' caches may fit in memory a process that ran other tests already
            # holds: their RSS growth is measured, but need not be above zero.
            assert value > 0 or name == "cache_rss_mb", (name, value)
    for name, (ours, anchor) in RATIOS.items():
        assert results.ratios[name] == results.figures[ours] / results.anchors[anchor]
    for name, (ours, base) in FIGURE_RATIOS.items():
        assert results.ratios[name] == results.figures[ours] / results.figures[base]
    # Sizes are what was measured on, never a measurement.
    assert inputs == {
        "nodes": 6.0,
        "pods": 14.0,
        "pass_pods": 18.0,
        "turns": 1.0,
        "passes": 2.0,
        "changes": 2.0,
        "steady_s": 1.5,
        "bookmark_s": 0.75,
    }
    assert not set(inputs) & set(results.figures)
