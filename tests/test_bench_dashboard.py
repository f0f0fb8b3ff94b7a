"""The dashboard benchmark runs in --quick mode and reports every figure it promises, with the
CLI's listing of the same pages as its anchors (a warm request, and a whole process). How fast
anything is belongs to the report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_dashboard_benchmark_reports_apps_metrics_and_the_cli_side_by_side(
    tmp_path: Path,
) -> None:
    out = tmp_path / "dashboard.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.dashboard", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["figures"]) == {
        "apps_first_paint_ms",
        "apps_rows_ms",
        "page_ms",
        "page_deep_ms",
        "metrics_scrape_ms",
        "metrics_scrape_p99_ms",
        "metrics_bytes",
    }
    assert set(report["anchors"]) == {
        "cli_request_ms",
        "cli_request_deep_ms",
        "cli_process_ms",
        "cli_process_deep_ms",
    }
    # Each ratio compares like with like, and the output says which is which.
    assert set(report["ratios"]) == {
        "page_vs_cli_request",
        "page_deep_vs_cli_request",
        "apps_rows_vs_cli_process",
    }
    assert "compared like with like" in done.stdout
    for group in ("figures", "anchors", "ratios"):
        for value in report[group].values():
            assert math.isfinite(value) and value > 0
    assert report["inputs"]["tasks"] == 1000
