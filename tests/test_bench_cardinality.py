"""The cardinality benchmark runs in --quick mode and reports `/metrics` bounded beside its
anchor (the request counter labelled by the method as sent) from the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_cardinality_benchmark_reports_bounded_metrics(tmp_path: Path) -> None:
    out = tmp_path / "cardinality.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.cardinality", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    figures = report["figures"]
    # One more (route, method) pair at most: a random path may match a public route pattern.
    assert 0 < figures["request_series_before"] <= figures["request_series_after"]
    assert figures["request_series_after"] <= figures["request_series_before"] + 18
    assert report["ratios"]["metrics_bytes_vs_raw_method_labels"] < 0.5
    assert report["anchors"]["raw_method_counter_bytes"] > 0
