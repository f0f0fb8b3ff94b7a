"""The tunnel benchmark runs end to end and reports every ratio it promises.

An integration test of the benchmark itself, with a plan small enough for a test: the sink, sshd
and ssh, the controlplane and one agent process per mode all run for real. How fast anything
is belongs to the benchmark's report, not to this test.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import psutil
import pytest

from bench.anchors import find_sshd
from bench.tunnel import OUR_PATHS, main

REQUIRED_RATIOS = (
    "tunnel_vs_ssh_1",
    "tunnel_vs_ssh_8",
    "direct_vs_ssh_1",
    "direct_vs_ssh_8",
    "tunnel_vs_tcp_1",
    "tunnel_vs_ssh_down_1",
    "tunnel_vs_ssh_down_8",
    "rtt_p50_tunnel_vs_ssh",
    "stream_p99_tunnel_vs_ssh",
    "connect_p50_tunnel_vs_ssh",
    "connect_early_p50_tunnel_vs_ssh",
)


@pytest.mark.skipif(
    find_sshd() is None or not shutil.which("ssh") or not shutil.which("ssh-keygen"),
    reason="needs OpenSSH: sshd (openssh-server), ssh and ssh-keygen (openssh-client)",
)
@pytest.mark.root
def test_tiny_run_reports_every_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_path = tmp_path / "tunnel.json"
    tiny = ["--total-mib", "4", "--round-trips", "20", "--connects", "5", "--repeats", "1"]
    tiny += ["--stream-messages", "50"]
    # What runs before the benchmark (a session fixture's registry, say) is not its own.
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    main([*tiny, "--json", str(report_path)])

    report = json.loads(report_path.read_text())
    assert set(report) == {"figures", "ratios", "anchors", "machine"}
    for name in REQUIRED_RATIOS:
        value = report["ratios"].get(name)
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
    for path in OUR_PATHS:
        assert report["figures"][f"{path}.upload_8_streams_MBps"] > 0
    for path in ("tcp", "ssh_R"):
        assert report["anchors"][f"{path}.rtt_p50_us"] > 0
    table = capsys.readouterr().out
    assert "tunnel_vs_ssh_1" in table and "ssh -R" in table
    # The agents, sink, sshd and ssh are all gone once the benchmark returns.
    leftovers = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.status() != "zombie"
    ]
    assert not leftovers, leftovers
