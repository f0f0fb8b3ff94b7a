"""The reconcile benchmark measures a real pass against kubectl on the same stand-in, in one
run, and reports the sizes as inputs, not figures. How fast anything is belongs to the report."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from bench.reconcile import RATIOS, run_benchmark

TINY = {"nodes": 6, "pods": 12, "repeats": 1, "passes": 1}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="the anchor needs kubectl on PATH")
def test_a_tiny_run_reports_our_pass_beside_kubectl(tmp_path: Path) -> None:
    results, inputs = run_benchmark(TINY, tmp_path)

    assert set(results.figures) == {
        "planner_cpu_s",
        "pass_wall_s",
        "pass_cpu_s",
        "first_pass_wall_s",
    }
    assert set(results.anchors) == {"kubectl_wall_s", "kubectl_cpu_s", "kubectl_startup_s"}
    assert set(results.ratios) == set(RATIOS)
    for section in (results.figures, results.anchors, results.ratios):
        for name, value in section.items():
            assert math.isfinite(value) and value > 0, (name, value)
    for name, (ours, anchor) in RATIOS.items():
        assert results.ratios[name] == results.figures[ours] / results.anchors[anchor]
    # Sizes are what was measured on, never a measurement.
    assert inputs == {"nodes": 6.0, "pods": 14.0, "pass_pods": 18.0, "passes": 1.0}
    assert not set(inputs) & set(results.figures)
