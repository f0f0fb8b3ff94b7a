"""Two runs on one machine (`make test` twice, a campaign beside the tests) each get their own
network namespaces, links, nft tables and `/levers9` cgroups (sim/isolation.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.isolation import (
    Mount,
    cgroup_hierarchies,
    mounts_under_sys,
    parse_mountinfo,
    why_not,
)

MOUNTINFO = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:22 / /sys rw,nosuid shared:2 - sysfs sysfs rw
24 23 0:23 / /sys/fs/cgroup rw shared:3 - tmpfs tmpfs rw,mode=755
25 24 0:24 / /sys/fs/cgroup/memory rw shared:4 - cgroup cgroup rw,memory
26 24 0:25 / /sys/fs/cgroup/unified rw shared:5 - cgroup2 cgroup2 rw
27 23 0:26 / /sys/fs/fuse/connections rw shared:6 - fusectl fusectl rw
28 22 0:27 / /run/my\\040dir rw shared:7 - tmpfs tmpfs rw
29 25 0:24 /levers9-run-1 /sys/fs/cgroup/memory/levers9 rw - cgroup cgroup rw,memory
"""


def test_mountinfo_is_read_with_escaped_paths_and_optional_fields() -> None:
    mounts = parse_mountinfo(MOUNTINFO + "garbage\n")
    assert mounts[0] == Mount(22, 1, "/", "ext4")
    assert Mount(28, 22, "/run/my dir", "tmpfs") in mounts
    assert len(mounts) == 8


def test_each_cgroup_hierarchy_is_bound_once_and_what_sits_on_sys_is_carried() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    # An outer run's /levers9 is a cgroup mount too, but not a hierarchy of its own.
    assert cgroup_hierarchies(mounts) == ["/sys/fs/cgroup/memory", "/sys/fs/cgroup/unified"]
    # The cgroup tree and fuse's connections would be hidden by a new sysfs; what sits on them
    # travels with them.
    assert mounts_under_sys(mounts) == ["/sys/fs/cgroup", "/sys/fs/fuse/connections"]


def test_a_run_says_why_it_shares_the_host_network() -> None:
    assert why_not({}, 0, "/usr/bin/unshare") is None
    assert why_not({"LEVERS9_ISOLATION": "OFF"}, 0, "/usr/bin/unshare") == "LEVERS9_ISOLATION=off"
    assert "not root" in str(why_not({}, 1000, "/usr/bin/unshare"))
    assert "unshare" in str(why_not({}, 0, None))
    said = "unshare: unshare failed: Operation not permitted"
    refused = why_not({}, 0, "/usr/bin/unshare", said)
    assert refused == f"unshare --net --mount is not allowed here: {said}"


SAME_NAMES = """
set -e
hierarchy=$1
ip netns add l9iso-same
ip link add l9isoa type veth peer name l9isob
nft add table inet levers9_isolation_test
mkdir "$hierarchy/levers9/l9iso-same"
echo ready > "$2"
while [ ! -e "$3" ]; do sleep 0.05; done
ls /run/netns
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and cgroups need root (CI runs as root)")
def test_two_runs_side_by_side_use_the_same_names_and_leave_nothing(tmp_path: Path) -> None:
    hierarchy = cgroup_hierarchies(parse_mountinfo(Path("/proc/self/mountinfo").read_text()))[0]
    before = sorted(p.name for p in Path(hierarchy).iterdir() if p.name.startswith("levers9-run"))
    script = tmp_path / "same.sh"
    script.write_text(SAME_NAMES)
    release = tmp_path / "release"
    runs = []
    for name in ("a", "b"):
        ready = tmp_path / f"ready-{name}"
        argv = [sys.executable, "-m", "sim.isolation", "--", "sh", str(script), hierarchy]
        runs.append(
            subprocess.Popen(
                [*argv, str(ready), str(release)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert runs[-1].poll() is None, runs[-1].communicate()
            assert time.monotonic() < deadline, f"run {name} did not get ready"
            time.sleep(0.05)
    # Both hold the same namespace, link, table and cgroup names at once; none is ours.
    assert not Path("/run/netns/l9iso-same").exists()
    assert not Path(hierarchy, "levers9", "l9iso-same").exists()
    release.touch()
    for run in runs:
        out, err = run.communicate(timeout=30)
        assert run.returncode == 0, err
        assert out.split() == ["l9iso-same"]
        assert "cgroup left" not in err
    after = sorted(p.name for p in Path(hierarchy).iterdir() if p.name.startswith("levers9-run"))
    assert after == before
