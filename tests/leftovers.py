"""What a test checks is gone after an agent is done: its containers' runtime state, its bucket
mounts and their rclone processes; and what removes them when a broken test left them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil

from agent.host.mount import read_mountinfo
from agent.runtime.manager import ContainerManager
from agent.runtime.rootfs import overlay_mounts_under


def mounts_under(root: Path) -> list[Path]:
    return [e.mount_point for e in read_mountinfo() if root in e.mount_point.parents]


def rclones_under(root: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        named = cmdline[:1] and os.path.basename(cmdline[0]) == "rclone"
        if named and any(str(root) in arg for arg in cmdline):
            found.append(process)
    return found


def force_clean(root: Path) -> None:
    """Whatever a broken test left: detach mounts under `root`, kill its rclone processes."""
    for point in sorted(mounts_under(root), key=lambda p: -len(p.parts)):
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
    for process in rclones_under(root):
        process.kill()


async def assert_nothing_left(manager: ContainerManager, container_id: str) -> None:
    """No runc state, overlay mount, network or cgroup of `container_id` is left."""
    assert container_id not in {s.id for s in await manager.runc.list()}
    assert not [m for m in overlay_mounts_under(manager.root) if m.parent.name == container_id]
    assert container_id not in {n.container_id for n in await manager.networking.existing()}
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        assert not (hierarchy / "levers9" / container_id).exists(), hierarchy
