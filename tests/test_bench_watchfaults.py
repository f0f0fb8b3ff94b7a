"""The watch-faults benchmark reports duplicate Jobs behind a lagging watch beside the same run
without expectations, and how soon caches whose watches do not stream are found, in bookmark
periods. How many duplicates the anchor makes is the report's; ours must be none."""

from __future__ import annotations

import math
from pathlib import Path

import trio

from bench.watchfaults import Size, measure

TINY = Size(nodes=2, period_s=0.25, window_s=2.0, lags_s=(1.0,), settle_s=1.5)


def test_a_tiny_run_reports_every_figure_and_no_duplicate_job(tmp_path: Path) -> None:
    results = trio.run(measure, tmp_path, TINY)
    lags = {f"duplicate_jobs_lag_{lag:g}" for lag in TINY.lags_s}
    assert set(results.figures) == lags | {
        "stale_relist_s_end_at_once",
        "stale_unusable_s_end_at_once",
        "stale_relist_s_stall",
        "stale_unusable_s_stall",
        "max_generation_end_at_once",
    }
    assert set(results.anchors) == {"bookmark_period_s"} | {
        f"{name}_without_expectations" for name in lags
    }
    assert set(results.ratios) == {"stale_detect_periods_end_at_once", "stale_detect_periods_stall"}
    for section in (results.figures, results.anchors, results.ratios):
        assert all(math.isfinite(v) and v >= 0 for v in section.values()), section
    assert all(results.figures[name] == 0 for name in lags)
    assert results.figures["max_generation_end_at_once"] == 0
    for fault in ("end_at_once", "stall"):
        assert results.figures[f"stale_relist_s_{fault}"] > 0
        assert (
            results.figures[f"stale_relist_s_{fault}"]
            <= results.figures[f"stale_unusable_s_{fault}"]
        )
