"""What a test checks is gone after an agent is done: its containers' runtime state, its bucket
mounts and their rclone processes; and what removes them when a broken test left them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from agent.runtime.manager import ContainerManager
from agent.runtime.rootfs import overlay_mounts_under

# One copy, in the simulator (which may not import tests): the fault campaign checks the same.
from sim.chaos.invariants import container_cgroups, mounts_under, rclones_under

__all__ = ["assert_nothing_left", "force_clean", "mounts_under", "rclones_under"]


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
    assert not container_cgroups(container_id)
