"""The GPU health benchmark runs on a small plan and reports every figure it promises: a card
that failed under a running task is reported, and no task after it is given that card. How fast
anything is belongs to the benchmark's report, not to this test."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest

from bench.gpuhealth import Plan, run_benchmark

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="containers and runc need root (CI runs as root)"),
    pytest.mark.skipif(
        shutil.which("runc") is None or shutil.which("docker-registry") is None,
        reason="needs runc and docker-registry (make deps)",
    ),
]

TINY = Plan(injections=2, placements=6, squatters=1, spare_cards=2)


async def test_a_small_run_reports_failed_cards_and_places_nothing_on_them(
    tmp_path: Path,
) -> None:
    results, inputs = await run_benchmark(tmp_path, TINY)
    assert set(results.figures) == {
        "xid_to_reported_p50_s",
        "xid_to_reported_max_s",
        "placed_on_quarantined",
        "squatter_to_out_p50_s",
        "squatter_to_out_max_s",
        "squatter_gone_to_back_p50_s",
    }
    assert results.figures["placed_on_quarantined"] == 0
    assert inputs["placements"] == TINY.placements
    assert inputs["cards"] == TINY.injections + TINY.spare_cards
    for name, value in results.figures.items():
        assert math.isfinite(value) and (value > 0 or name == "placed_on_quarantined"), name
