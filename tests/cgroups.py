"""A container's limits read back from cgroupfs: the tests' check that what was asked for is what
the kernel applies. The agent itself never reads limits back (runc applies them from the bundle),
so the reading lives here. Both cgroup v1 (one hierarchy per controller) and v2 (one unified
hierarchy) are read, found through /proc/self/mountinfo."""

from __future__ import annotations

from pathlib import Path

from agent.host.mount import read_mountinfo

# memory.limit_in_bytes reads as PAGE_COUNTER_MAX * page size when unlimited.
_UNLIMITED_BYTES = 1 << 62


def _hierarchies() -> list[tuple[Path, int, frozenset[str]]]:
    """(mount point, cgroup version, v1 controllers) of every mounted cgroup hierarchy."""
    found: list[tuple[Path, int, frozenset[str]]] = []
    for entry in read_mountinfo():
        if entry.fs_type == "cgroup2":
            found.append((entry.mount_point, 2, frozenset()))
        elif entry.fs_type == "cgroup":
            found.append((entry.mount_point, 1, frozenset(entry.options.split(","))))
    return found


def _read(relative: str, name: str, controller: str | None = None) -> str | None:
    """`name` of the cgroup in the v2 hierarchy (controller None) or in the v1 hierarchy of
    `controller`; None when not there."""
    for mount_point, version, controllers in _hierarchies():
        if (version == 2) if controller is None else (controller in controllers):
            try:
                return (mount_point / relative / name).read_text()
            except OSError:
                continue
    return None


def _number(text: str | None) -> int | None:
    words = (text or "").split()
    if not words or words[0] in ("max", "-1"):
        return None
    value = int(words[0])
    return None if value >= _UNLIMITED_BYTES else value


def read_cgroup_limits(cgroups_path: str) -> dict[str, int | None]:
    """The limits the kernel applies to the container: `memory_bytes`, `memory_swap_bytes`
    (memory + swap), `cpu_quota_us`, `cpu_period_us`, `pids_max`; None is unlimited (or not
    readable, e.g. the cgroup is gone)."""
    relative = cgroups_path.lstrip("/")
    cpu_v2 = _read(relative, "cpu.max")
    if cpu_v2 is not None:
        words = cpu_v2.split()
        quota = _number(words[0]) if words else None
        period = _number(words[1]) if len(words) > 1 else None
    else:
        quota = _number(_read(relative, "cpu.cfs_quota_us", "cpu"))
        period = _number(_read(relative, "cpu.cfs_period_us", "cpu"))
    memory_v2 = _read(relative, "memory.max")
    if memory_v2 is not None:
        memory = _number(memory_v2)
        swap = _number(_read(relative, "memory.swap.max"))
        memory_swap = None if memory is None or swap is None else memory + swap
    else:
        memory = _number(_read(relative, "memory.limit_in_bytes", "memory"))
        memory_swap = _number(_read(relative, "memory.memsw.limit_in_bytes", "memory"))
    pids = _read(relative, "pids.max")
    if pids is None:
        pids = _read(relative, "pids.max", "pids")
    return {
        "memory_bytes": memory,
        "memory_swap_bytes": memory_swap,
        "cpu_quota_us": quota,
        "cpu_period_us": period,
        "pids_max": _number(pids),
    }
