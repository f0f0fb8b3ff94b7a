"""The cluster-join benchmark runs in --quick mode and reports every figure it promises, with
its kubectl anchor from the same run. How fast anything is belongs to the report, not here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.kubectl import kubectl_binary

REPO = Path(__file__).resolve().parents[1]


def test_the_join_benchmark_reports_join_and_kubectl_side_by_side(tmp_path: Path) -> None:
    kubectl_binary()  # the anchor: required, as everywhere in the suite
    out = tmp_path / "join.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.join", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "levers9 cluster join" in done.stdout and "kubectl apply" in done.stdout
    report = json.loads(out.read_text())
    assert set(report["figures"]) == {"join_create_s", "join_rerun_s", "cli_startup_s"}
    assert set(report["anchors"]) == {"kubectl_apply_create_s", "kubectl_apply_rerun_s"}
    assert set(report["ratios"]) == {
        "join_create_vs_kubectl_apply",
        "join_rerun_vs_kubectl_apply",
    }
    for group in ("figures", "anchors", "ratios"):
        for value in report[group].values():
            assert math.isfinite(value) and value > 0
    assert report["machine"]["cpu_count"] >= 1
