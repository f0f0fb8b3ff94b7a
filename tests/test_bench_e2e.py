"""The end-to-end benchmark runs in --quick mode and reports every figure it promises.

It runs `python -m bench.e2e --quick --json FILE` as `make bench` does: a whole loopback
installation with a direct-mode and a tunnel-mode worker, real runc containers and a bare runc
anchor. How fast anything is belongs to the benchmark's report, not to this test.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="containers and runc need root (CI runs as root)"),
    pytest.mark.skipif(
        shutil.which("runc") is None or shutil.which("docker-registry") is None,
        reason="needs runc and docker-registry (make deps)",
    ),
]

FIGURES = (
    "first_log_s",
    "first_log_p90_s",
    "first_log_api_s",
    "cli_startup_s",
    "endpoint_rps_tunnel",
    "endpoint_p99_ms_tunnel",
    "endpoint_rps_tunnel_keepalive",
    "endpoint_p99_ms_tunnel_keepalive",
    "sse_gap_p99_ms_tunnel",
    "log_delay_p50_ms",
    "log_delay_p90_ms",
    "log_follow_idle_cpu_pct",
)
ANCHORS = (
    "runc_first_log_s",
    "endpoint_rps_direct",
    "endpoint_p99_ms_direct",
    "endpoint_rps_ssh",
    "endpoint_rps_direct_keepalive",
    "endpoint_p99_ms_direct_keepalive",
    "endpoint_rps_ssh_keepalive",
    "sse_gap_p99_ms_direct",
)
RATIOS = (
    "first_log_vs_runc",
    "endpoint_rps_tunnel_vs_direct",
    "endpoint_rps_tunnel_vs_ssh",
    "endpoint_rps_tunnel_vs_direct_keepalive",
    "endpoint_p99_tunnel_vs_direct_keepalive",
    "endpoint_rps_tunnel_vs_ssh_keepalive",
    "sse_p99_gap_tunnel_vs_direct",
)
MAY_BE_ZERO = {"log_follow_idle_cpu_pct"}
RUN_DEADLINE_S = 300
STOP_GRACE_S = 60


def test_quick_run_writes_every_figure_anchor_and_ratio(tmp_path: Path) -> None:
    report_path = tmp_path / "e2e.json"
    # On a timeout the benchmark gets SIGTERM, so it stops the agents and containers it started.
    with subprocess.Popen(
        [sys.executable, "-m", "bench.e2e", "--quick", "--json", str(report_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=RUN_DEADLINE_S)
        except subprocess.TimeoutExpired:
            process.terminate()
            stdout, stderr = process.communicate(timeout=STOP_GRACE_S)
            pytest.fail(f"bench.e2e --quick ran past {RUN_DEADLINE_S} s: {stderr[-4000:]}")
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, stderr[-4000:]
    assert "first_log_s" in stdout  # the table for people
    report = json.loads(report_path.read_text())
    assert set(report) == {"figures", "ratios", "anchors", "machine"}
    for section, names in (("figures", FIGURES), ("anchors", ANCHORS), ("ratios", RATIOS)):
        for name in names:
            value = report[section].get(name)
            assert isinstance(value, int | float), f"{section}.{name} missing: {report[section]}"
            # An idle worker's CPU may well round to nothing; everything else was measured.
            floor_ok = value >= 0 if name in MAY_BE_ZERO else value > 0
            assert math.isfinite(value) and floor_ok, f"{section}.{name} is {value}"
    assert report["machine"]["cpu_count"] > 0
