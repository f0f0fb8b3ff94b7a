"""The containers' cgroups on this node: removing one from every mounted hierarchy, and whether
the kernel's OOM killer struck in it.

Why a module of its own, beside the mount adapter: runc creates a container's cgroup but leaves
it behind when a container is killed hard or the node's agent restarts, and the OOM count is read
from cgroupfs, not from runc. Both cgroup v1 (one hierarchy per controller) and v2
(one unified hierarchy) are read, found through /proc/self/mountinfo (`agent.host.mount`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import attrs

from agent.host.mount import read_mountinfo
from wire.errors import ApiError, ErrorCode

__all__ = ["CgroupError", "oom_killed", "remove_cgroup"]


class CgroupError(ApiError):
    """A container's cgroup could not be removed or its path is not one of ours."""


@attrs.frozen
class _CgroupMount:
    path: Path
    version: int
    controllers: frozenset[str]


def _cgroup_mounts() -> list[_CgroupMount]:
    mounts: list[_CgroupMount] = []
    seen: set[Path] = set()
    for entry in read_mountinfo():
        if entry.fs_type not in ("cgroup", "cgroup2") or entry.mount_point in seen:
            continue
        seen.add(entry.mount_point)
        version = 2 if entry.fs_type == "cgroup2" else 1
        options = entry.options.split(",") if version == 1 else ()
        mounts.append(_CgroupMount(entry.mount_point, version, frozenset(options)))
    return mounts


def _relative(cgroups_path: str) -> str:
    parts = cgroups_path.split("/")
    if not cgroups_path.startswith("/") or any(p in ("..", ".") for p in parts) or not parts[-1]:
        raise CgroupError(
            ErrorCode.INVALID_ARGUMENT,
            f"cgroup path {cgroups_path!r} must be absolute, without '.' or '..' parts",
        )
    return cgroups_path.lstrip("/")


def remove_cgroup(cgroups_path: str) -> None:
    """Removes the container's cgroup (and any below it) from every mounted hierarchy; one that
    is already gone is no error. Raises FAILED_PRECONDITION while processes are still in it."""
    relative = _relative(cgroups_path)
    for mount in _cgroup_mounts():
        top = mount.path / relative
        if not top.is_dir():
            continue
        below = [Path(d) for d, _, _ in os.walk(top)]
        for directory in sorted(below, key=lambda p: len(p.parts), reverse=True):
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    raise CgroupError(
                        ErrorCode.FAILED_PRECONDITION,
                        f"cgroup {directory} still holds processes; stop and delete the "
                        "container before removing its cgroup",
                    ) from None
                raise CgroupError(
                    ErrorCode.INTERNAL, f"cgroup {directory} could not be removed: {exc}"
                ) from None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _v1_file(relative: str, controller: str, name: str) -> str | None:
    for mount in _cgroup_mounts():
        if mount.version == 1 and controller in mount.controllers:
            return _read(mount.path / relative / name)
    return None


def _v2_file(relative: str, name: str) -> str | None:
    for mount in _cgroup_mounts():
        if mount.version == 2:
            text = _read(mount.path / relative / name)
            if text is not None:
                return text
    return None


def oom_killed(cgroups_path: str) -> bool:
    """Whether the kernel's OOM killer killed a process in the container's cgroup. Read it
    before the container is deleted: the count goes with the cgroup."""
    relative = _relative(cgroups_path)
    for text in (
        _v2_file(relative, "memory.events"),
        _v1_file(relative, "memory", "memory.oom_control"),
    ):
        for line in (text or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                return True
    return False
